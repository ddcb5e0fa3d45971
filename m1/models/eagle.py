"""Eagle2.5 (nvidia/Eagle2.5-8B) as a vision tool, loaded the way its model card does (`backend: eagle`).

Eagle2.5 is not a transformers model: its hub folder ships its own code (config `auto_map`: AutoConfig, AutoModel;
processor `auto_map`: AutoProcessor), written for transformers 4.x. AutoModelForImageTextToText cannot build it and
its processor has no video processor, so HFVisionModel cannot serve it. This adapter loads it with AutoModel +
AutoProcessor (trust_remote_code, which the spec must set) and speaks its processor's language:

- the rendered prompt carries Eagle's own placeholder for the clip, `<video-1>` (its chat template writes one for
  a `{"type": "video"}` part); the processor swaps it for one `<img>...</img>` block of image tokens per frame;
- the frames go in as a list of PIL images per request, and each frame's time and the clip's frame rate as
  `videos_kwargs` (`timestamps`, `fps`), so the processor labels every frame with its time;
- its `generate` embeds the prompt and returns the new tokens only; `_EchoPrompt` puts the prompt back in front so
  the shared decoding of m1/models/hf.py (cut at the prompt width, stop at eos) reads it like any HF model's.

`max_pixels` does not apply: Eagle's processor reads each video frame as one 448x448 tile (its videos_kwargs
default, max_dynamic_tiles 1), i.e. 200,704 pixels, the cap the shipped team gives its Qwen2.5-VL tools.

Not run on the machines M1 is tested on: there is no GPU, no copy of the weights or of the remote code, and that code
targets transformers 4.x while 5 is installed; it may need a transformers 4.x environment. tests/models/test_eagle.py checks
the requests this adapter builds against a fake processor and model that follow the card's interface. The shipped
team (configs/team/videochat_m1.yaml) grounds with Qwen2.5-VL-7B-Instruct, which transformers supports natively.
"""
from __future__ import annotations

from typing import Any

from m1.config import ModelSpec
from m1.models.base import ChatRequest, Completion, ModelError, SamplingParams
from m1.models.hf import HFVisionModel, _context_length, _eos_ids, _load_into

VIDEO_PLACEHOLDER = "<video-1>"  # Eagle's processor numbers the videos of one prompt from 1


class _EchoPrompt:
    """Eagle's model with a `generate` that returns prompt + new tokens, as HF's own models do (Eagle generates from
    input embeddings, so it returns only the new ones). Everything else passes through to the model."""

    def __init__(self, model):
        self._model = model

    def __getattr__(self, name: str):
        return getattr(self._model, name)

    def generate(self, **kwargs):
        import torch

        out = self._model.generate(**kwargs)
        prompt = kwargs["input_ids"]
        seq = out.sequences
        echoed = seq.shape[1] >= prompt.shape[1] and torch.equal(seq[:, :prompt.shape[1]].to(prompt.device), prompt)
        if not echoed:
            out["sequences"] = torch.cat([prompt, seq.to(prompt.device)], dim=1)
        return out


class EagleVisionModel(HFVisionModel):
    """Eagle2.5 describing frame sets for the browse tools (grounding by default); one left-padded generate call per
    batch, like HFVisionModel, whose request checks, batching, seeds and decoding it shares."""

    accepts_images = False  # a tool only: the seed kinds' multimodal chat is not offered

    def __init__(self, spec: ModelSpec, name: str, max_batch: int | None = None):
        if spec.interface != "vision":
            raise ModelError(f"model {name!r}: backend eagle serves vision models, got interface {spec.interface!r}")
        if not spec.trust_remote_code:
            raise ModelError(f"model {name!r}: backend eagle runs the model's own code from its folder; set "
                             "trust_remote_code: true")
        from transformers import AutoModel, AutoProcessor

        source = _load_into(self, spec, name, max_batch, AutoProcessor, AutoModel)
        self.tokenizer = getattr(self.processor, "tokenizer", None)
        if self.tokenizer is None or getattr(self.processor, "image_processor", None) is None \
                or not hasattr(self.processor, "apply_chat_template"):
            raise ModelError(f"model {name!r}: the processor in {source!r} ({type(self.processor).__name__}) is not "
                             "Eagle's: it needs a tokenizer, an image processor and a chat template")
        self.model = _EchoPrompt(self.model)
        self.temporal_patch = 1  # Eagle reads frames one by one (no temporal patches to fill)
        self.eos_ids = _eos_ids(self.model, self.tokenizer)
        self.context_length = _context_length(self.model.config)

    def request_inputs(self, prepared) -> Any:
        """The processor's tensors for prepared requests (see HFVisionModel._prepare): one `<video-1>` per prompt,
        the frames as PIL images, their times and rate as videos_kwargs."""
        from PIL import Image

        texts = []
        for i, (_, _, msgs) in enumerate(prepared):
            text = self.processor.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
            if text.count(VIDEO_PLACEHOLDER) != 1:
                raise ModelError(f"model {self.name!r}: request {i}: Eagle's chat template wrote "
                                 f"{text.count(VIDEO_PLACEHOLDER)} {VIDEO_PLACEHOLDER} placeholders, 1 expected")
            texts.append(text)
        videos = [[Image.fromarray(f) for f in frames] for frames, _, _ in prepared]
        times = [m["timestamps"] for _, m, _ in prepared]
        try:
            return self.processor(text=texts, videos=videos, padding=True, return_tensors="pt",
                                  videos_kwargs={"timestamps": times, "fps": [m["fps"] for _, m, _ in prepared]})
        except (ValueError, TypeError, KeyError, AssertionError) as exc:
            raise ModelError(f"model {self.name!r}: Eagle's processor failed: {exc}") from exc

    def _prepare(self, req, index: int):
        frames, meta, msgs = super()._prepare(req, index)
        meta["timestamps"] = [float(t) for t in req.timestamps]
        return frames, meta, msgs

    def _describe_batch(self, prepared, params: SamplingParams, seeds: list[int | None]) -> list[Completion]:
        inputs = self.request_inputs(prepared).to(self.device)
        if "pixel_values" in inputs:
            inputs["pixel_values"] = inputs["pixel_values"].to(self.model.dtype)
        metas = [{"frames": m["real_frames"], "fps": m["fps"]} for _, m, _ in prepared]
        return self._generate_inputs(inputs, params, metas, seeds)

    def generate(self, requests: list[ChatRequest], params: SamplingParams) -> list[Completion]:
        raise ModelError(f"model {self.name!r}: backend eagle serves the browse tools (describe) only, not a "
                         "policy's multimodal chat; use backend hf with a natively supported VLM for that")

    def render_chat(self, messages: list[dict[str, Any]]) -> tuple[str, int]:
        raise ModelError(f"model {self.name!r}: backend eagle cannot be a policy (no multimodal chat rendering)")

    def image_inputs(self, images: list) -> dict[str, Any]:
        raise ModelError(f"model {self.name!r}: backend eagle cannot be a policy (no image inputs for a learner)")
