"""`m1 serve`: a team behind an OpenAI-compatible chat endpoint, so that any client that speaks the chat API
(the `openai` package, lmms-eval's `openai` model, curl) can ask it questions about videos.

Why it is shaped this way:
- A team answers fastest in batches (one call per model per phase), so requests are not answered one by one: they
  wait in a queue for a short gather window and then run together as one batch of episodes, on the same path
  `m1 infer` uses (`Team.run`), in a single worker thread that owns the team (models are not thread-safe).
- Everything a client sends is untrusted: each bad request gets one JSON error with the status a client can act on
  (400, 401, 413, 429 with Retry-After, 504) and never a stack trace; local files are read only under the roots
  the operator allowed, after resolving symlinks, so `..`, links out of a root and URL-encoded escapes are refused.
  A question is validated as `m1 infer` validates a line (`check_question`); one too long for a model's context or
  the team's prompt budget is a 400 naming both counts, and its batch mates are answered; a body over the limit is
  a 413 before it is read whole, and a question text over `max_text_chars` a 413 before any model tokenizes it.
- A client that hangs up mid-body is one log line, not an internal error.
- The API key is compared in constant time and never written anywhere (logs, traces, errors).
"""

import base64
import binascii
import hmac
import io
import json
import logging
import os
import re
import shutil
import tempfile
import threading
import time
import uuid
from collections import OrderedDict, deque
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import unquote, urlparse

from m1.schema import Episode, Question

from typer import Option as typer_option  # typer is a core dependency (the CLI's)

log = logging.getLogger("m1.serve")

TOLERATED = {"model", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p", "n", "stream",
             "media_io_kwargs", "mm_processor_kwargs", "chat_template_kwargs", "m1", "extra_body", "user", "seed",
             "stop", "stream_options", "frequency_penalty", "presence_penalty", "logprobs", "top_logprobs",
             "response_format"}
OPTION_LINE = re.compile(r"^\s*\(?([A-Z])[.):]\s+(.+?)\s*$")
INSTRUCTION = re.compile(r"^\s*(answer with|please answer|respond with|select the best|best option)", re.I)
TASKS = ("mcq", "open", "grounding", "numeric")
DEFAULT_FRAME_FPS = 1.0
GATHER_ROUNDS = 20  # a batch waits at most this many gather windows for a burst to arrive


class ApiError(Exception):
    """A request the server refuses: its HTTP status, an OpenAI-style error type, and a message naming the field."""

    def __init__(self, status: int, message: str, param: str | None = None, kind: str = "invalid_request_error",
                 headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.kind = status, message, param, kind
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.status}}


@dataclass
class Limits:
    """What one server accepts: media roots, request size, queue length, per-request time, gather window."""

    allowed_roots: list[Path] = field(default_factory=list)
    max_body_bytes: int = 64 << 20
    max_text_chars: int = 1 << 20  # the question's text and options, all together (a bound on tokenizing's cost)
    max_frames: int = 512
    max_queue: int = 64
    timeout_s: float = 300.0
    gather_s: float = 0.05


# ------------------------------------------------------------------ request -> Question

def _bad(msg: str, param: str | None = None) -> ApiError:
    return ApiError(400, msg, param)


def split_options(text: str) -> tuple[str, list[str]]:
    """A question text as lmms-eval and most harnesses write it: the question, then lettered option lines
    (`A. ...`, `A) ...`, `(A) ...`), then perhaps an instruction line ("Answer with the option's letter ...").
    Options are taken only when they run A, B, C, ... in order, so a sentence starting "I. " is left alone."""
    lines = text.strip().splitlines()
    options, first = [], None
    for i, line in enumerate(lines):
        m = OPTION_LINE.match(line)
        if m and m.group(1) == chr(ord("A") + len(options)) and (first is None or i == first + len(options)):
            first = i if first is None else first
            options.append(m.group(2))
    if len(options) < 2:
        return text.strip(), []
    rest = [ln for i, ln in enumerate(lines) if not first <= i < first + len(options) and not INSTRUCTION.match(ln)]
    return "\n".join(rest).strip(), options


def _check_text(n: int, limits: Limits) -> None:
    """413 for a question text (with its options) of more than `limits.max_text_chars` characters: it is refused
    before any tokenizer sees it (a 50 MB question used to take minutes and GBs before failing)."""
    if n > limits.max_text_chars:
        raise ApiError(413, f"the question text is {n} characters: at most {limits.max_text_chars} (--max-text-kb); "
                            "a prompt that long does not fit the team's models", "messages")


def _parse_url(url: str, param: str):
    try:
        return urlparse(url)
    except ValueError:  # e.g. "http://[::1" (an unclosed IPv6 host)
        raise _bad(f"not a valid URL: {url[:100]!r}", param) from None


def _within(path: Path, roots: list[Path]) -> bool:
    return any(path == r or r in path.parents for r in roots)


def local_media(url: str, roots: list[Path], param: str) -> Path:
    """The file a `file://` URL (or a bare absolute path) names, if it lies under an allowed root once every
    symlink is resolved. The URL's percent-escapes are decoded once, and a path holding `..` is refused outright,
    whether written plainly or escaped, so no spelling of a path climbs out of a root."""
    if not roots:
        raise _bad("local files are not served: start m1 serve with --allowed-media-root DIR", param)
    parsed = _parse_url(url, param)
    if parsed.scheme == "file":
        if parsed.netloc not in ("", "localhost"):
            raise _bad(f"file URL with host {parsed.netloc!r}: only local files (file:///abs/path)", param)
        raw = unquote(parsed.path)
    else:
        raw = url
    if "\x00" in raw or "%" in raw:
        raise _bad("the file path holds a NUL or a doubly escaped character", param)
    if not raw.startswith("/"):
        raise _bad(f"file path {raw!r} is not absolute", param)
    if ".." in Path(raw).parts:
        raise _bad(f"file path {raw!r} holds '..'", param)
    try:
        real = Path(raw).resolve(strict=True)
    except (OSError, RuntimeError):
        raise _bad(f"no such video file: {raw}", param) from None
    if not _within(real, roots):
        raise ApiError(400, f"{raw} is outside the allowed media roots", param)
    if not real.is_file():
        raise _bad(f"{raw} is not a file", param)
    return real


def _data_url(url: str, param: str, prefix: str) -> tuple[str, bytes]:
    """(media type, bytes) of a `data:<type>;base64,...` URL whose type starts with `prefix`."""
    head, sep, payload = url.partition(",")
    if not sep or not head.startswith("data:") or not head.endswith(";base64"):
        raise _bad(f"a data URL must read data:{prefix}...;base64,<data>", param)
    mtype = head[5:-7]
    if not mtype.startswith(prefix):
        raise _bad(f"data URL of type {mtype!r}: expected {prefix}*", param)
    try:
        return mtype, base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise _bad("the data URL's payload is not valid base64", param) from None


def _url_of(part: dict, key: str, param: str) -> str:
    val = part.get(key)
    url = val.get("url") if isinstance(val, dict) else val
    if not isinstance(url, str) or not url:
        raise _bad(f"{key} needs a url string", f"{param}.{key}.url")
    return url


def _frames_clip(images: list[tuple[str, str]], fps: float, roots: list[Path], tmp: Path, limits: Limits) -> Path:
    """A list of image parts as one short video at `fps`: the team's tools read videos, so the frames are encoded
    (each resized to the first frame's size, even sides for H.264)."""
    import numpy as np
    from PIL import Image, UnidentifiedImageError

    from m1.video import write_video

    if len(images) > limits.max_frames:
        raise ApiError(413, f"{len(images)} image frames: at most {limits.max_frames}", "messages")
    frames = []
    for url, param in images:
        data = _data_url(url, param, "image/")[1] if url.startswith("data:") else \
            local_media(url, roots, param).read_bytes()
        try:
            img = Image.open(io.BytesIO(data)).convert("RGB")
        except (UnidentifiedImageError, OSError, ValueError, Image.DecompressionBombError):
            raise _bad("an image_url part is not a readable image", param) from None
        frames.append(img)
    w, h = frames[0].size
    w, h = max(2, w - w % 2), max(2, h - h % 2)
    arrays = [np.asarray(f.resize((w, h)) if f.size != (w, h) else f) for f in frames]
    out = tmp / "frames.mp4"
    write_video(out, arrays, max(1, round(fps)), w, h)
    return out


def parse_request(body: object, team_name: str, limits: Limits, tmp: Path) -> tuple[Question, dict]:
    """The Question one chat-completions body asks (its video written under `tmp` when sent inline), and what the
    reply echoes. Raises ApiError naming the field for anything the server cannot answer."""
    if not isinstance(body, dict):
        raise _bad("the body must be a JSON object")
    unknown = sorted(k for k in body if k not in TOLERATED)
    if unknown:
        raise _bad(f"unsupported field {unknown[0]!r}", unknown[0])
    if body.get("stream") not in (None, False):
        raise _bad("stream: true is not supported; send stream: false (or leave it out)", "stream")
    model = body.get("model")
    if model is not None and model != team_name:
        raise ApiError(404, f"model {model!r} is not served here; this server serves {team_name!r}", "model",
                       "not_found_error")
    n = body.get("n", 1)
    if n not in (1, None):
        raise _bad(f"n = {n!r}: one answer per request", "n")
    for key in ("max_tokens", "max_completion_tokens"):
        if body.get(key) is not None and (not isinstance(body[key], int) or isinstance(body[key], bool)
                                          or body[key] < 1):
            raise _bad(f"{key} must be a positive integer, got {body[key]!r}", key)
    if body.get("temperature") is not None and (not isinstance(body["temperature"], (int, float))
                                                or isinstance(body["temperature"], bool)):
        raise _bad(f"temperature must be a number, got {body['temperature']!r}", "temperature")
    for key in ("media_io_kwargs", "mm_processor_kwargs", "chat_template_kwargs"):
        if body.get(key) is not None and not isinstance(body[key], dict):
            raise _bad(f"{key} must be an object", key)
    extra = body.get("m1")
    if extra is None and isinstance(body.get("extra_body"), dict):
        extra = body["extra_body"].get("m1")
    if extra is not None and not isinstance(extra, dict):
        raise _bad("m1 must be an object {question, options, task}", "m1")
    extra = extra or {}
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise _bad("messages must be a non-empty list", "messages")
    texts, videos, images = [], [], []
    fps = DEFAULT_FRAME_FPS
    media = body.get("media_io_kwargs") or {}
    if isinstance(media.get("video"), dict) and isinstance(media["video"].get("fps"), (int, float)) \
            and not isinstance(media["video"]["fps"], bool) and 0 < media["video"]["fps"] <= 120:
        fps = float(media["video"]["fps"])
    for i, msg in enumerate(messages):
        p = f"messages[{i}]"
        if not isinstance(msg, dict):
            raise _bad("each message must be an object", p)
        role = msg.get("role")
        if role not in ("system", "user", "assistant", "developer"):
            raise _bad(f"role {role!r}: expected user, system, developer or assistant", f"{p}.role")
        if role != "user":
            continue  # a system prompt or an earlier turn: the team has its own prompts
        content = msg.get("content")
        if isinstance(content, str):
            texts.append(content)
            continue
        if not isinstance(content, list):
            raise _bad("content must be a string or a list of parts", f"{p}.content")
        for j, part in enumerate(content):
            q = f"{p}.content[{j}]"
            if not isinstance(part, dict):
                raise _bad("each content part must be an object", q)
            kind = part.get("type")
            if kind == "text":
                if not isinstance(part.get("text"), str):
                    raise _bad("a text part needs a text string", f"{q}.text")
                texts.append(part["text"])
            elif kind == "video_url":
                videos.append((_url_of(part, "video_url", q), q))
            elif kind == "image_url":
                images.append((_url_of(part, "image_url", q), q))
                f = part.get("fps")
                if isinstance(f, (int, float)) and not isinstance(f, bool) and 0 < f <= 120:
                    fps = float(f)
            else:
                raise _bad(f"unsupported content part type {kind!r}: text, video_url and image_url are served",
                           f"{q}.type")
    if videos and images:
        raise _bad("send one video: a video_url part or image_url frames, not both", "messages")
    if len(videos) > 1:
        raise _bad(f"{len(videos)} video_url parts: one video per request", "messages")
    if not videos and not images:
        raise _bad("no video: add a video_url part or image_url frames", "messages")
    _check_text(sum(len(t) for t in texts), limits)
    text = "\n".join(t for t in texts if t.strip())
    question, options = split_options(text)
    if "question" in extra:
        if not isinstance(extra["question"], str):
            raise _bad("m1.question must be a string", "m1.question")
        question = extra["question"].strip()
    if "options" in extra:
        opts = extra["options"]
        if not isinstance(opts, list) or not all(isinstance(o, str) and o.strip() for o in opts) or len(opts) > 26:
            raise _bad("m1.options must be a list of at most 26 non-empty strings", "m1.options")
        options = list(opts)
    _check_text(len(question) + sum(len(o) for o in options), limits)
    if not question:
        raise _bad("no question: add a text part (or m1.question)", "messages")
    task = extra.get("task", "mcq" if options else "open")
    if task not in TASKS:
        raise _bad(f"m1.task {task!r}: one of {', '.join(TASKS)}", "m1.task")
    if task == "mcq" and not options:
        raise _bad("an mcq question needs options (lettered lines A. ... or m1.options)", "m1.options")
    from m1.data.loaders import check_question

    qid = extra.get("id") if isinstance(extra.get("id"), str) and extra.get("id").strip() else uuid.uuid4().hex[:16]
    q, problem = check_question({"id": qid, "video": "<upload>", "text": question, "options": options, "task": task})
    if problem:  # the one validation m1 infer and m1 eval apply to a questions line
        raise _bad(f"invalid question: {problem}", "m1" if extra else "messages")
    if videos:
        url, param = videos[0]
        if url.startswith("data:"):
            _, data = _data_url(url, param, "video/")
            path = tmp / "video.mp4"
            path.write_bytes(data)
        elif _parse_url(url, param).scheme in ("http", "https"):
            raise _bad("http(s) video URLs are not fetched: send file:// under an allowed root or a data URL", param)
        else:
            path = local_media(url, limits.allowed_roots, param)
    else:
        path = _frames_clip(images, fps, limits.allowed_roots, tmp, limits)
    from m1.video import VideoError, probe

    try:
        probe(path)
    except (VideoError, OSError) as exc:
        raise _bad(f"unreadable video: {str(exc).replace(str(tmp), '<upload>')}", "messages") from None
    return q.model_copy(update={"video": str(path)}), {"fps": fps}


# ------------------------------------------------------------------ the worker that owns the team

@dataclass
class _Job:
    question: Question
    future: Future
    tmp: Path | None
    cancelled: bool = False


class Batcher:
    """One thread that owns the team: it waits for a first request, gathers what else arrives within
    `gather_s` (up to the team's `limits.batch_episodes`), runs them as one batch through `team.run` and resolves
    each request's future with its episode. `submit` refuses (429) when `max_queue` requests wait or run."""

    def __init__(self, team, limits: Limits):
        self.team, self.limits = team, limits
        self.batch = max(1, int(team.cfg.limits.batch_episodes))
        if hasattr(team, "over_budget_rows"):  # a question too long for a model fails alone (400), not its batch
            team.over_budget_rows = True
        self._queue: list[_Job] = []
        self._cv = threading.Condition()
        self._busy = 0
        self._stop = False
        self.batches: deque[int] = deque(maxlen=1000)  # sizes of the last batches run (tests, the benchmark)
        self._thread = threading.Thread(target=self._loop, name="m1-serve-team", daemon=True)
        self._thread.start()

    def submit(self, q: Question, tmp: Path | None) -> _Job:
        with self._cv:
            if self._stop:
                raise ApiError(503, "the server is shutting down", kind="server_shutting_down")
            if len(self._queue) + self._busy >= self.limits.max_queue:
                wait = max(1, round(self.limits.gather_s + 2))
                raise ApiError(429, f"{self.limits.max_queue} requests are already queued (--max-queue); retry later",
                               kind="rate_limit_error", headers={"Retry-After": str(wait)})
            job = _Job(q, Future(), tmp)
            self._queue.append(job)
            self._cv.notify()
            return job

    def cancel(self, job: _Job) -> None:
        """A request that timed out: dropped if it has not started; else its episode finishes and is discarded."""
        with self._cv:
            job.cancelled = True
            if job in self._queue:
                self._queue.remove(job)
                _cleanup(job.tmp)

    def _loop(self) -> None:
        while True:
            with self._cv:
                while not self._queue and not self._stop:
                    self._cv.wait()
                if not self._queue and self._stop:
                    return
            self._gather()
            with self._cv:
                jobs, self._queue = self._queue[:self.batch], self._queue[self.batch:]
                self._busy = len(jobs)
            if not jobs:
                continue
            self.batches.append(len(jobs))
            try:
                episodes = self.team.run([j.question for j in jobs])
                for j, ep in zip(jobs, episodes):
                    if not j.future.done():  # a timed-out request's future was cancelled
                        j.future.set_result(ep)
            except Exception as exc:  # a model that failed: every request of the batch gets a 500, the server stays
                log.error("batch of %d failed: %s: %s", len(jobs), type(exc).__name__, exc)
                for j in jobs:
                    if not j.future.done():
                        j.future.set_exception(exc)
            finally:
                for j in jobs:
                    _cleanup(j.tmp)
                with self._cv:
                    self._busy = 0
                    self._cv.notify_all()

    def _gather(self) -> None:
        """Let requests that arrive together join one batch: wait `gather_s`, and again while more keep arriving
        (clients of a burst are parsed one after another, so on a busy machine a burst spreads out), at most
        GATHER_ROUNDS times and never once the batch is full."""
        seen = -1
        for _ in range(GATHER_ROUNDS):
            with self._cv:
                n = len(self._queue)
            if n >= self.batch or n == seen:
                return
            seen = n
            time.sleep(self.limits.gather_s)

    def drain(self, timeout: float | None = None) -> None:
        """Refuse new requests, finish those queued and running, then stop the thread."""
        with self._cv:
            self._stop = True
            self._cv.notify_all()
        self._thread.join(timeout)

    @property
    def pending(self) -> int:
        with self._cv:
            return len(self._queue) + self._busy


def _cleanup(tmp: Path | None) -> None:
    if tmp is not None:
        shutil.rmtree(tmp, ignore_errors=True)


# ------------------------------------------------------------------ episode -> reply

def _tokens(messages_or_text, ids) -> int:
    """Tokens of one side of a call: the model's own ids when the backend returned them, else whitespace-separated
    words (rule-based backends have no tokenizer)."""
    if ids is not None:
        return len(ids)
    if isinstance(messages_or_text, str):
        return len(messages_or_text.split())
    n = 0
    for m in messages_or_text or []:
        c = m.get("content") if isinstance(m, dict) else None
        if isinstance(c, str):
            n += len(c.split())
        elif isinstance(c, list):
            n += sum(len(p.get("text", "").split()) for p in c if isinstance(p, dict))
    return n


def completion_body(ep: Episode, team_name: str, trace_url: str) -> dict:
    prompt = sum(_tokens(g.prompt, g.prompt_ids) for g in ep.generations)
    completion = sum(_tokens(g.completion, g.completion_ids) for g in ep.generations)
    answer = ep.final_answer if ep.final_answer is not None else ""
    return {
        "id": f"chatcmpl-{ep.id}", "object": "chat.completion", "created": int(time.time()), "model": team_name,
        "choices": [{"index": 0, "message": {"role": "assistant", "content": answer},
                     "finish_reason": "stop", "logprobs": None}],
        "usage": {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion},
        "m1": {"answer": answer, "reason": ep.final_reason, "aggregation": ep.aggregation,
               "agents": {a.agent: {"answer": a.answer, "parse_ok": a.parse_ok} for a in ep.answers},
               "frames_used": ep.frames_used, "calls": len(ep.generations), "trace_url": trace_url},
    }


# ------------------------------------------------------------------ the app

def create_app(team, limits: Limits, api_key: str | None = None, traces_kept: int = 1000):
    """The FastAPI app serving `team`. `api_key`: the key clients must send as `Authorization: Bearer KEY`."""
    import asyncio
    from contextlib import asynccontextmanager

    from fastapi import FastAPI, Request
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import HTMLResponse, JSONResponse
    from starlette.exceptions import HTTPException as StarletteHTTPException
    from starlette.requests import ClientDisconnect

    name = team.cfg.name
    state = {"draining": False}
    traces: OrderedDict[str, Episode] = OrderedDict()
    batcher = Batcher(team, limits)

    @asynccontextmanager
    async def lifespan(app):
        yield
        state["draining"] = True
        await asyncio.get_running_loop().run_in_executor(None, batcher.drain, limits.timeout_s)

    app = FastAPI(title=f"m1 serve: {name}", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.batcher, app.state.traces, app.state.serve_state = batcher, traces, state

    def error(exc: ApiError) -> JSONResponse:
        return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request, exc):
        return error(ApiError(exc.status_code, str(exc.detail), kind="not_found_error" if exc.status_code == 404
                              else "invalid_request_error"))

    @app.exception_handler(RequestValidationError)
    async def _validation(request, exc):
        return error(_bad("malformed request"))

    @app.exception_handler(Exception)
    async def _internal(request, exc):  # a fault of the server, never of the request: no traceback in the body
        log.error("internal error: %s: %s", type(exc).__name__, exc)
        return error(ApiError(500, "internal server error; see the server's log", kind="server_error"))

    def check_key(request: Request) -> None:
        if api_key is None:
            return
        got = request.headers.get("authorization", "")
        token = got[7:] if got[:7].lower() == "bearer " else ""
        if not hmac.compare_digest(token.encode("utf-8", "replace"), api_key.encode()):
            raise ApiError(401, "missing or wrong API key (Authorization: Bearer ...)", kind="authentication_error")

    @app.get("/v1/models")
    async def models(request: Request):
        try:
            check_key(request)
        except ApiError as exc:
            return error(exc)
        return {"object": "list", "data": [{"id": name, "object": "model", "created": 0, "owned_by": "m1",
                                            "agents": [a.name for a in team.cfg.agents]}]}

    @app.get("/health")
    async def health():
        return {"status": "draining" if state["draining"] else "ok", "pending": batcher.pending}

    @app.get("/traces/{trace_id}")
    async def trace(trace_id: str):
        from m1.trace import render_html

        ep = traces.get(trace_id)
        if ep is None:
            return error(ApiError(404, f"no trace {trace_id!r} (the server keeps the last {traces_kept})",
                                  kind="not_found_error"))
        html = await asyncio.get_running_loop().run_in_executor(None, render_html, ep)
        return HTMLResponse(html)

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        tmp = None
        try:
            if state["draining"]:
                raise ApiError(503, "the server is shutting down", kind="server_shutting_down")
            check_key(request)
            size = request.headers.get("content-length")
            if size is not None and size.isdigit() and int(size) > limits.max_body_bytes:
                raise ApiError(413, f"body of {int(size)} bytes: at most {limits.max_body_bytes}")
            raw = bytearray()
            try:
                async for chunk in request.stream():  # read up to the limit only, whatever Content-Length claimed
                    raw += chunk
                    if len(raw) > limits.max_body_bytes:
                        raise ApiError(413, f"body over {limits.max_body_bytes} bytes")
            except ClientDisconnect:  # the client hung up mid-body: nobody to answer, nothing went wrong here
                log.warning("client %s hung up after %d bytes of its body; request dropped",
                            request.client.host if request.client else "?", len(raw))
                return error(ApiError(400, "the client disconnected before its body was complete"))
            try:
                body = json.loads(raw)
            except (json.JSONDecodeError, UnicodeDecodeError, RecursionError):
                raise _bad("the body is not valid JSON") from None
            tmp = Path(tempfile.mkdtemp(prefix="m1-serve-"))
            loop = asyncio.get_running_loop()
            q, _ = await loop.run_in_executor(None, parse_request, body, name, limits, tmp)
            job = batcher.submit(q, tmp)
            tmp = None  # the batcher removes it once the episode ran
            try:
                ep = await asyncio.wait_for(asyncio.wrap_future(job.future), limits.timeout_s)
            except asyncio.TimeoutError:
                batcher.cancel(job)
                raise ApiError(504, f"no answer within {limits.timeout_s:g} s (--timeout)", kind="timeout") from None
            if ep.error:
                msg = ep.error.replace(str(Path(ep.question.video).parent), "<upload>")
                if msg.startswith("prompt too long: "):  # over a model's context or the prompt budget: both counts
                    raise _bad(msg, "messages")
                raise _bad(f"unreadable video: {msg}", "messages")
            tid = uuid.uuid4().hex
            traces[tid] = ep
            while len(traces) > traces_kept:
                traces.popitem(last=False)
            base = str(request.base_url).rstrip("/")
            return JSONResponse(completion_body(ep, name, f"{base}/traces/{tid}"))
        except ApiError as exc:
            return error(exc)
        finally:
            _cleanup(tmp)

    return app


def serve(team_name: str, host: str, port: int, limits: Limits, api_key_env: str | None = None,
          overrides: list[str] | None = None) -> None:
    """Load the team, then serve it with uvicorn until SIGTERM/SIGINT (requests in flight are finished)."""
    import uvicorn

    from m1.config import load_team
    from m1.team.cpp import make_team

    api_key = None
    if api_key_env:
        api_key = os.environ.get(api_key_env)
        if not api_key:
            raise ValueError(f"--api-key-env {api_key_env}: that variable is not set or empty")
    cfg = load_team(team_name, overrides or [])
    app = create_app(make_team(cfg), limits, api_key)
    uvicorn.run(app, host=host, port=port, log_level="info", timeout_graceful_shutdown=int(limits.timeout_s) + 5)


# ------------------------------------------------------------------ the command (registered in m1/cli.py)

def serve_command(
    team: str = typer_option("tiny", "--team", "-t", help="Team config: a YAML path or a name in configs/team/."),
    host: str = typer_option("127.0.0.1", "--host", help="Address to listen on (0.0.0.0: every interface)."),
    port: int = typer_option(8000, "--port", min=0, max=65535, help="Port to listen on."),
    allowed_media_root: list[Path] = typer_option(None, "--allowed-media-root",
                                                  help="A folder whose videos file:// URLs may name (repeat)."),
    api_key_env: str = typer_option(None, "--api-key-env", help="NAME of the variable holding the key clients "
                                    "must send (Authorization: Bearer KEY); default: no key."),
    max_queue: int = typer_option(64, "--max-queue", min=1, help="Requests waiting or running before 429."),
    timeout: float = typer_option(300.0, "--timeout", min=1.0, help="Seconds a request may take before 504."),
    max_body_mb: float = typer_option(64.0, "--max-body-mb", min=0.001, help="Largest request body (413 above)."),
    max_text_kb: float = typer_option(1024.0, "--max-text-kb", min=0.001,
                                      help="Longest question text with its options, in units of 1,024 "
                                      "characters (413 above; checked before any model tokenizes it)."),
    gather_ms: float = typer_option(50.0, "--gather-ms", min=0.0,
                                    help="How long the first request of a batch waits for others to join it."),
    overrides: list[str] = typer_option(None, "--set", "-s", help="Config override key.path=value (repeat)."),
) -> None:
    """Serve a team on an OpenAI-compatible chat endpoint (POST /v1/chat/completions, GET /v1/models).

    Requests that arrive together run as one batch through the team. SIGTERM/SIGINT finish the requests in
    flight and refuse new ones. See docs/serving.md."""
    from m1.config import ConfigError
    from m1.errors import fail

    try:
        import fastapi  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError as exc:
        fail(f"m1 serve needs the serve extra ({exc.name} is missing): pip install -e '.[serve]'")
    roots = []
    for r in allowed_media_root or []:
        if not Path(r).is_dir():
            fail(f"--allowed-media-root {r}: not a folder")
        roots.append(Path(r).resolve())
    limits = Limits(allowed_roots=roots, max_body_bytes=int(max_body_mb * (1 << 20)), max_queue=max_queue,
                    timeout_s=timeout, gather_s=gather_ms / 1000, max_text_chars=int(max_text_kb * 1024))
    try:
        serve(team, host, port, limits, api_key_env, overrides)
    except (ConfigError, ValueError) as exc:
        fail(str(exc))
