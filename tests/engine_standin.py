"""A CPU stand-in for a vLLM rollout engine: a tiny HF causal LM behind vLLM's HTTP shapes.

Serves exactly the endpoints and JSON fields m1/models/vllm_client.py uses (see its docstring), so the
client, the launcher and weight sync are tested without a GPU:
  GET /health, GET /v1/models, POST /v1/completions (token-id prompts, seeded sampling, logprobs,
  prompt_logprobs, echo, return_token_ids / return_tokens_as_token_ids), POST /v1/load_lora_adapter,
  POST /v1/unload_lora_adapter, and in dev mode (VLLM_SERVER_DEV_MODE=1) POST /collective_rpc with
  reload_weights and POST /reset_prefix_cache.

Weight reloads behave as vLLM 0.32's do (tests/models/test_vllm_real.py checks the real one): `reload_weights` reads the
folder the server was started from again, and `update_config` (pointing it at another folder) fails with the
HTTP 500 vLLM 0.32 answers. `--stale-reload` makes `reload_weights` succeed without loading anything, the silent
failure the client's reload check must catch. /v1/models gives the model folder as the base model's `root`.

Sampled tokens' log-probs are log_softmax(logits / T) in float32 (the learner's quantity); prompt
log-probs are at temperature 1, as vLLM computes them. One lock serialises model use, so
concurrent requests are handled one at a time, each with its own seeded torch Generator.

    python tests/engine_standin.py --model FOLDER --port P [--host 127.0.0.1] [--served-model-name NAME]
                                   [--stale-reload] [--latency-ms L]

`--latency-ms L` adds L ms of waiting to every completion request, outside the model lock (requests overlap in it),
as a GPU engine's decoding time would: the asynchronous-rollout benchmark's fixed engine latency.
"""
from __future__ import annotations

import argparse
import copy
import os
import threading
import time
import uuid
from pathlib import Path
from typing import Any


def _error(status: int, message: str, kind: str):
    from fastapi.responses import JSONResponse

    return JSONResponse(status_code=status, content={"error": {"message": message, "type": kind, "param": None,
                                                               "code": status}})


class Engine:
    """The base model, LoRA-adapted copies of it by name, and the sampling loop."""

    def __init__(self, folder: str, served_name: str, stale_reload: bool = False, latency_s: float = 0.0) -> None:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.torch = torch
        self.served_name = served_name
        self.folder = str(Path(folder).absolute())
        self.stale_reload = stale_reload
        self.latency_s = latency_s
        self.tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True)
        self.base = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, local_files_only=True).eval()
        self.eos = self._eos_ids(self.base)
        self.loras: dict[str, tuple[str, Any]] = {}  # name -> (adapter folder, model with the adapter)
        self.lock = threading.Lock()

    def _eos_ids(self, model) -> set[int]:
        ids = set()
        raw = getattr(model.generation_config, "eos_token_id", None)
        for x in ([raw] if isinstance(raw, int) else list(raw or [])) + [self.tokenizer.eos_token_id]:
            if x is not None:
                ids.add(int(x))
        return ids

    def _with_adapter(self, folder: str):
        from peft import PeftModel

        return PeftModel.from_pretrained(copy.deepcopy(self.base), folder, is_trainable=False).eval()

    def model_for(self, name: str | None):
        if name in (None, self.served_name):
            return self.base
        if name in self.loras:
            return self.loras[name][1]
        return None

    # -- weights ----------------------------------------------------------------------------
    def load_lora(self, name: str, folder: str) -> None:
        with self.lock:
            self.loras[name] = (folder, self._with_adapter(folder))

    def reload(self) -> None:
        """Full weights from the folder the server was started from; adapters stay applied on top, as in vLLM."""
        from transformers import AutoModelForCausalLM

        if self.stale_reload:
            return
        with self.lock:
            fresh = AutoModelForCausalLM.from_pretrained(self.folder, dtype=self.torch.float32,
                                                         local_files_only=True).eval()
            self.base.load_state_dict(fresh.state_dict())
            self.loras = {n: (f, self._with_adapter(f)) for n, (f, _) in self.loras.items()}

    # -- compute ----------------------------------------------------------------------------
    def prompt_logprobs(self, model, ids: list[int]) -> list[dict[str, Any] | None]:
        """Per prompt position (the first has none), the token's log-prob at temperature 1 with its rank."""
        torch = self.torch
        with torch.inference_mode():
            logits = model(input_ids=torch.tensor([ids])).logits[0, :-1].float()
        logp = torch.log_softmax(logits, dim=-1)
        out: list[dict[str, Any] | None] = [None]
        for pos, tok in enumerate(ids[1:]):
            value = float(logp[pos, tok])
            rank = int((logp[pos] > logp[pos, tok]).sum()) + 1
            out.append({str(tok): {"logprob": value, "rank": rank,
                                   "decoded_token": self.tokenizer.decode([tok])}})
        return out

    def sample(self, model, ids: list[int], max_tokens: int, temperature: float, top_p: float, top_k: int,
               seed: int | None) -> tuple[list[int], list[float], str]:
        """Decode with a KV cache; the log-prob of each chosen token is log_softmax(logits / T) before top-k/p."""
        torch = self.torch
        gen = torch.Generator().manual_seed(seed if seed is not None else int.from_bytes(os.urandom(4), "little"))
        tokens: list[int] = []
        logprobs: list[float] = []
        past = None
        inp = torch.tensor([ids])
        finish = "length"
        with torch.inference_mode():
            for _ in range(max_tokens):
                out = model(input_ids=inp, past_key_values=past, use_cache=True)
                past = out.past_key_values
                logits = out.logits[0, -1].float()
                if temperature > 0:
                    logp = torch.log_softmax(logits / temperature, dim=-1)
                    probs = logp.exp()
                    if top_k and top_k > 0:
                        kth = torch.topk(probs, min(top_k, probs.numel())).values[-1]
                        probs = torch.where(probs >= kth, probs, torch.zeros_like(probs))
                    if top_p < 1.0:
                        sorted_p, order = torch.sort(probs, descending=True)
                        keep = (sorted_p.cumsum(0) - sorted_p) < top_p * sorted_p.sum()
                        mask = torch.zeros_like(probs, dtype=torch.bool)
                        mask[order[keep]] = True
                        probs = torch.where(mask, probs, torch.zeros_like(probs))
                    tok = int(torch.multinomial(probs / probs.sum(), 1, generator=gen))
                else:
                    logp = torch.log_softmax(logits, dim=-1)
                    tok = int(logits.argmax())
                tokens.append(tok)
                logprobs.append(float(logp[tok]))
                if tok in self.eos:
                    finish = "stop"
                    break
                inp = torch.tensor([[tok]])
        return tokens, logprobs, finish


def build_app(engine: Engine, dev_mode: bool):
    from fastapi import FastAPI
    from fastapi.responses import JSONResponse, PlainTextResponse

    app = FastAPI()

    @app.get("/health")
    def health():
        return PlainTextResponse("", status_code=200)

    @app.get("/v1/models")
    def models():
        data = [{"id": engine.served_name, "object": "model", "root": engine.folder, "parent": None}]
        data += [{"id": n, "object": "model", "root": f, "parent": engine.served_name}
                 for n, (f, _) in engine.loras.items()]
        return {"object": "list", "data": data}

    @app.post("/v1/completions")
    def completions(body: dict[str, Any]):
        name = body.get("model")
        if int(body.get("n", 1)) != 1:
            return _error(400, "the stand-in serves n=1 only", "BadRequestError")
        prompt = body.get("prompt")
        if isinstance(prompt, str):
            prompt = engine.tokenizer(prompt, add_special_tokens=False)["input_ids"]
        if not isinstance(prompt, list) or not prompt or not all(isinstance(t, int) for t in prompt):
            return _error(400, "prompt must be a non-empty list of token ids or a string", "BadRequestError")
        max_tokens = int(body.get("max_tokens") if body.get("max_tokens") is not None else 16)
        temperature = float(body.get("temperature") if body.get("temperature") is not None else 1.0)
        top_p = float(body.get("top_p") if body.get("top_p") is not None else 1.0)
        top_k = int(body.get("top_k") or 0)
        echo = bool(body.get("echo"))
        n_logprobs = body.get("logprobs")
        n_prompt_logprobs = body.get("prompt_logprobs")
        if n_prompt_logprobs is None and echo and n_logprobs is not None:
            n_prompt_logprobs = n_logprobs
        if engine.latency_s and max_tokens > 0:
            time.sleep(engine.latency_s)
        with engine.lock:
            model = engine.model_for(name)
            if model is None:
                return _error(404, f"The model `{name}` does not exist.", "NotFoundError")
            tokens, lps, finish = ([], [], "length")
            if max_tokens > 0:
                tokens, lps, finish = engine.sample(model, prompt, max_tokens, temperature, top_p, top_k,
                                                    body.get("seed"))
            plp = engine.prompt_logprobs(model, prompt) if n_prompt_logprobs is not None else None
        as_ids = bool(body.get("return_tokens_as_token_ids"))
        tok_str = (lambda t: f"token_id:{t}") if as_ids else (lambda t: engine.tokenizer.decode([t]))
        text = engine.tokenizer.decode(tokens, skip_special_tokens=bool(body.get("skip_special_tokens", True)))
        logprobs = None
        if n_logprobs is not None:
            shown, values = list(tokens), list(lps)
            if echo:
                shown = list(prompt) + shown
                values = [None if e is None else next(iter(e.values()))["logprob"] for e in plp] + values
            logprobs = {"text_offset": [], "token_logprobs": values, "tokens": [tok_str(t) for t in shown],
                        "top_logprobs": [None if v is None else {tok_str(t): v} for t, v in zip(shown, values)]}
        if echo:
            text = engine.tokenizer.decode(prompt) + text
        choice: dict[str, Any] = {"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish,
                                  "stop_reason": None, "prompt_logprobs": plp}
        if body.get("return_token_ids"):
            choice.update(token_ids=tokens, prompt_token_ids=list(prompt))
        return {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion", "created": int(time.time()),
                "model": name or engine.served_name, "choices": [choice],
                "usage": {"prompt_tokens": len(prompt), "completion_tokens": len(tokens),
                          "total_tokens": len(prompt) + len(tokens)}}

    @app.post("/v1/load_lora_adapter")
    def load_lora_adapter(body: dict[str, Any]):
        name, path = body.get("lora_name"), body.get("lora_path")
        if not name or not path:
            return _error(400, "Both 'lora_name' and 'lora_path' must be provided.", "InvalidUserInput")
        if name in engine.loras:
            return _error(400, f"The lora adapter '{name}' has already been loaded.", "InvalidUserInput")
        if not (Path(path) / "adapter_config.json").is_file():
            return _error(404, f"No adapter found for {path}", "NotFoundError")
        try:
            engine.load_lora(name, path)
        except Exception as exc:  # a broken adapter folder is the caller's error, as in vLLM
            return _error(400, f"{type(exc).__name__}: {exc}", "BadRequestError")
        return PlainTextResponse(f"Success: LoRA adapter '{name}' added successfully.")

    @app.post("/v1/unload_lora_adapter")
    def unload_lora_adapter(body: dict[str, Any]):
        name = body.get("lora_name")
        with engine.lock:
            if name not in engine.loras:
                return _error(404, f"The lora adapter '{name}' cannot be found.", "NotFoundError")
            del engine.loras[name]
        return PlainTextResponse(f"Success: LoRA adapter '{name}' removed successfully.")

    if dev_mode:
        @app.post("/collective_rpc")
        def collective_rpc(body: dict[str, Any]):
            method, args = body.get("method"), body.get("args") or []
            if method == "update_config":  # vLLM 0.32's answer to {"model_config": {"model": FOLDER}}
                return _error(500, "Field '_hf_config_revision' not found in ModelConfig", "InternalServerError")
            elif method == "reload_weights":
                try:
                    engine.reload()
                except (OSError, ValueError, RuntimeError) as exc:
                    return _error(500, f"reload_weights: {exc}", "InternalServerError")
            else:
                return _error(400, f"the stand-in has no worker method {method!r}", "BadRequestError")
            return JSONResponse({"results": [None]})

        @app.post("/reset_prefix_cache")
        def reset_prefix_cache():
            return PlainTextResponse("", status_code=200)

    return app


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--served-model-name", default=None)
    parser.add_argument("--stale-reload", action="store_true",
                        help="reload_weights answers success and loads nothing (vLLM 0.32's silent stale reload)")
    parser.add_argument("--latency-ms", type=float, default=0.0,
                        help="wait this long in every completion request, outside the model lock")
    args = parser.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch
    import uvicorn

    torch.set_num_threads(1)
    engine = Engine(args.model, args.served_model_name or args.model, args.stale_reload, args.latency_ms / 1000)  # loaded before the port opens
    dev_mode = os.environ.get("VLLM_SERVER_DEV_MODE", "") in ("1", "true", "True")
    uvicorn.run(build_app(engine, dev_mode), host=args.host, port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
