"""Chat model on offline `vllm.LLM`, with LoRA adapters that training can swap in.

vLLM pins its own torch and transformers, so it lives in a separate environment (see README);
here it is imported lazily and every failure to import it becomes a ModelError that says so.
vLLM raises RuntimeError as well as ImportError on machines without a usable GPU stack.

The engine and the vLLM module are injectable so the mapping to and from vLLM's objects can be
checked on CPU with a fake engine (tests/models/test_vllm_contract.py).
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from m1.config import ModelSpec
from m1.models.base import ChatRequest, Completion, ModelError, SamplingParams, request_seeds
from m1.models.tiny import ensure_tiny


@dataclass
class VLLMApi:
    """The three vLLM names we use; a fake one can be passed in for tests."""

    LLM: Any
    SamplingParams: Any
    LoRARequest: Any


def load_vllm() -> VLLMApi:
    """Import vLLM or raise a ModelError explaining where it has to be installed."""
    try:
        from vllm import LLM
        from vllm import SamplingParams as VSP
        from vllm.lora.request import LoRARequest
    except (ImportError, RuntimeError) as exc:
        raise ModelError(
            f"vLLM is not usable here ({type(exc).__name__}: {exc}). vLLM needs a CUDA GPU and "
            "pins its own torch and transformers, so install it in its own environment (see "
            "README, section vLLM), or use backend 'hf' or 'openai' (e.g. against `vllm serve`)"
        ) from None
    return VLLMApi(LLM=LLM, SamplingParams=VSP, LoRARequest=LoRARequest)


def chosen_logprobs(token_ids: list[int], logprobs: Any, where: str) -> list[float] | None:
    """Log-prob of each sampled token from vLLM's per-position {token_id: Logprob} mappings."""
    if logprobs is None:
        return None
    if len(logprobs) != len(token_ids):
        raise ModelError(f"{where}: {len(token_ids)} tokens but {len(logprobs)} log-prob entries")
    out: list[float] = []
    for pos, (tid, entry) in enumerate(zip(token_ids, logprobs)):
        if entry is None or tid not in entry:
            raise ModelError(f"{where}: no log-prob for the sampled token {tid} at position {pos}")
        value = entry[tid]
        out.append(float(getattr(value, "logprob", value)))
    return out


class VLLMChatModel:
    """ChatModel on `vllm.LLM`: one batched `generate` per call, token ids and log-probs back."""

    def __init__(self, spec: ModelSpec, name: str, *, engine: Any = None,
                 vllm_module: VLLMApi | Any = None, enable_lora: bool = False,
                 max_lora_rank: int = 16, max_model_len: int | None = None, seed: int = 0,
                 engine_kwargs: dict[str, Any] | None = None) -> None:
        self.spec = spec
        self.name = name
        api = vllm_module if vllm_module is not None else load_vllm()
        self._SamplingParams = api.SamplingParams
        self._LoRARequest = api.LoRARequest
        self.enable_lora = enable_lora or spec.adapter is not None
        self.model_path = self._model_path()
        if engine is None:
            kwargs: dict[str, Any] = dict(
                model=self.model_path, dtype=spec.dtype,
                tensor_parallel_size=spec.tensor_parallel_size,
                gpu_memory_utilization=spec.gpu_memory_utilization, enable_lora=self.enable_lora,
                seed=seed, trust_remote_code=spec.trust_remote_code)
            if self.enable_lora:
                kwargs["max_lora_rank"] = max_lora_rank
            if max_model_len is not None:
                kwargs["max_model_len"] = max_model_len
            kwargs.update(engine_kwargs or {})
            try:
                engine = api.LLM(**kwargs)
            except Exception as exc:
                raise ModelError(f"vllm model {name!r}: could not start an engine for "
                                 f"{self.model_path}: {type(exc).__name__}: {exc}") from exc
        self.llm = engine
        self.tokenizer = engine.get_tokenizer()
        self.calls = 0
        self._lora: Any = None  # the current LoRARequest, or None for the base model
        self._lora_key: tuple[str, str] | None = None
        self._next_lora_id = 1  # vLLM wants ids >= 1, unique per adapter version
        if spec.adapter is not None:  # a trained adapter named in the config: served from the start
            self.set_lora(spec.adapter)

    def __repr__(self) -> str:
        lora = None if self._lora is None else (self._lora_key, self._next_lora_id - 1)
        return f"VLLMChatModel(name={self.name!r}, model={self.model_path!r}, lora={lora!r})"

    def _model_path(self) -> str:
        if self.spec.path:
            return self.spec.path
        if self.spec.tiny is not None:
            return str(ensure_tiny(self.spec.tiny))
        raise ModelError(f"vllm model {self.name!r}: needs `path` or `tiny`")

    # -- adapters ---------------------------------------------------------------------------
    def set_lora(self, path: str | None, name: str = "adapter", reload: bool = False) -> None:
        """Generate with the LoRA adapter in `path` from now on (None: the base model).

        A new adapter id is issued whenever the path changes, or with reload=True when training
        rewrote the adapter in place: vLLM caches adapters by id and would otherwise keep the
        old weights.
        """
        if path is None:
            self._lora, self._lora_key = None, None
            return
        if not self.enable_lora:
            raise ModelError(f"vllm model {self.name!r}: set_lora({path!r}) needs an engine made "
                             "with enable_lora=True")
        if not Path(path).is_dir():
            raise ModelError(f"vllm model {self.name!r}: LoRA adapter folder not found: {path}")
        key = (str(path), name)
        if key == self._lora_key and not reload:
            return
        self._lora = self._LoRARequest(name, self._next_lora_id, str(path))
        self._lora_key = key
        self._next_lora_id += 1

    @property
    def lora_request(self) -> Any:
        return self._lora

    # -- generation -------------------------------------------------------------------------
    def _sampling(self, params: SamplingParams, seed: int | None) -> Any:
        return self._SamplingParams(
            n=1, temperature=float(params.temperature), top_p=float(params.top_p),
            max_tokens=int(params.max_new_tokens), seed=seed,
            # 0 = only the sampled token's log-prob, which is all the trainer needs.
            logprobs=0 if params.logprobs else None)

    def prompt_ids(self, request: ChatRequest) -> list[int]:
        text = self.tokenizer.apply_chat_template(request.messages, tokenize=False,
                                                  add_generation_prompt=True)
        # The template already holds every special token; do not let the tokenizer add more.
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def generate(self, requests: list[ChatRequest], params: SamplingParams) -> list[Completion]:
        """One batched engine call; each request with its seed (`request_seeds`)."""
        self.calls += 1
        if not requests:
            return []
        ids = [self.prompt_ids(r) for r in requests]
        prompts = [{"prompt_token_ids": p} for p in ids]
        if params.seed is None and all(r.seed is None for r in requests):
            sampling: Any = self._sampling(params, None)
        else:
            sampling = [self._sampling(params, s) for s in request_seeds(requests, params)]
        outputs = self.llm.generate(prompts, sampling, use_tqdm=False, lora_request=self._lora)
        if len(outputs) != len(requests):
            raise ModelError(f"vllm model {self.name!r}: {len(requests)} prompts but "
                             f"{len(outputs)} outputs")
        results = []
        for i, (out, sent) in enumerate(zip(outputs, ids)):
            if not out.outputs:
                raise ModelError(f"vllm model {self.name!r}: request {i} returned no output")
            c = out.outputs[0]
            token_ids = [int(t) for t in c.token_ids]
            where = f"vllm model {self.name!r}, request {i}"
            lps = chosen_logprobs(token_ids, c.logprobs, where) if params.logprobs else None
            prompt_ids = list(out.prompt_token_ids) if out.prompt_token_ids is not None else sent
            meta: dict[str, Any] = {"backend": "vllm"}
            if self._lora is not None:
                meta["lora"] = {"name": self._lora_key[1], "id": self._next_lora_id - 1,
                                "path": self._lora_key[0]}
            results.append(Completion(text=c.text, prompt_ids=prompt_ids,
                                      completion_ids=token_ids, logprobs=lps,
                                      finish_reason=str(c.finish_reason or "stop"), meta=meta))
        return results
