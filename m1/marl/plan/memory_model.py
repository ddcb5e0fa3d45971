"""The GPU memory model: the peak bytes each learner, rollout batch and vision request needs on one GPU, from the
models' shapes alone (m1/models/shapes.py).

It is kept apart from the placement (m1/marl/plan/planner.py) so that the arithmetic, which the tests pin number by
number, reads on its own; nothing here knows about nodes, Ray or torch.

Units: "GB" in every number and message means GiB (2**30 bytes), the unit torch and nvidia-smi report, so an
"80 GB" A100 shows about 79.2 here; the planning headroom absorbs the difference.
"""
from __future__ import annotations

from dataclasses import dataclass

from m1.config import ModelSpec, TinySpec
from m1.marl.config import LearnerConfig
from m1.models.shapes import TextShape, VisionShape, text_shape, vision_parameters, vision_shape
from m1.models.tiny import TINY_VL_SIZE

GiB = float(2**30)
ACT_PER_LAYER = 34  # bytes per token per hidden unit of one transformer layer's activations (bf16, fused attention)
LOGIT_BYTES = 8  # per kept logit: the fp32 log-softmax and its gradient
VISION_PROMPT_TOKENS = 512  # text of one browse request (instructions, question, options, frame times), a margin


@dataclass
class MemoryEstimate:
    """Estimated bytes on each GPU of one unit, by kind (GB). Activations and KV cache are not held at once (a
    learner generates, frees the cache, then trains), so the peak counts the larger of the two."""

    weights: float = 0.0
    optimizer: float = 0.0
    grads: float = 0.0
    reference: float = 0.0
    activations: float = 0.0
    kv: float = 0.0
    reserve: float = 0.0

    @property
    def peak(self) -> float:
        return (self.weights + self.optimizer + self.grads + self.reference + max(self.activations, self.kv)
                + self.reserve)

    def parts(self) -> dict[str, float]:
        return {"weights": self.weights, "optimizer": self.optimizer, "grads": self.grads,
                "reference": self.reference, "activations": self.activations, "kv": self.kv,
                "reserve": self.reserve}


def in_gb(n_bytes: float) -> float:
    """Bytes as GB (GiB)."""
    return n_bytes / GiB


def tiny_shape(tiny: TinySpec) -> TextShape:
    """The decoder of a tiny random model, as m1/models/tiny.py builds it (vocabulary: its BPE size)."""
    vocab = 1024 if tiny.corpus == "default" else 4096
    arch = tiny.arch if tiny.arch in ("qwen2", "qwen3") else "qwen2"
    return TextShape(arch, tiny.hidden_size, tiny.layers, tiny.heads, tiny.kv_heads, tiny.hidden_size // tiny.heads,
                     tiny.intermediate_size or 2 * tiny.hidden_size, vocab, True)


def chat_shape(spec: ModelSpec) -> TextShape:
    if spec.tiny is not None:
        return tiny_shape(spec.tiny)
    return text_shape(spec.path or "")


def model_parameters(spec: ModelSpec) -> int:
    """Parameter count of any model spec (chat, VLM, CLIP); ShapeError when its size is unknown here."""
    if spec.tiny is not None:
        if spec.tiny.arch == "open_clip":  # two towers of `layers` blocks of width hidden_size
            return 2 * 12 * spec.tiny.layers * spec.tiny.hidden_size ** 2
        return tiny_shape(spec.tiny).parameters()
    if spec.interface == "chat":
        return chat_shape(spec).parameters()
    name = spec.clip_name if spec.backend == "open_clip" else spec.path
    return vision_parameters(name or "")


def needs_gpu(spec: ModelSpec) -> bool:
    """API models (openai) and M1-Synth's pixel reader run without a GPU; so does anything pinned to the CPU."""
    return spec.backend in ("hf", "vllm", "open_clip", "eagle") and not spec.device.startswith("cpu")


def weight_bytes(spec: ModelSpec, default: int = 2) -> int:
    return {"float32": 4, "bfloat16": 2, "float16": 2}.get(spec.dtype, default)


def trained_weight_bytes(learner: LearnerConfig, zero: bool = True) -> int:
    """Bytes of each weight as a learner holds and saves it (m1/marl/actor/learner_load.py `weights_dtype`): bf16
    (precision bf16, or auto on a GPU) for LoRA's frozen base and adapter under ZeRO, and for a full fine-tune under
    ZeRO (its fp32 master lives in the optimizer); fp32 otherwise (a plain-torch full fine-tune keeps fp32 weights,
    since a 1e-7 step would round away in bf16)."""
    bf16 = learner.precision != "fp32"
    return 2 if bf16 and (zero or learner.finetune == "lora") else 4


def learner_memory(shape: TextShape, learner: LearnerConfig, gpus: int, reference: bool, kv_sequences: int,
                   reserve_gb: float, zero: bool = True) -> MemoryEstimate:
    """Peak memory of each GPU of one agent's learner: a ZeRO-2 group of `gpus` ranks.

    P parameters, w = `trained_weight_bytes` (2: bf16, 4: fp32):
      full:  weights w*P on every rank (ZeRO-2 does not shard weights); optimizer: fp32 master copy + Adam m, v =
             12P (8P when the weights are fp32 already), sharded /gpus; gradients accumulate in fp32: 4P/gpus;
             reference (GRPO beta > 0) on every rank: 2P under bf16, 4P in fp32 (none at beta = 0).
      lora:  base weights w*P; the adapter's L parameters in fp32 with gradient and Adam m, v = 16L; no reference
             (the base with the adapter off is the reference).
    Activations of one micro-batch of T = micro_batch_size * (max_prompt_tokens + max_completion_tokens) tokens (at
    most learner.micro_batch_tokens, or one whole row, when that is set),
    h = hidden size, l = layers: with gradient checkpointing 2*T*h*l (each layer's bf16 input) + 34*T*h (the layer
    being recomputed); without, 34*T*h*l (the usual per-layer count for fused attention). Plus the kept logits,
    micro_batch_size * max_completion_tokens * vocab * 8 bytes (fp32 log-softmax and its gradient).
    KV cache while the learner generates rollouts: kv_sequences * (prompt + completion tokens) * kv_bytes_per_token.
    Without ZeRO (`zero=False`, no learner.deepspeed) nothing is sharded: each rank holds everything.
    """
    n = gpus if zero else 1
    p = shape.parameters()
    w = trained_weight_bytes(learner, zero)
    mem = MemoryEstimate(weights=in_gb(w * p), reserve=reserve_gb)
    if learner.finetune == "full":
        mem.optimizer = in_gb((8 if w == 4 else 12) * p / n)
        mem.grads = in_gb(4 * p / n)
        mem.reference = in_gb(reference_bytes(shape, learner)) if reference else 0.0
    else:
        mem.optimizer = in_gb(16 * shape.lora_parameters(learner.lora.r, learner.lora.target_modules))
    seq = learner.max_prompt_tokens + learner.max_completion_tokens
    tokens = learner.micro_batch_size * seq
    if learner.micro_batch_tokens is not None:  # a micro-batch is also capped by padded tokens (one row at least)
        tokens = min(tokens, max(learner.micro_batch_tokens, seq))
    h, layers = shape.hidden_size, shape.num_hidden_layers
    if learner.gradient_checkpointing:
        act = 2 * tokens * h * layers + ACT_PER_LAYER * tokens * h
    else:
        act = ACT_PER_LAYER * tokens * h * layers
    act += learner.micro_batch_size * learner.max_completion_tokens * shape.vocab_size * LOGIT_BYTES
    mem.activations = in_gb(act)
    mem.kv = in_gb(kv_sequences * seq * kv_token_bytes(shape, learner))
    return mem


def kv_token_bytes(shape: TextShape, learner: LearnerConfig) -> int:
    """KV cache of one token while a learner generates: bf16 under bf16 autocast (precision bf16 or auto on a GPU),
    fp32 in an fp32 run."""
    return shape.kv_bytes_per_token(4 if learner.precision == "fp32" else 2)


def reference_bytes(shape: TextShape, learner: LearnerConfig) -> int:
    """The frozen reference copy of a full fine-tune (GRPO beta > 0), on every rank: bf16 when training in bf16 (it
    only runs forward), else fp32. LoRA has none (the base with the adapter off is the reference)."""
    if learner.finetune != "full":
        return 0
    return (2 if learner.precision != "fp32" else 4) * shape.parameters()


def checkpoint_bytes(shape: TextShape, learner: LearnerConfig) -> int:
    """One agent's share of a checkpoint, as m1/marl/actor/learner_io.py `save_actor` writes it: the trained weights
    in the dtype they are held in (`trained_weight_bytes`: model/ or adapter/ safetensors, written once) + the
    optimizer state.

    Optimizer: under ZeRO (learner.deepspeed) the ranks' shards hold the fp32 master and Adam m, v: 12 bytes per
    trained parameter in all; in plain torch the weights are the fp32 master, and optimizer.pt holds m, v: 8. So a
    bf16 full fine-tune under ZeRO-2 writes 2 + 12 = 14 bytes per parameter, an fp32 one without ZeRO 4 + 8 = 12,
    and LoRA the same per adapter parameter. Tokenizer, config and RNG files add a few MB per agent, left out.
    """
    zero = learner.deepspeed is not None
    n = (shape.lora_parameters(learner.lora.r, learner.lora.target_modules) if learner.finetune == "lora"
         else shape.parameters())
    return (trained_weight_bytes(learner, zero) + (12 if zero else 8)) * n


def kv_fit(bases: list[tuple[MemoryEstimate, int, int]], usable_gb: float) -> int:
    """Episodes whose KV cache fits one GPU (or one group of GPUs) shared by `bases`: (its memory without the cache,
    KV bytes of one sequence of max_prompt + max_completion tokens, GPUs its requests are split over).

    The cache gets what is left of `usable_gb` after every weight, optimizer, gradient, reference and reserve on the
    GPU and the largest training activations (cache and activations are not held together, but the allocator's
    blocks of one are not always free for the other). Each episode sends every learner one sequence per phase call;
    a learner group of n GPUs splits a call's requests over its ranks, ceil(B / n) each.
    """
    if not bases:
        return 0
    resident = sum(m.weights + m.optimizer + m.grads + m.reference for m, _, _ in bases)
    free = (usable_gb - resident - max(m.activations for m, _, _ in bases) - max(m.reserve for m, _, _ in bases)) * GiB
    if free <= 0:
        return 0
    if len(bases) == 1:
        _, per_seq, n = bases[0]
        return int(free // per_seq) * n
    return int(free // sum(per_seq for _, per_seq, _ in bases))


def driver_vision_shape(spec: ModelSpec) -> VisionShape:
    """The request-sizing shape of a vision driver model; a tiny one as m1/models/tiny.py builds it."""
    if spec.tiny is not None:
        return VisionShape(tiny_shape(spec.tiny), max(16, spec.tiny.hidden_size // 2), 4, 28 * 28, 2,
                           TINY_VL_SIZE["longest_edge"])
    return vision_shape(spec.path or "")


def request_frames(team, key: str) -> int:
    """Most frames one request to model `key` carries: the frame settings of the tools it serves (the browser also
    serves Space and Grounding when they name no model of their own; a seed system's clips up to max_tool_frames);
    a model that is no tool's (a frozen agent's) is sized by the largest of them."""
    t = team.tools
    frames = []
    if key == t.browser:
        frames += [t.rough_frames, t.fine_frames] + ([t.space_frames] if not t.space else []) \
            + ([t.grounding_max_frames] if not t.grounding else [])
    if key == t.space:
        frames.append(t.space_frames)
    if key == t.grounding:
        frames.append(t.grounding_max_frames)
    seed = getattr(team, "seed_system", None)
    if seed is not None and frames:
        frames.append(seed.max_tool_frames)
    return max(frames or [t.rough_frames, t.fine_frames, t.space_frames, t.grounding_max_frames])


def vision_request_bytes(shape: VisionShape, spec: ModelSpec, frames: int, new_tokens: int) -> tuple[int, int, int]:
    """(tokens, KV bytes, activation bytes) of one request of `frames` frames to a vision model.

    Tokens: frames x visual tokens per frame (`VisionShape.tokens_per_frame` at the spec's max_pixels) +
    VISION_PROMPT_TOKENS + `new_tokens`. KV: tokens x the language model's KV bytes per token in the weights' dtype.
    Activations of the prefill, one layer at a time as in inference, counted as the learner counts the layer being
    recomputed (ACT_PER_LAYER bytes per token per hidden unit): the language model's over every token, and the
    vision tower's over the ViT patches (visual tokens x patches_per_token) at its width. Cache and activations are
    held together while a batch is prefilled."""
    visual = frames * shape.tokens_per_frame(spec.max_pixels)
    tokens = visual + VISION_PROMPT_TOKENS + new_tokens
    kv = tokens * shape.text.kv_bytes_per_token(weight_bytes(spec))
    act = ACT_PER_LAYER * (tokens * shape.text.hidden_size + visual * shape.patches_per_token * shape.vit_width)
    return tokens, kv, act
