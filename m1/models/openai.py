"""Chat and vision models behind any OpenAI-compatible `/v1/chat/completions` endpoint.

Works with OpenAI itself, `vllm serve`, `transformers serve` and similar servers. The client's
own retries are switched off: we run our own loop (exponential backoff with full jitter,
`Retry-After` honoured) so that attempts are counted, bounded and logged in one place, and so
that the API key can be scrubbed from every message we produce.

The key is read from the environment variable *named* by `ModelSpec.api_key_env`; it is never
stored in our own attributes, never put in a repr, an exception text, a log line or a result.
"""
from __future__ import annotations

import base64
import email.utils
import io
import logging
import os
import random
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor, wait
from fractions import Fraction
from pathlib import Path
from typing import Any

import numpy as np

from m1.config import ModelSpec
from m1.models.base import (ChatRequest, Completion, ModelError, SamplingParams, ServerUnavailable, VisionRequest,
                            request_seeds)
from m1.video import write_video

log = logging.getLogger(__name__)

DEFAULT_BASE_URL = "https://api.openai.com/v1"
PLACEHOLDER_KEY = "EMPTY"  # what local servers without auth get; not a secret
MAX_DETAIL_CHARS = 400


class _Secret:
    """Holds the key for scrubbing only; prints as *** wherever it ends up."""

    __slots__ = ("_value",)

    def __init__(self, value: str) -> None:
        self._value = value

    def reveal(self) -> str:
        return self._value

    def __repr__(self) -> str:
        return "***"

    __str__ = __repr__


class _Cancelled(ModelError):
    """A request given up because a sibling in the same batch failed."""


class _Adapted(Exception):
    """The request was rewritten after a 400 (see `_adapt`); send it again at once."""


class _Retryable(Exception):
    """One failed attempt that may succeed later; carries the server's wait hint, if any."""

    def __init__(self, detail: str, retry_after: float | None = None) -> None:
        super().__init__(detail)
        self.detail = detail
        self.retry_after = retry_after


def parse_retry_after(headers: Any) -> float | None:
    """Seconds to wait from `retry-after-ms` or `Retry-After` (seconds or an HTTP date)."""
    if headers is None:
        return None
    ms = headers.get("retry-after-ms")
    if ms is not None:
        try:
            return max(0.0, float(ms) / 1000.0)
        except ValueError:
            pass
    raw = headers.get("retry-after")
    if raw is None:
        return None
    try:
        return max(0.0, float(raw))
    except ValueError:
        pass
    try:
        when = email.utils.parsedate_to_datetime(raw)
    except (TypeError, ValueError):
        return None
    if when is None:
        return None
    return max(0.0, when.timestamp() - time.time())


class _OpenAIBackend:
    """Shared client, retry loop, concurrency and key hygiene for the chat and vision models."""

    remote = True  # I/O-bound: the engine may call several such models of one phase at once
    backoff_base = 0.5  # seconds; attempt k sleeps uniform(0, min(cap, base * 2**k))
    backoff_cap = 20.0
    retry_after_cap = 60.0  # never wait longer than this on a server's Retry-After

    def __init__(self, spec: ModelSpec, name: str) -> None:
        if not spec.path:
            raise ModelError(f"openai model {name!r}: `path` (the served model name) is required")
        self.spec = spec
        self.name = name
        self.model_name = spec.path
        self.base_url = spec.base_url or os.environ.get("OPENAI_BASE_URL") or None
        key = os.environ.get(spec.api_key_env) or None
        if key is None:
            if self.base_url is None:
                raise ModelError(
                    f"openai model {name!r} ({self.model_name}): no API key: the environment "
                    f"variable {spec.api_key_env} is not set and no base_url is given (set "
                    f"{spec.api_key_env}, or set base_url for a local server without auth)")
            key = PLACEHOLDER_KEY
        # Only a real key needs scrubbing; the placeholder is public.
        self._secret = _Secret(key) if key != PLACEHOLDER_KEY else None
        self.calls = 0  # generate/describe batches
        self.requests_sent = 0  # HTTP attempts, retries included
        self._lock = threading.Lock()
        self._send_logprobs = True  # flips off once if the server rejects the field
        self._max_tokens_field = "max_tokens"  # or max_completion_tokens for newer OpenAI models
        try:
            import openai
        except ImportError as exc:  # pragma: no cover - openai is a core dependency
            raise ModelError(f"openai model {name!r}: the `openai` package is missing: {exc}") from None
        self._openai = openai
        self._client = openai.OpenAI(api_key=key, base_url=self.base_url, max_retries=0,
                                     timeout=spec.timeout)
        del key

    # -- hygiene -------------------------------------------------------------------------
    def __repr__(self) -> str:
        return (f"{type(self).__name__}(name={self.name!r}, model={self.model_name!r}, "
                f"base_url={self._scrub(self.shown_url)!r}, key_env={self.spec.api_key_env!r}, "
                f"concurrency={self.spec.concurrency}, timeout={self.spec.timeout}, "
                f"max_retries={self.spec.max_retries})")

    @property
    def shown_url(self) -> str:
        return self.base_url or DEFAULT_BASE_URL

    def _scrub(self, text: str) -> str:
        if self._secret is not None:
            text = text.replace(self._secret.reveal(), "***")
        return text

    def _where(self) -> str:
        return self._scrub(f"openai model {self.name!r} ({self.model_name} at {self.shown_url})")

    def _detail(self, exc: BaseException) -> str:
        text = getattr(exc, "message", None) or str(exc) or type(exc).__name__
        text = self._scrub(" ".join(str(text).split()))
        return text if len(text) <= MAX_DETAIL_CHARS else text[:MAX_DETAIL_CHARS] + "..."

    # -- one request -----------------------------------------------------------------------
    def _body(self, messages: list[dict[str, Any]], params: SamplingParams, seed: int | None,
              extra_body: dict[str, Any] | None = None) -> dict:
        body: dict[str, Any] = {
            "model": self.model_name,
            "messages": messages,
            self._max_tokens_field: int(params.max_new_tokens),
            "temperature": float(params.temperature),
            "top_p": float(params.top_p),
        }
        if seed is not None:
            body["seed"] = int(seed)
        if params.logprobs and self._send_logprobs:
            body["logprobs"] = True
        if extra_body:  # fields of the server's own (the openai client sends them as they are)
            body["extra_body"] = extra_body
        return body

    def _attempt(self, body: dict[str, Any]) -> tuple[Any, Exception | None]:
        """One HTTP call: (response, None), or (None, failure) where the failure is a
        _Retryable, an _Adapted or a ModelError. Failures are built, not raised, inside the
        except blocks, so the client's exception (which may quote the key) is never chained.
        """
        openai = self._openai
        with self._lock:
            self.requests_sent += 1
        try:
            return self._client.chat.completions.create(**body, timeout=self.spec.timeout), None
        except openai.APIStatusError as exc:
            status = exc.status_code
            detail = self._detail(exc)
            if status == 408 or status == 429 or status >= 500:
                return None, _Retryable(f"HTTP {status}: {detail}",
                                        parse_retry_after(exc.response.headers))
            if status == 400 and self._adapt(body, detail):
                return None, _Adapted()
            hint = {401: f" (check the API key in ${self.spec.api_key_env})",
                    403: " (the key has no access to this model)",
                    404: " (unknown model name or wrong base_url)"}.get(status, "")
            return None, ModelError(f"{self._where()}: HTTP {status}{hint}: {detail}")
        except openai.APITimeoutError as exc:
            return None, _Retryable(f"timed out after {self.spec.timeout} s ({self._detail(exc)})")
        except openai.APIConnectionError as exc:
            cause = exc.__cause__
            extra = f": {self._detail(cause)}" if cause is not None else ""
            return None, _Retryable(f"connection error ({self._detail(exc)}{extra})")
        except openai.OpenAIError as exc:
            return None, ModelError(f"{self._where()}: {type(exc).__name__}: {self._detail(exc)}")

    def _adapt(self, body: dict[str, Any], detail: str) -> bool:
        """Rewrite the request once for servers that reject `logprobs` or `max_tokens`."""
        low = detail.lower()
        if "logprobs" in body and "logprobs" in low:
            log.warning("%s rejects logprobs; continuing without them", self._where())
            self._send_logprobs = False
            del body["logprobs"]
            return True
        if "max_tokens" in body and "max_completion_tokens" in low:
            self._max_tokens_field = "max_completion_tokens"
            body["max_completion_tokens"] = body.pop("max_tokens")
            return True
        return False

    def _backoff(self, attempt: int, retry_after: float | None) -> float:
        if retry_after is not None:
            return min(retry_after, self.retry_after_cap)
        return random.uniform(0.0, min(self.backoff_cap, self.backoff_base * (2 ** attempt)))

    def _complete(self, messages: list[dict[str, Any]], params: SamplingParams,
                  seed: int | None, stop: threading.Event | None = None,
                  extra_body: dict[str, Any] | None = None) -> Completion:
        """One chat with retries; gives up early once `stop` is set (a sibling request failed)."""
        stop = stop or threading.Event()
        body = self._body(messages, params, seed, extra_body)
        adaptations = 0
        attempt = 0
        while True:
            if stop.is_set():
                raise _Cancelled(f"{self._where()}: cancelled because another request of the "
                                 "batch failed")
            response, failure = self._attempt(body)
            if failure is None:
                break
            if isinstance(failure, _Adapted):
                # Bounded: each adaptation removes or renames one field of the body.
                adaptations += 1
                if adaptations > 2:
                    raise ModelError(f"{self._where()}: the server keeps rejecting the request "
                                     f"after adapting it (fields: {sorted(body)})")
                continue
            if not isinstance(failure, _Retryable):
                raise failure
            if attempt >= self.spec.max_retries:
                raise ServerUnavailable(f"{self._where()}: failed after {attempt + 1} attempt(s); "
                                 f"last error: {failure.detail}")
            delay = self._backoff(attempt, failure.retry_after)
            log.warning("%s: %s; retry %d/%d in %.2f s", self._where(), failure.detail,
                        attempt + 1, self.spec.max_retries, delay)
            stop.wait(delay)
            attempt += 1
        return self._to_completion(response)

    def _to_completion(self, response: Any) -> Completion:
        choices = getattr(response, "choices", None)
        if not choices:
            raise ModelError(f"{self._where()}: the response has no choices: "
                             f"{self._scrub(repr(response))[:MAX_DETAIL_CHARS]}")
        choice = choices[0]
        message = getattr(choice, "message", None)
        text = getattr(message, "content", None) or ""
        logprobs = None
        content = getattr(getattr(choice, "logprobs", None), "content", None)
        if content:
            logprobs = [float(t.logprob) for t in content]
        meta: dict[str, Any] = {"backend": "openai", "model": getattr(response, "model", None)}
        usage = getattr(response, "usage", None)
        if usage is not None:
            meta["usage"] = {"prompt_tokens": usage.prompt_tokens,
                             "completion_tokens": usage.completion_tokens}
        return Completion(text=self._scrub(text), prompt_ids=None, completion_ids=None,
                          logprobs=logprobs, finish_reason=str(choice.finish_reason or "stop"),
                          meta=meta)

    # -- batches ---------------------------------------------------------------------------
    def _run_batch(self, messages: list[list[dict[str, Any]]], params: SamplingParams,
                   seeds: list[int | None]) -> list[Completion]:
        """Send all chats at once through a pool of `spec.concurrency` threads, keeping order.

        Each chat with its seed (`request_seeds`): a batch is reproducible, yet K copies of the same
        prompt (GRPO rollouts) still sample differently.
        """
        with self._lock:
            self.calls += 1
        if not messages:
            return []
        workers = max(1, min(int(self.spec.concurrency), len(messages)))
        stop = threading.Event()

        def one(m: list[dict[str, Any]], s: int | None) -> Completion:
            try:
                return self._complete(m, params, s, stop)
            except BaseException:
                stop.set()
                raise

        pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix=f"openai-{self.name}")
        try:
            futures = [pool.submit(one, m, s) for m, s in zip(messages, seeds)]
            wait(futures)  # a failure sets `stop`, so the others end quickly
            errors = [f.exception() for f in futures if not f.cancelled() and f.exception()]
            if errors:
                # Report the root failure, not the siblings it cancelled.
                raise next((e for e in errors if not isinstance(e, _Cancelled)), errors[0])
            return [f.result() for f in futures]
        finally:
            # After a failure, queued requests are dropped and retrying ones stop at their next
            # attempt; requests already on the wire end within `timeout`.
            stop.set()
            pool.shutdown(wait=True, cancel_futures=True)

    def close(self) -> None:
        self._client.close()


class OpenAIChatModel(_OpenAIBackend):
    """A ChatModel served over HTTP. No token ids; log-probs only if the server returns them."""

    def generate(self, requests: list[ChatRequest], params: SamplingParams) -> list[Completion]:
        return self._run_batch([list(r.messages) for r in requests], params, request_seeds(requests, params))


def encode_jpeg(frame: np.ndarray, quality: int = 90) -> str:
    """One HxWx3 uint8 RGB frame as a `data:image/jpeg;base64,...` URL."""
    from PIL import Image

    arr = np.asarray(frame)
    if arr.ndim != 3 or arr.shape[2] != 3:
        raise ModelError(f"encode_jpeg: a frame must be H x W x 3, got shape {arr.shape}")
    if arr.dtype != np.uint8:
        arr = np.clip(arr, 0, 255).astype(np.uint8)
    buf = io.BytesIO()
    Image.fromarray(arr, "RGB").save(buf, format="JPEG", quality=quality)
    return "data:image/jpeg;base64," + base64.b64encode(buf.getvalue()).decode("ascii")


def _clip_frames(request: VisionRequest) -> np.ndarray:
    """The request's frames as T x H x W x 3, checked against its timestamps."""
    frames = np.asarray(request.frames)
    if frames.ndim != 4 or frames.shape[-1] != 3:
        raise ModelError(f"vision request: frames must be T x H x W x 3, got shape {frames.shape}")
    if len(request.timestamps) != frames.shape[0]:
        raise ModelError(f"vision request: {frames.shape[0]} frames but "
                         f"{len(request.timestamps)} timestamps")
    return frames


def vision_messages(request: VisionRequest) -> list[dict[str, Any]]:
    """Frames in time order, each preceded by its timestamp, then the question."""
    frames = _clip_frames(request)
    parts: list[dict[str, Any]] = []
    for frame, t in zip(frames, request.timestamps):
        parts.append({"type": "text", "text": f"Frame at {float(t):.2f} s:"})
        parts.append({"type": "image_url", "image_url": {"url": encode_jpeg(frame)}})
    parts.append({"type": "text", "text": request.prompt})
    return _with_system(request, parts)


def _with_system(request: VisionRequest, parts: list[dict[str, Any]]) -> list[dict[str, Any]]:
    messages: list[dict[str, Any]] = []
    if request.system:
        messages.append({"role": "system", "content": request.system})
    messages.append({"role": "user", "content": parts})
    return messages


def clip_grid(timestamps: list[float]) -> tuple[Fraction, list[int]]:
    """A clip's frame rate and each frame's slot on that rate's grid, so an mp4 keeps the clip's timing.

    The rate is one over the median step between frames (a clip sampled from a video has steps that differ by a
    source frame); slot k is shown at k / rate. A clip with gaps (frames from separate moments) keeps them as
    skipped slots. Two frames that would share a slot get consecutive ones.
    """
    times = [float(t) for t in timestamps]
    if any(b < a for a, b in zip(times, times[1:])):
        raise ModelError(f"vision request: timestamps must not decrease for a video clip, got {times}")
    steps = sorted(b - a for a, b in zip(times, times[1:]) if b - a > 1e-9)
    rate = Fraction(1.0 / steps[len(steps) // 2]).limit_denominator(1001) if steps else Fraction(1)
    slots: list[int] = []
    for t in times:
        slot = round((t - times[0]) * rate)
        slots.append(slot if not slots or slot > slots[-1] else slots[-1] + 1)
    return rate, slots


def encode_mp4(frames: np.ndarray, timestamps: list[float], target: Path | io.BytesIO) -> Fraction:
    """Write a clip as an H.264 mp4 at its own rate (`clip_grid`) into `target`; returns the rate.

    H.264 in yuv420p needs even sides, so an odd height or width gets its last row or column repeated once.
    """
    arr = np.asarray(frames)
    if arr.dtype != np.uint8:
        arr = np.clip(arr, 0, 255).astype(np.uint8)
    pad_h, pad_w = arr.shape[1] % 2, arr.shape[2] % 2
    if pad_h or pad_w:
        arr = np.pad(arr, ((0, 0), (0, pad_h), (0, pad_w), (0, 0)), mode="edge")
    rate, slots = clip_grid(timestamps)
    write_video(target, arr, rate, arr.shape[2], arr.shape[1], pts=slots)
    return rate


def video_messages(request: VisionRequest, url: str) -> list[dict[str, Any]]:
    """The clip as one video_url part, then one text part: where the clip lies in its source, and the question.

    The mp4 starts at 0 s, so the text says which span of the source video it shows.
    """
    times = [float(t) for t in request.timestamps]
    span = (f"The video shows {len(times)} frames from {times[0]:.2f} s to {times[-1]:.2f} s of the source video."
            if times else "The video has no frames.")
    parts = [{"type": "video_url", "video_url": {"url": url}},
             {"type": "text", "text": f"{span}\n{request.prompt}"}]
    return _with_system(request, parts)


class OpenAIVisionModel(_OpenAIBackend):
    """A VisionModel served over HTTP: a clip goes as base64 JPEG frames, or (`video_input: video_url`) as one mp4
    that keeps its timing, inline or as a file the server reads."""

    def __init__(self, spec: ModelSpec, name: str) -> None:
        super().__init__(spec, name)
        self.video_root: Path | None = None
        if spec.video_input == "video_url" and spec.video_transport == "file":
            root = Path(spec.video_root or "").expanduser().resolve()
            if not root.is_dir():
                raise ModelError(f"{self._where()}: video_root {root} is not an existing folder (video_transport: "
                                 "file writes each clip there for the server to read)")
            self.video_root = root

    def describe(self, requests: list[VisionRequest], params: SamplingParams) -> list[Completion]:
        seeds = request_seeds(requests, params)
        if self.spec.video_input == "frames":
            return self._run_batch([vision_messages(r) for r in requests], params, seeds)
        written: list[Path] = []
        try:
            messages = [video_messages(r, self._video_url(r, written)) for r in requests]
            return self._run_batch(messages, params, seeds)
        finally:
            # the server has read every file once its batch is answered (or given up)
            for path in written:
                try:
                    path.unlink(missing_ok=True)
                except OSError as exc:
                    log.warning("%s: could not remove the clip file %s: %s", self._where(), path, exc)

    def _video_url(self, request: VisionRequest, written: list[Path]) -> str:
        """The request's clip as an mp4 data URL, or written under video_root as a file:// URL."""
        frames = _clip_frames(request)
        if frames.shape[0] == 0:
            raise ModelError(f"{self._where()}: video_input video_url needs at least one frame, got none")
        path = None
        if self.video_root is not None:
            path = self.video_root / f"m1-clip-{os.getpid()}-{uuid.uuid4().hex}.mp4"
            written.append(path)
        buf = io.BytesIO()
        try:
            encode_mp4(frames, request.timestamps, buf if path is None else path)
        except ModelError:
            raise
        except Exception as exc:  # PyAV's and the file system's errors, each named with the model
            where = "in memory" if path is None else f"to {path}"
            raise ModelError(f"{self._where()}: cannot encode the clip as mp4 {where}: "
                             f"{type(exc).__name__}: {exc}") from exc
        if path is None:
            return "data:video/mp4;base64," + base64.b64encode(buf.getvalue()).decode("ascii")
        return path.as_uri()
