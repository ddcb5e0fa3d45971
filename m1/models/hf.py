"""transformers backends: a chat model and a Qwen2.5-VL-style video describer.

Both take the whole list of requests of a phase and run one left-padded `model.generate` call,
because batching every agent of every episode in flight is what makes rollouts fast; a vision model splits a list
longer than its `max_batch_requests` into calls of that many (`vision_batch`), since each request carries frames.

Sampling is exactly what SamplingParams says: greedy at temperature 0, otherwise temperature +
top_p with top_k and repetition penalty switched off (a checkpoint's generation_config defaults
such as Qwen's top_k=20 are overridden, so the log-probs below describe the real policy).

Log-probs: for every generated token, log_softmax(raw_logits / T)[token], with T the sampling
temperature (T = 1 when greedy). This is the temperature-scaled policy before top_p filtering,
the same quantity GRPO trainers recompute from the logits, so old/new ratios line up.

Seeds: request i of a call samples from its own seed (`request_seeds`: its `seed`, else one mixed from the
call's seed and i) through per-row noise (`RowSampler`), so a sample does not depend on the batch it shares or
the rank it runs on.
"""
from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import Any, Callable

from m1.config import ModelSpec
from m1.models.base import (ChatRequest, Completion, ModelError, SamplingParams, VisionRequest, prompt_ids,
                            request_seeds)
from m1.models.sampler import PrefixSampler, RowSampler, draw_seeds, supports
from m1.models.tiny import ensure_tiny


def offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")


def resolve_source(spec: ModelSpec, name: str) -> tuple[str, bool]:
    """(folder or hub id, local_files_only) for a spec; builds the tiny model when asked."""
    if spec.tiny is not None:
        return str(ensure_tiny(spec.tiny)), True
    if not spec.path:
        raise ModelError(f"model {name!r}: needs `path` or `tiny`")
    path = os.path.expanduser(spec.path)
    if os.path.isdir(path):
        return path, True
    if path.startswith((".", "/", "~")):
        raise ModelError(f"model {name!r}: path {spec.path!r} is not a folder")
    return spec.path, offline()


def resolve_device(device: str) -> str:
    import torch

    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return device


def resolve_dtype(dtype: str, device: str):
    import torch

    if dtype == "auto":
        return torch.bfloat16 if device.startswith("cuda") else torch.float32
    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[dtype]


def _model_kwargs(spec: ModelSpec, device: str, local_only: bool) -> dict[str, Any]:
    """from_pretrained arguments. On a GPU the weights load straight onto it in their final dtype (no fp32 copy in
    host memory first: four 8B agents would need ~130 GB of it)."""
    kw: dict[str, Any] = {"dtype": resolve_dtype(spec.dtype, device), "local_files_only": local_only}
    if spec.attn_implementation:
        kw["attn_implementation"] = spec.attn_implementation
    if spec.trust_remote_code:
        kw["trust_remote_code"] = True
    if device.startswith("cuda"):
        kw["device_map"] = {"": device}
    return kw


def _context_length(config) -> int | None:
    cfg = config.get_text_config() if hasattr(config, "get_text_config") else config
    n = getattr(cfg, "max_position_embeddings", None)
    return int(n) if n else None


def _eos_ids(model, tokenizer) -> list[int]:
    ids: list[int] = []
    gen = getattr(model, "generation_config", None)
    raw = getattr(gen, "eos_token_id", None) if gen is not None else None
    for x in ([raw] if isinstance(raw, int) else list(raw or [])) + [tokenizer.eos_token_id]:
        if x is not None and int(x) not in ids:
            ids.append(int(x))
    if not ids:
        raise ModelError("tokenizer and generation_config define no eos token")
    return ids


def _generation_kwargs(params: SamplingParams, eos: list[int], pad: int) -> dict[str, Any]:
    """`generate` runs greedily: sampling, when asked, happens in `RowSampler` (noise per row from the row's own
    seed), so HF's own temperature/top-k/top-p warpers and a checkpoint's generation_config defaults (Qwen's
    top_k=20) stay off, and no step's logits are kept (`RowSampler` records the chosen tokens' log-probs)."""
    if params.max_new_tokens < 1:
        raise ModelError(f"SamplingParams.max_new_tokens must be >= 1, got {params.max_new_tokens}")
    return dict(max_new_tokens=params.max_new_tokens, eos_token_id=eos, pad_token_id=pad,
                return_dict_in_generate=True, output_logits=False, repetition_penalty=1.0,
                do_sample=False, temperature=None, top_p=None, top_k=None)


def _run_generate(model, inputs: dict[str, Any], params: SamplingParams, gen_kw: dict[str, Any],
                  seeds: list[int | None]):
    """One generate call: (sequences, log-probs [B, steps] or None); row i samples from seeds[i]."""
    import torch
    from transformers import LogitsProcessor, LogitsProcessorList

    seeds = draw_seeds(seeds, params)
    sampler = RowSampler(seeds if params.temperature > 0 else None, params, model.device)
    processor = type("RowSampler", (LogitsProcessor,), {"__call__": lambda self, ids, scores: sampler(ids, scores)})
    with torch.inference_mode():
        out = model.generate(**inputs, **gen_kw, logits_processor=LogitsProcessorList([processor()]))
    return out.sequences, sampler.logprobs(out.sequences)


def _completions(sequences, logprobs, prompt_len: int, prompts: list[list[int]], tokenizer, eos: list[int],
                 metas: list[dict[str, Any]]) -> list[Completion]:
    """Cut each generated row at its first eos (kept) and attach the log-probs of its tokens."""
    new = sequences[:, prompt_len:].tolist()
    eos_set = set(eos)
    results: list[Completion] = []
    for row, (tokens, prompt_ids, meta) in enumerate(zip(new, prompts, metas)):
        cut = next((i + 1 for i, t in enumerate(tokens) if t in eos_set), None)
        ids = tokens[:cut] if cut is not None else tokens
        lps = None if logprobs is None else logprobs[row, : len(ids)].tolist()
        results.append(Completion(
            text=tokenizer.decode(ids, skip_special_tokens=True),
            prompt_ids=prompt_ids, completion_ids=ids, logprobs=lps,
            finish_reason="stop" if cut is not None else "length", meta=meta))
    return results


def _weights_error(name: str, folder: str, exc: Exception) -> ModelError:
    """A ModelError naming the weights file that does not read (a damaged or truncated safetensors file raises a bare
    SafetensorError that names no file): the first file of `folder` whose header does not open, else the folder."""
    from safetensors import safe_open

    bad, why = folder, str(exc)
    if os.path.isdir(folder):
        for f in sorted(Path(folder).glob("*.safetensors")):
            try:
                with safe_open(str(f), "pt"):
                    pass
            except Exception as err:  # any failure to open it is the answer
                bad, why = str(f), str(err)
                break
    return ModelError(f"model {name!r}: cannot read weights file {bad}: {why} (damaged or truncated? copy or "
                      f"write it again)")


# What a vision model's `max_batch_requests: auto` means when no placement plan sized it (`m1 infer`, placement local,
# tests): the browse requests of one phase of the paper's team at its limits.batch_episodes of 8 (8 episodes x 4
# agents). Inference keeps one generate call per phase; a training step whose rollouts run on vLLM engines (32
# episodes, up to 128 requests in one list) is answered in calls of 32, not in one call that no 80 GB GPU holds.
DEFAULT_VISION_BATCH = 32


def vision_batch(spec: ModelSpec, max_batch: int | None = None) -> int:
    """Most requests of one generate call of a vision model: `max_batch` when the caller gives one, else the spec's
    max_batch_requests (auto: DEFAULT_VISION_BATCH; a run with a placement plan writes the plan's number into the
    spec before the model is built, m1/marl/plan/placement_plan.py `with_request_batches`)."""
    if max_batch is not None:
        return max_batch
    return DEFAULT_VISION_BATCH if spec.max_batch_requests == "auto" else int(spec.max_batch_requests)


def _load_into(obj, spec: ModelSpec, name: str, max_batch: int | None, processor_cls, model_cls) -> str:
    """Shared loading of the chat and vision models: source, device, dtype, eval mode, counters.
    Sets `obj.processor` (a tokenizer or a processor) and `obj.model`; returns the source. A vision model's
    `max_batch` is always bounded (`vision_batch`): its requests carry whole frame sets."""
    from safetensors import SafetensorError

    obj.name, obj.spec, obj.calls = name, spec, 0
    obj.max_batch = vision_batch(spec, max_batch) if spec.interface == "vision" else max_batch
    obj._lock = threading.Lock()
    source, local_only = resolve_source(spec, name)
    obj.device = resolve_device(spec.device)
    try:
        obj.processor = processor_cls.from_pretrained(source, local_files_only=local_only,
                                                      **({"trust_remote_code": True} if spec.trust_remote_code else {}))
        obj.model = model_cls.from_pretrained(source, **_model_kwargs(spec, obj.device, local_only))
    except SafetensorError as exc:
        raise _weights_error(name, source, exc) from exc
    except (OSError, ValueError, ImportError) as exc:
        raise ModelError(f"model {name!r}: cannot load {source!r}: {exc}") from exc
    obj.model.to(obj.device).eval()
    tok = getattr(obj.processor, "tokenizer", obj.processor)
    tok.padding_side = "left"
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    return source


def is_adapter(folder: str | os.PathLike) -> bool:
    """Whether `folder` holds a peft adapter (what a LoRA run saves), not a whole model."""
    return os.path.isfile(os.path.join(os.path.expanduser(folder), "adapter_config.json"))


def merge_adapter(model, adapter: str, name: str):
    """`model` with the peft LoRA adapter in folder `adapter` merged into its weights: generation then costs what
    the base model costs, and the merged update is exactly the adapter's."""
    folder = os.path.expanduser(adapter)
    if not is_adapter(folder):
        raise ModelError(f"model {name!r}: adapter {adapter!r} is not a peft adapter folder (no adapter_config.json)")
    from peft import PeftModel
    from safetensors import SafetensorError

    try:
        merged = PeftModel.from_pretrained(model, folder, is_trainable=False).merge_and_unload()
    except SafetensorError as exc:
        raise _weights_error(name, folder, exc) from exc
    except (OSError, ValueError, KeyError, RuntimeError) as exc:
        raise ModelError(f"model {name!r}: cannot apply adapter {adapter!r}: {exc}") from exc
    return merged.eval()


class HFChatModel:
    """A causal LM from a local folder, a hub id or a tiny config; batched chat generation."""

    def __init__(self, spec: ModelSpec, name: str, max_batch: int | None = None):
        if spec.interface != "chat":
            raise ModelError(f"model {name!r}: HFChatModel needs interface 'chat', got {spec.interface!r}")
        from transformers import AutoModelForCausalLM, AutoTokenizer

        source = _load_into(self, spec, name, max_batch, AutoTokenizer, AutoModelForCausalLM)
        if spec.adapter is not None:
            self.model = merge_adapter(self.model, spec.adapter, name)
        self.tokenizer = self.processor
        if self.tokenizer.chat_template is None:
            raise ModelError(f"model {name!r}: tokenizer in {source!r} has no chat template")
        self.eos_ids = _eos_ids(self.model, self.tokenizer)
        self.context_length = _context_length(self.model.config)
        self.sampler = None  # m1/models/sampler.py: prefix-cached prefill, a decode loop without HF's per-step work
        if spec.prefix_cache_mb and supports(self.model):
            self.sampler = PrefixSampler(self.eos_ids, self.tokenizer.pad_token_id, spec.prefix_cache_mb << 20)

    def render(self, request: ChatRequest) -> str:
        """The prompt text for one chat, with the assistant turn opened."""
        # enable_thinking only matters for Qwen3-style templates; others ignore unknown variables.
        return self.tokenizer.apply_chat_template(request.messages, tokenize=False,
                                                  add_generation_prompt=True, enable_thinking=False)

    def generate(self, requests: list[ChatRequest], params: SamplingParams) -> list[Completion]:
        if not requests:
            return []
        prompts, metas = [], []
        max_new = params.max_new_tokens
        if self.context_length is not None and max_new >= self.context_length:
            max_new = max(1, self.context_length // 2)  # leave room for some prompt
        for req in requests:
            ids = prompt_ids(self.tokenizer, self.render(req))  # the team's budget counted it: no new tokenizing
            meta: dict[str, Any] = {}
            if self.context_length is not None and len(ids) + max_new > self.context_length:
                # never cut from the front: that loses the system prompt and the question (the team trims to its
                # limits.max_prompt_tokens, m1/team/budget.py)
                raise ModelError(f"model {self.name!r}: a prompt of {len(ids)} tokens and {max_new} new tokens do "
                                 f"not fit its context of {self.context_length} tokens; prompts are never cut: set "
                                 f"the team's limits.max_prompt_tokens to at most {self.context_length - max_new}")
            prompts.append(ids)
            metas.append(meta)
        if max_new != params.max_new_tokens:
            for m in metas:
                m["max_new_tokens"] = max_new
        params = SamplingParams(max_new_tokens=max_new, temperature=params.temperature,
                                top_p=params.top_p, seed=params.seed, logprobs=params.logprobs)
        seeds = request_seeds(requests, params)
        step = self.max_batch or len(prompts)
        results: list[Completion] = []
        with self._lock:
            for start in range(0, len(prompts), step):
                results += self._generate_batch(prompts[start:start + step], metas[start:start + step], params,
                                                seeds[start:start + step])
        return results

    def _generate_batch(self, prompts: list[list[int]], metas: list[dict[str, Any]],
                        params: SamplingParams, seeds: list[int | None]) -> list[Completion]:
        import torch

        if self.sampler is not None:
            try:
                tokens, logprobs, stopped = self.sampler.generate(self.model, prompts, params, seeds)
            except RuntimeError as exc:
                raise ModelError(f"model {self.name!r}: generate failed: {exc}") from exc
            self.calls += 1
            return [Completion(text=self.tokenizer.decode(ids, skip_special_tokens=True), prompt_ids=p,
                               completion_ids=ids, logprobs=None if logprobs is None else logprobs[i],
                               finish_reason="stop" if stopped[i] else "length", meta=m)
                    for i, (ids, p, m) in enumerate(zip(tokens, prompts, metas))]
        width = max(len(p) for p in prompts)
        pad = self.tokenizer.pad_token_id
        input_ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts], device=self.device)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts],
                            device=self.device)
        gen_kw = _generation_kwargs(params, self.eos_ids, pad)
        try:
            sequences, logprobs = _run_generate(self.model, {"input_ids": input_ids, "attention_mask": mask},
                                                params, gen_kw, seeds)
        except RuntimeError as exc:
            raise ModelError(f"model {self.name!r}: generate failed: {exc}") from exc
        self.calls += 1
        return _completions(sequences, logprobs, width, prompts, self.tokenizer, self.eos_ids, metas)


def video_metadata(timestamps: list[float], n_frames: int) -> dict[str, float]:
    """fps/duration for the processor, derived from the frame times (not a default 24 fps)."""
    ts = [float(t) for t in timestamps]
    span = ts[-1] - ts[0] if len(ts) > 1 else 0.0
    fps = (len(ts) - 1) / span if span > 0 else 1.0
    return {"fps": fps, "total_num_frames": n_frames, "duration": max(span, 0.0) + 1.0 / fps}


def _processor_meta(meta: dict[str, Any]) -> dict[str, Any]:
    return {k: meta[k] for k in ("fps", "total_num_frames", "duration")}


def _fmt_time(t: float) -> str:
    return f"{t:.1f}s"


class HFVisionModel:
    """A Qwen2.5-VL-style model describing a list of frame sets, one left-padded generate call.

    It is also a multimodal chat model (`generate`): the policy of a seed kind (m1/team/single.py) sends chats
    whose turns interleave text and frames (ChatRequest.images)."""

    accepts_images = True

    def __init__(self, spec: ModelSpec, name: str, max_batch: int | None = None):
        if spec.interface != "vision":
            raise ModelError(f"model {name!r}: HFVisionModel needs interface 'vision', got {spec.interface!r}")
        from transformers import AutoModelForImageTextToText, AutoProcessor

        source = _load_into(self, spec, name, max_batch, AutoProcessor, AutoModelForImageTextToText)
        self.tokenizer = self.processor.tokenizer
        vp = getattr(self.processor, "video_processor", None)
        if vp is None:
            raise ModelError(f"model {name!r}: processor in {source!r} has no video processor")
        self.temporal_patch = int(getattr(vp, "temporal_patch_size", 1) or 1)
        if spec.max_pixels is not None:
            size = dict(getattr(vp, "size", None) or {})
            low = min(int(size.get("shortest_edge", spec.max_pixels)), spec.max_pixels)
            vp.size = {"shortest_edge": low, "longest_edge": spec.max_pixels}
            ip = getattr(self.processor, "image_processor", None)
            if ip is not None:  # the frames of a multimodal chat go through the image processor
                isize = dict(getattr(ip, "size", None) or {})
                ilow = min(int(isize.get("shortest_edge", spec.max_pixels)), spec.max_pixels)
                ip.size = {"shortest_edge": ilow, "longest_edge": spec.max_pixels}
        self.eos_ids = _eos_ids(self.model, self.tokenizer)
        self.context_length = _context_length(self.model.config)

    def _messages(self, req: VisionRequest, n: int) -> list[dict[str, Any]]:
        times = ", ".join(_fmt_time(t) for t in req.timestamps)
        text = f"These {n} frames were taken at {times}.\n{req.prompt}"
        msgs: list[dict[str, Any]] = []
        if req.system:
            msgs.append({"role": "system", "content": req.system})
        msgs.append({"role": "user", "content": [{"type": "video"}, {"type": "text", "text": text}]})
        return msgs

    def _prepare(self, req: VisionRequest, index: int):
        import numpy as np

        frames = np.asarray(req.frames)
        if frames.ndim != 4 or frames.shape[-1] != 3 or frames.shape[0] == 0:
            raise ModelError(f"model {self.name!r}: request {index}: frames must be (T>0, H, W, 3), "
                             f"got shape {frames.shape}")
        if len(req.timestamps) != frames.shape[0]:
            raise ModelError(f"model {self.name!r}: request {index}: {frames.shape[0]} frames but "
                             f"{len(req.timestamps)} timestamps")
        n_real = frames.shape[0]
        rem = n_real % self.temporal_patch
        if rem:  # the model groups frames in temporal patches: repeat the last frame to fill one
            extra = self.temporal_patch - rem
            frames = np.concatenate([frames, np.repeat(frames[-1:], extra, axis=0)], axis=0)
        meta = video_metadata(req.timestamps, frames.shape[0])
        meta["real_frames"] = n_real
        return frames.astype(np.uint8, copy=False), meta, self._messages(req, n_real)

    def describe(self, requests: list[VisionRequest], params: SamplingParams) -> list[Completion]:
        return self._in_batches([self._prepare(r, i) for i, r in enumerate(requests)], self._describe_batch, params)

    def generate(self, requests: list[ChatRequest], params: SamplingParams) -> list[Completion]:
        """Multimodal chat: each request's image parts take its `images` in order (see ChatRequest)."""
        return self._in_batches(requests, self._chat_batch, params)

    def _in_batches(self, items: list, run: Callable, params: SamplingParams) -> list[Completion]:
        """`run` over batches of at most `max_batch` items (`vision_batch`: what the GPU holds), one model call at a
        time (the lock), the answers in the requests' order; each item keeps the seed of its place in the whole
        call, so the split does not change a sample."""
        seeds = request_seeds(items, params)
        step = self.max_batch or len(items)
        results: list[Completion] = []
        with self._lock:
            for start in range(0, len(items), step):
                results += run(items[start:start + step], params, seeds[start:start + step])
        return results

    def render_chat(self, messages: list[dict[str, Any]]) -> tuple[str, int]:
        """The prompt text of a multimodal chat (assistant turn opened) and its number of image parts; one rendering
        for generation and for the learner, so both see the same tokens."""
        msgs, n_parts = [], 0
        for m in messages:
            content = m.get("content")
            if isinstance(content, list):
                parts = []
                for part in content:
                    if part.get("type") == "image":
                        parts.append({"type": "image"})
                        n_parts += 1
                    else:
                        parts.append({"type": "text", "text": str(part.get("text", ""))})
                content = parts
            msgs.append({"role": m["role"], "content": content})
        return self.processor.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True), n_parts

    def image_inputs(self, images: list) -> dict[str, Any]:
        """`pixel_values` / `image_grid_thw` of frames, on the model's device and dtype, exactly as the processor
        makes them for a prompt (each image is processed on its own, so a prompt's images give the same values
        whatever else shares the batch)."""
        import numpy as np

        try:
            out = self.processor.image_processor(images=[np.asarray(x, dtype=np.uint8) for x in images],
                                                 return_tensors="pt")
        except (ValueError, TypeError) as exc:
            raise ModelError(f"model {self.name!r}: image processor failed: {exc}") from exc
        return {"pixel_values": out["pixel_values"].to(self.device, self.model.dtype),
                "image_grid_thw": out["image_grid_thw"].to(self.device)}

    def _chat_batch(self, requests: list[ChatRequest], params: SamplingParams,
                    seeds: list[int | None]) -> list[Completion]:
        import numpy as np

        texts, images = [], []
        for i, req in enumerate(requests):
            text, n_parts = self.render_chat(req.messages)
            pix = list(req.images or [])
            if n_parts != len(pix):
                raise ModelError(f"model {self.name!r}: request {i}: {n_parts} image parts but {len(pix)} images")
            texts.append(text)
            images += [np.asarray(x, dtype=np.uint8) for x in pix]
        try:
            inputs = self.processor(text=texts, images=images or None, padding=True, return_tensors="pt")
        except (ValueError, TypeError) as exc:
            raise ModelError(f"model {self.name!r}: processor failed: {exc}") from exc
        inputs = inputs.to(self.device)
        if "pixel_values" in inputs:
            inputs["pixel_values"] = inputs["pixel_values"].to(self.model.dtype)
        metas = [{"images": len(r.images or [])} for r in requests]
        return self._generate_inputs(inputs, params, metas, seeds)

    def _generate_inputs(self, inputs, params: SamplingParams, metas: list[dict[str, Any]],
                         seeds: list[int | None]) -> list[Completion]:
        width = int(inputs["input_ids"].shape[1])
        if self.context_length is not None and width + params.max_new_tokens > self.context_length:
            raise ModelError(
                f"model {self.name!r}: {width} prompt tokens + {params.max_new_tokens} new tokens "
                f"exceed the context of {self.context_length}; give fewer frames or set max_pixels")
        mask = inputs["attention_mask"].tolist()
        prompts = [[t for t, m in zip(row, mrow) if m]
                   for row, mrow in zip(inputs["input_ids"].tolist(), mask)]
        gen_kw = _generation_kwargs(params, self.eos_ids, self.tokenizer.pad_token_id)
        try:
            sequences, logprobs = _run_generate(self.model, dict(inputs), params, gen_kw, seeds)
        except RuntimeError as exc:
            raise ModelError(f"model {self.name!r}: generate failed: {exc}") from exc
        self.calls += 1
        return _completions(sequences, logprobs, width, prompts, self.tokenizer, self.eos_ids, metas)

    def _describe_batch(self, prepared, params: SamplingParams, seeds: list[int | None]) -> list[Completion]:
        texts = [self.processor.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
                 for _, _, msgs in prepared]
        try:
            inputs = self.processor(text=texts, videos=[f for f, _, _ in prepared],
                                    video_metadata=[_processor_meta(m) for _, m, _ in prepared],
                                    do_sample_frames=False, padding=True, return_tensors="pt")
        except (ValueError, TypeError) as exc:
            raise ModelError(f"model {self.name!r}: processor failed: {exc}") from exc
        inputs = inputs.to(self.device)
        if "pixel_values_videos" in inputs:
            inputs["pixel_values_videos"] = inputs["pixel_values_videos"].to(self.model.dtype)
        metas = [{"frames": m["real_frames"], "padded_frames": m["total_num_frames"], "fps": m["fps"]}
                 for _, m, _ in prepared]
        return self._generate_inputs(inputs, params, metas, seeds)
