"""The placement plan: which GPUs each learner group, rollout engine and driver model gets, checked before any
model loads.

A 7-8B full fine-tune that does not fit its GPUs fails minutes into a run, after every model has loaded, with an
out-of-memory error that names nothing. `make_plan` answers the same question from the models' shapes alone
(m1/models/shapes.py) in well under a second: it estimates the peak memory of every GPU, hands out whole GPUs node
by node, and lists every shortfall by agent or model with the setting that would fix it. Nothing here imports torch
or ray at module level; `cluster_gpus_from_ray` / `local_cluster` import them when asked about a real cluster.

Units: "GB" in every number and message means GiB (2**30 bytes), the unit torch and nvidia-smi report, so an
"80 GB" A100 shows about 79.2 here; the planning headroom absorbs the difference.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Literal

from m1.config import ModelSpec, TinySpec
from m1.marl.config import ClusterConfig, LearnerConfig, SFTConfig, TrainConfig
from m1.models.shapes import ShapeError, TextShape, VisionShape, text_shape, vision_parameters, vision_shape

GiB = float(2**30)
ACT_PER_LAYER = 34  # bytes per token per hidden unit of one transformer layer's activations (bf16, fused attention)
LOGIT_BYTES = 8  # per kept logit: the fp32 log-softmax and its gradient
VISION_PROMPT_TOKENS = 512  # text of one browse request (instructions, question, options, frame times), a margin
RAY_NODE_ID_LABEL = "ray.io/node-id"  # the label Ray puts on every node: its node id


class PlanError(ValueError):
    """A cluster or plan request that cannot be answered (a typo in cluster:, no cluster to ask)."""


# ================================================================================================ memory model
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


def _gb(n_bytes: float) -> float:
    return n_bytes / GiB


def tiny_shape(tiny: TinySpec) -> TextShape:
    """The decoder of a tiny random model, as m1/models/tiny.py builds it (vocabulary: its BPE size)."""
    vocab = 4096 if tiny.corpus == "synth" else 1024
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
    if spec.kind == "chat":
        return chat_shape(spec).parameters()
    name = spec.clip_name if spec.backend == "open_clip" else spec.path
    return vision_parameters(name or "")


def needs_gpu(spec: ModelSpec) -> bool:
    """API models (openai) and M1-Synth's pixel reader run without a GPU; so does anything pinned to the CPU."""
    return spec.backend in ("hf", "vllm", "open_clip", "eagle") and not spec.device.startswith("cpu")


def weight_bytes(spec: ModelSpec, default: int = 2) -> int:
    return {"float32": 4, "bfloat16": 2, "float16": 2}.get(spec.dtype, default)


def trained_weight_bytes(learner: LearnerConfig, zero: bool = True) -> int:
    """Bytes of each weight as a learner holds and saves it (m1/marl/learner.py `weights_dtype`): bf16 (precision
    bf16, or auto on a GPU) for LoRA's frozen base and adapter under ZeRO, and for a full fine-tune under ZeRO (its
    fp32 master lives in the optimizer); fp32 otherwise (a plain-torch full fine-tune keeps fp32 weights, since a
    1e-7 step would round away in bf16)."""
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
    mem = MemoryEstimate(weights=_gb(w * p), reserve=reserve_gb)
    if learner.finetune == "full":
        mem.optimizer = _gb((8 if w == 4 else 12) * p / n)
        mem.grads = _gb(4 * p / n)
        mem.reference = _gb(reference_bytes(shape, learner)) if reference else 0.0
    else:
        mem.optimizer = _gb(16 * shape.lora_parameters(learner.lora.r, learner.lora.target_modules))
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
    mem.activations = _gb(act)
    mem.kv = _gb(kv_sequences * seq * kv_token_bytes(shape, learner))
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
    """One agent's share of a checkpoint, as m1/marl/learner.py `save` writes it: the trained weights in the dtype
    they are held in (`trained_weight_bytes`: model/ or adapter/ safetensors, written once) + the optimizer state.

    Optimizer: under ZeRO (learner.deepspeed) the ranks' shards hold the fp32 master and Adam m, v: 12 bytes per
    trained parameter in all; in plain torch the weights are the fp32 master, and optimizer.pt holds m, v: 8. So a
    bf16 full fine-tune under ZeRO-2 writes 2 + 12 = 14 bytes per parameter, an fp32 one without ZeRO 4 + 8 = 12,
    and LoRA the same per adapter parameter. Tokenizer, config and RNG files add a few MB per agent, left out.
    """
    zero = learner.deepspeed is not None
    n = (shape.lora_parameters(learner.lora.r, learner.lora.target_modules) if learner.finetune == "lora"
         else shape.parameters())
    return (trained_weight_bytes(learner, zero) + (12 if zero else 8)) * n


@dataclass
class RolloutBatch:
    """How many of a step's episodes the team runs at once when the learners generate (rollout.engine hf)."""

    episodes: int  # what the run uses
    setting: str  # where the number comes from: "rollout.batch_episodes: auto", "rollout.batch_episodes", ...
    step: int  # episodes of one step (questions_per_step * num_generations)
    fits: int | None  # most episodes whose KV cache fits every learner GPU; None: unknown (no GPU size, CPU run)
    kv_tokens: int | None = None  # the KV token budget of the tightest learner GPU (fits: its sequences * tokens)
    fits_without_reference: int | None = None  # what `fits` would be at grpo.beta = 0 (no reference copy)


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


def resolve_rollout_batch(cfg: TrainConfig, fits: int | None, kv_tokens: int | None = None) -> RolloutBatch:
    """The episodes a MARL run's HF rollouts run at once: rollout.batch_episodes (auto: the step's episodes, or as
    many as `fits` when fewer fit), else the team's limits.batch_episodes."""
    r = cfg.rollout
    step = r.questions_per_step * r.num_generations
    if r.batch_episodes == "auto":
        n = step if fits is None else max(1, min(fits, step))
        return RolloutBatch(n, "rollout.batch_episodes: auto", step, fits, kv_tokens)
    if r.batch_episodes is not None:
        return RolloutBatch(r.batch_episodes, "rollout.batch_episodes", step, fits, kv_tokens)
    return RolloutBatch(cfg.team_config().limits.batch_episodes, "limits.batch_episodes", step, fits, kv_tokens)


def rollout_batch(cfg: TrainConfig, plan: PlacementPlan | None = None) -> int:
    """Episodes the trainer runs at once (rollout.engine hf): the plan's number. Without a plan (placement local):
    the plan of this machine's GPUs, whose learners sit on the devices their model specs name."""
    if plan is None or plan.rollout is None:
        if cfg.rollout.batch_episodes != "auto":
            return resolve_rollout_batch(cfg, None).episodes
        info = local_cluster()
        plan = make_plan(cfg, nodes=info.gpus_per_node, gpu_mem_gb=cfg.cluster.gpu_mem_gb or info.gpu_mem_gb)
    if plan.rollout is None:
        raise PlanError("rollout_batch: the plan has no rollout batch (rollout.engine is not hf)")
    return plan.rollout.episodes


@dataclass
class RequestBatch:
    """How many requests a driver's vision model (hf / eagle) answers in one generate call, and what one costs."""

    requests: int  # what the run uses (written into the model's spec: `with_request_batches`)
    setting: str  # "max_batch_requests: auto" or "max_batch_requests"
    most: int  # the longest request list one call of the run can carry (episodes at once x agents)
    fits: int | None  # most requests whose KV cache and activations fit its GPU after the weights; None: unknown
    tokens: int  # of one request: frames x visual tokens per frame + prompt + new tokens
    request_gb: float  # KV cache + activations of one request


def driver_vision_shape(spec: ModelSpec) -> VisionShape:
    """The request-sizing shape of a vision driver model; a tiny one as m1/models/tiny.py builds it."""
    if spec.tiny is not None:
        from m1.models.tiny import TINY_VL_SIZE

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


def with_request_batches(specs: dict[str, ModelSpec], plan: PlacementPlan | None) -> dict[str, ModelSpec]:
    """`specs` with each `max_batch_requests: auto` the plan sized replaced by the plan's number, so the model built
    from the spec (on the GPU the plan gave it) answers in calls of that many requests."""
    if plan is None:
        return dict(specs)
    out = dict(specs)
    for key, batch in plan.requests.items():
        spec = out.get(key)
        if spec is not None and spec.max_batch_requests == "auto":
            out[key] = spec.model_copy(update={"max_batch_requests": batch.requests})
    return out


# ================================================================================================ the plan
@dataclass(frozen=True, order=True)
class GpuSlot:
    node: int
    gpu: int

    def __str__(self) -> str:
        return f"node {self.node} gpu {self.gpu}"


@dataclass
class Unit:
    """One thing that gets whole GPUs: an agent's learner group, its rollout engine, or a driver model."""

    role: Literal["learner", "engine", "driver"]
    name: str  # agent (learner, engine) or model key (driver; "judge" for a local judge)
    model: str  # what it runs (hub id / path), for people
    gpus: int
    memory: MemoryEstimate | None  # None: size unknown (a problem says why)
    slots: list[GpuSlot] = field(default_factory=list)


@dataclass
class RayBundles:
    """Placement-group bundles, one per planned GPU in (node, gpu) order, and which bundle each rank gets.

    `index[(role, name, rank)]` is the bundle of rank `rank` of a unit, e.g. `index[("learner", "qwen3_8b", 0)]`,
    for `PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=...)`. `nodes[i]` is the plan's node of
    bundle i: with `node_ips` given, each bundle also asks for a sliver of that node's `node:<ip>` resource so Ray
    puts it where the plan did. An address does not tell apart two Ray nodes of one machine (or two raylets behind
    one NAT); with `node_ids` given, `labels[i]` selects bundle i's node by its Ray node id (the `ray.io/node-id`
    label every node carries), for `placement_group(..., bundle_label_selector=labels)`.
    """

    bundles: list[dict[str, float]]
    index: dict[tuple[str, str, int], int]
    nodes: list[int]
    labels: list[dict[str, str]] | None = None

    def of(self, role: str, name: str) -> list[int]:
        """Bundle indices of every rank of one unit, rank order."""
        ranks = sorted((r, i) for (ro, n, r), i in self.index.items() if ro == role and n == name)
        return [i for _, i in ranks]


@dataclass
class PlacementPlan:
    name: str
    nodes: list[int]  # GPUs of each node
    gpu_mem_gb: float
    usable_gb: float  # planned per GPU: gpu_mem_gb less the headroom
    units: list[Unit]
    checkpoint_one_gb: float  # one checkpoint of every trained agent
    checkpoint_gb: float  # times checkpoint.keep_last
    problems: list[str]
    notes: list[str] = field(default_factory=list)
    cpus_per_gpu: int = 4
    checkpoint_agents_gb: dict[str, float] = field(default_factory=dict)  # one checkpoint of each trained agent
    checkpoint_bytes_per_param: int | None = None  # what `checkpoint_bytes` counts per trained parameter
    # the frozen reference copy of each full fine-tuned agent, per GPU of its learner, at the configured beta
    reference_gb: dict[str, float] = field(default_factory=dict)
    beta: float | None = None  # grpo.beta (None: SFT)
    rollout: RolloutBatch | None = None  # HF rollouts: episodes at once; None: SFT or vLLM engines
    requests: dict[str, RequestBatch] = field(default_factory=dict)  # vision driver models: requests per call

    @property
    def fits(self) -> bool:
        return not self.problems

    def _slots(self, role: str) -> dict[str, list[GpuSlot]]:
        return {u.name: list(u.slots) for u in self.units if u.role == role}

    @property
    def learners(self) -> dict[str, list[GpuSlot]]:
        return self._slots("learner")

    @property
    def engines(self) -> dict[str, list[GpuSlot]]:
        """Every trained agent's engine GPUs; empty lists when rollouts run in the learners."""
        engines = self._slots("engine")
        return {a: engines.get(a, []) for a in self.learners}

    @property
    def driver(self) -> dict[str, list[GpuSlot]]:
        return self._slots("driver")

    def unit(self, role: str, name: str) -> Unit:
        for u in self.units:
            if u.role == role and u.name == name:
                return u
        raise KeyError(f"no {role} named {name!r} in the plan")

    @property
    def gpus_needed(self) -> int:
        return sum(u.gpus for u in self.units)

    def by_gpu(self) -> dict[GpuSlot, tuple[Unit, int]]:
        """Each planned GPU's unit and rank."""
        return {s: (u, r) for u in self.units for r, s in enumerate(u.slots)}

    def peak_gb(self) -> dict[GpuSlot, float]:
        return {s: (u.memory.peak if u.memory else float("nan")) for s, (u, _) in self.by_gpu().items()}

    def ray_bundles(self, cpus_per_gpu: int | None = None, node_ips: list[str] | None = None,
                    node_ids: list[str] | None = None) -> RayBundles:
        cpus = self.cpus_per_gpu if cpus_per_gpu is None else cpus_per_gpu
        if node_ips is not None and len(node_ips) < len(self.nodes):
            raise PlanError(f"ray_bundles: {len(node_ips)} node addresses for a plan of {len(self.nodes)} nodes")
        if node_ids is not None and len(node_ids) < len(self.nodes):
            raise PlanError(f"ray_bundles: {len(node_ids)} node ids for a plan of {len(self.nodes)} nodes")
        bundles, index, nodes = [], {}, []
        for slot, (u, rank) in sorted(self.by_gpu().items()):
            b: dict[str, float] = {"GPU": 1, **({"CPU": cpus} if cpus else {})}
            if node_ips is not None:
                b[f"node:{node_ips[slot.node]}"] = 0.001
            index[(u.role, u.name, rank)] = len(bundles)
            bundles.append(b)
            nodes.append(slot.node)
        labels = None if node_ids is None else [{RAY_NODE_ID_LABEL: node_ids[n]} for n in nodes]
        return RayBundles(bundles, index, nodes, labels)

    def render(self) -> str:
        """A table of every GPU (node, gpu, what runs there, estimated GB by kind), then totals and problems."""
        mem = (f"{self.gpu_mem_gb:g} GB per GPU, {self.usable_gb:.1f} GB planned" if self.gpu_mem_gb
               else "GPU memory not given")
        lines = [f"placement plan {self.name}: {len(self.nodes)} node(s), GPUs per node {self.nodes}, {mem}; "
                 f"{self.gpus_needed} GPUs needed of {sum(self.nodes)}"]
        short = {"optimizer": "optim", "reference": "ref", "activations": "act"}
        head = f"{'node':>4} {'gpu':>5}  {'role':<7} {'name':<14} {'rank':>5} {'est GB':>7}  " + " ".join(
            f"{short.get(k, k):>7}" for k in MemoryEstimate().parts())
        lines += [head, "-" * len(head)]
        taken = self.by_gpu()
        for node, count in enumerate(self.nodes):
            for gpu in range(count):
                slot = GpuSlot(node, gpu)
                if slot not in taken:  # a run of free GPUs is one line
                    if gpu == 0 or GpuSlot(node, gpu - 1) in taken:
                        end = next((g for g in range(gpu, count) if GpuSlot(node, g) in taken), count) - 1
                        gpus = f"{gpu}-{end}" if end > gpu else str(gpu)
                        lines.append(f"{node:>4} {gpus:>5}  {'free':<7}")
                    continue
                u, rank = taken[slot]
                rank_s = f"{rank}/{u.gpus}"
                if u.memory is None:
                    lines.append(f"{node:>4} {gpu:>5}  {u.role:<7} {u.name:<14} {rank_s:>5} {'?':>7}")
                    continue
                parts = " ".join(f"{v:7.1f}" for v in u.memory.parts().values())
                lines.append(f"{node:>4} {gpu:>5}  {u.role:<7} {u.name:<14} {rank_s:>5} {u.memory.peak:7.1f}  {parts}")
        unplaced = [u for u in self.units if len(u.slots) < u.gpus]
        for u in unplaced:
            peak = f"{u.memory.peak:.1f} GB per GPU" if u.memory else "size unknown"
            lines.append(f"  not placed: {u.role} {u.name} ({u.model}), {u.gpus} GPU(s), {peak}")
        lines.append("(peak = weights + optimizer + grads + reference + max(activations, kv) + reserve)")
        lines.append(f"checkpoint: {self.checkpoint_one_gb:.1f} GB each, {self.checkpoint_gb:.1f} GB kept on disk")
        if self.checkpoint_agents_gb:
            per = ", ".join(f"{a} {gb:.1f}" for a, gb in self.checkpoint_agents_gb.items())
            lines.append(f"  per agent (GB): {per}; {self.checkpoint_bytes_per_param} bytes per trained parameter "
                         "(weights as trained + fp32 master and Adam m, v)")
        if self.reference_gb:
            per = ", ".join(f"{a} {gb:.1f}" for a, gb in self.reference_gb.items())
            total = sum(gb * u.gpus for u in self.units if u.role == "learner" for a, gb in self.reference_gb.items()
                        if a == u.name)
            if self.beta:
                more = (f", and the learners' KV cache would hold {self.rollout.fits_without_reference} rollout "
                        f"episodes instead of {self.rollout.fits}" if self.rollout is not None
                        and self.rollout.fits_without_reference is not None else "")
                lines.append(f"reference copy (grpo.beta {self.beta:g}), GB per GPU: {per}; {total:.1f} GB in all "
                             f"(none at beta = 0: grpo.beta: 0 frees it{more})")
            else:
                lines.append(f"reference copy: none at beta = 0 (a beta > 0 would add, GB per GPU: {per}; "
                             f"{total:.1f} GB in all)")
        if self.rollout is not None:
            r = self.rollout
            fit = ("fits: unknown (no GPU size or learners on the CPU)" if r.fits is None else
                   f"the KV cache of {r.fits} fits the learners' free memory"
                   + (f", {r.kv_tokens} tokens on the tightest GPU" if r.kv_tokens else ""))
            lines.append(f"rollouts: {r.episodes} of the step's {r.step} episodes at once ({r.setting}; {fit})")
        if self.requests:
            lines.append("(a vision driver's act counts its request batch's KV cache and prefill activations, held "
                         "together)")
        for key, b in self.requests.items():
            fit = ("fits: unknown (no GPU size)" if b.fits is None else f"{b.fits} fit its GPU after the weights")
            lines.append(f"driver {key}: {b.requests} requests per generate call, of up to {b.most} at once "
                         f"({b.setting}; {fit}; {b.tokens} tokens, {b.request_gb:.2f} GB KV + activations each)")
        lines += [f"note: {n}" for n in self.notes]
        if self.fits:
            lines.append("fits: yes")
        else:
            lines.append("fits: NO")
            lines += [f"problem: {p}" for p in self.problems]
        return "\n".join(lines)


# ================================================================================================ building a plan
def node_sizes(gpus: int, gpus_per_node: int) -> list[int]:
    """`gpus` GPUs as full nodes of `gpus_per_node` and the remainder on the last one."""
    full, rest = divmod(gpus, gpus_per_node)
    return [gpus_per_node] * full + ([rest] if rest else [])


def _allocate(free: list[list[int]], n: int) -> list[GpuSlot] | None:
    """Take n GPUs: all on one node when any node has room (the fullest such node, to keep big gaps for big
    groups), else across the nodes with the most free GPUs; None when fewer than n are free."""
    if n > sum(len(f) for f in free):
        return None
    fitting = [i for i, f in enumerate(free) if len(f) >= n]
    if fitting:
        node = min(fitting, key=lambda i: (len(free[i]), i))
        taken, free[node][:] = free[node][:n], free[node][n:]
        return [GpuSlot(node, g) for g in taken]
    out: list[GpuSlot] = []
    for node in sorted(range(len(free)), key=lambda i: (-len(free[i]), i)):
        k = min(n - len(out), len(free[node]))
        out += [GpuSlot(node, g) for g in free[node][:k]]
        free[node][:] = free[node][k:]
        if len(out) == n:
            break
    return out


def _driver_models(team, frozen: list[str]) -> dict[str, ModelSpec]:
    """Models the driver process loads besides the learners: tool models in use and frozen agents' models."""
    t, enabled = team.tools, set(team.tools.enabled)
    used: dict[str, ModelSpec] = {}

    def add(key: str | None) -> None:
        if key is not None and key not in used:
            used[key] = team.models[key]

    if enabled & {"Rough Browser", "Fine Browser"} or ("Space Tool" in enabled and not t.space) \
            or ("Grounding Tool" in enabled and not t.grounding):
        add(t.browser)
    if "Space Tool" in enabled:
        add(t.space)
    if "Grounding Tool" in enabled:
        add(t.grounding)
    if enabled & {"Video Retrieval", "Image Retrieval"}:
        add(t.clip)
    key_of = {a.name: a.model for a in team.agents}
    for agent in frozen:
        add(key_of[agent])
    return used


def make_plan(cfg: TrainConfig | SFTConfig, gpus: int | None = None, gpu_mem_gb: float | None = None,
              nodes: list[int] | None = None, teacher: bool | None = None) -> PlacementPlan:
    """Plan a MARL (TrainConfig) or SFT (SFTConfig) run on `gpus` GPUs (ceil(gpus / cluster.gpus_per_node) nodes)
    or on `nodes` (GPUs of each node); with neither, the cluster Ray or this machine reports (`detect_cluster`).

    GPU memory: `gpu_mem_gb`, else cluster.gpu_mem_gb, else what the detected cluster reports. Learners are placed
    first (agent order), then rollout engines, then driver models. `teacher` (SFT): also plan the teacher team's
    models, which build the examples first; None: only when data.examples does not exist yet. The plan never
    changes a configured GPU count: a learner that does not fit is a problem that says which count would.
    """
    cc: ClusterConfig = cfg.cluster
    sft = isinstance(cfg, SFTConfig)
    if nodes is None and gpus is not None:
        if gpus < 0:
            raise PlanError(f"--gpus must be >= 0, got {gpus}")
        nodes = node_sizes(gpus, cc.gpus_per_node)
    mem_gb = gpu_mem_gb if gpu_mem_gb is not None else cc.gpu_mem_gb
    if nodes is None:
        info = detect_cluster(getattr(getattr(cfg, "ray", None), "address", None))
        nodes = info.gpus_per_node
        mem_gb = mem_gb if mem_gb is not None else info.gpu_mem_gb
    team = cfg.team_config()
    agents = [a.name for a in team.agents]
    trained = list(cfg.train_agents or agents)
    for agent in cc.learner_gpus:
        if agent not in trained:
            raise PlanError(f"cluster.learner_gpus: {agent!r} is not a trained agent (trained: {trained})")
    key_of = {a.name: a.model for a in team.agents}
    learner = cfg.learner
    problems: list[str] = []
    notes: list[str] = []
    units: list[Unit] = []
    on_cpu = []

    # rollouts from vLLM servers: no KV cache in the learners; engines M1 launches get GPUs of their own
    on_engines = not sft and cfg.rollout.engine == "vllm"
    launched = on_engines and not cfg.rollout.engine_url
    reference = (not sft) and cfg.grpo.beta > 0 and learner.finetune == "full"
    shapes: dict[str, TextShape] = {}
    for agent in trained:
        spec = team.models[key_of[agent]]
        n = cc.gpus_of(agent, learner)
        if not needs_gpu(spec):
            on_cpu.append(f"learner {agent}")
            continue
        try:
            shapes[agent] = shape = chat_shape(spec)
        except ShapeError as exc:
            problems.append(f"agent {agent}: {exc}")
            units.append(Unit("learner", agent, spec.path or "tiny", n, None))
            continue
        zero = learner.deepspeed is not None
        if n > 1 and not zero:
            problems.append(f"agent {agent}: a learner of {n} GPUs needs learner.deepspeed (a ZeRO-2 JSON such as "
                            "configs/deepspeed/zero2.json) to shard its optimizer and gradients")
        units.append(Unit("learner", agent, spec.path or "tiny", n,
                          learner_memory(shape, learner, n, reference, 0, cc.reserve_gb, zero)))

    # HF rollouts: the learners generate for `kv_seqs` episodes at once, their KV cache in what the GPU has left
    rollout, kv_seqs = None, 0
    if not sft and not on_engines:
        seq = learner.max_prompt_tokens + learner.max_completion_tokens
        per_seq = {a: seq * kv_token_bytes(shape, learner) for a, shape in shapes.items()}
        gpu_learners = [u for u in units if u.role == "learner" and u.memory is not None]
        fits = tokens = fits0 = None
        if gpu_learners and mem_gb is not None and len(gpu_learners) == len(shapes):
            usable_kv = mem_gb * (1 - cc.headroom)
            if cfg.placement == "local":  # one process: learners naming the same device share its memory
                device = {u.name: team.models[key_of[u.name]].device.replace("auto", "cuda") for u in gpu_learners}
                device = {a: "cuda:0" if d == "cuda" else d for a, d in device.items()}
                groups = [[u for u in gpu_learners if device[u.name] == d] for d in sorted(set(device.values()))]
            else:
                groups = [[u] for u in gpu_learners]
            fit_of = [(kv_fit([(u.memory, per_seq[u.name], u.gpus if len(g) == 1 else 1) for u in g], usable_kv), g)
                      for g in groups]
            fits, tight = min(fit_of, key=lambda x: x[0])
            tokens = seq * -(-fits // tight[0].gpus) if len(tight) == 1 else seq * fits
            if reference:  # what the memory of the reference copy would hold instead
                fits0 = min(kv_fit([(replace(u.memory, reference=0.0), per_seq[u.name], u.gpus if len(g) == 1 else 1)
                                    for u in g], usable_kv) for g in groups)
        rollout = resolve_rollout_batch(cfg, fits, tokens)
        rollout.fits_without_reference = fits0
        kv_seqs = rollout.episodes
        for u in units:
            if u.role == "learner" and u.memory is not None:
                u.memory.kv = _gb(-(-kv_seqs // u.gpus) * per_seq[u.name])

    if launched:
        for agent in trained:
            if agent not in shapes:
                continue
            shape, n = shapes[agent], cc.engine_gpus
            seq = learner.max_prompt_tokens + learner.max_completion_tokens
            units.append(Unit("engine", agent, team.models[key_of[agent]].path or "tiny", n, MemoryEstimate(
                weights=_gb(2 * shape.parameters() / n), reserve=cc.reserve_gb,
                kv=_gb(team.limits.batch_episodes * seq * shape.kv_bytes_per_token() / n))))
        notes.append("a vLLM engine claims gpu_memory_utilization of its GPUs whatever the estimate; the rest is "
                     "its KV cache")

    drivers: dict[str, ModelSpec] = {}
    driver_team, episodes_at_once = team, team.limits.batch_episodes  # whose tools the driver models serve
    if sft:
        build = teacher if teacher is not None else not (cfg.data.examples and Path(cfg.data.examples).is_file())
        teacher_cfg = cfg.teacher_config()
        if build and teacher_cfg is not None:
            drivers = _driver_models(teacher_cfg, [a.name for a in teacher_cfg.agents])
            driver_team, episodes_at_once = teacher_cfg, teacher_cfg.limits.batch_episodes
            notes.append("the driver models are the teacher's, loaded to build data.examples before training")
    else:
        drivers = _driver_models(team, [a for a in agents if a not in trained])
        if on_engines:  # the trainer sends a vLLM step's episodes to the team at once (m1/marl/trainer.py)
            episodes_at_once = max(team.limits.batch_episodes,
                                   cfg.rollout.questions_per_step * cfg.rollout.num_generations)
        elif rollout is not None:
            episodes_at_once = rollout.episodes
        j = cfg.judge
        if j.kind == "llm" and j.model is not None:
            drivers["judge"] = j.model
    on_gpus = sorted(k for k, spec in drivers.items() if needs_gpu(spec))
    for key in cc.driver_gpus:
        if key not in on_gpus:
            raise PlanError(f"cluster.driver_gpus: {key!r} is not a model the driver loads on a GPU "
                            f"(those: {on_gpus})")
    usable = (mem_gb or 0.0) * (1 - cc.headroom)
    api = []
    requests: dict[str, RequestBatch] = {}
    sized: set[str] = set()  # driver models whose request batch is already a problem (not reported twice)
    for key, spec in drivers.items():
        if not needs_gpu(spec):
            if spec.backend in ("hf", "vllm", "open_clip", "eagle"):
                on_cpu.append(f"driver {key}")
            elif spec.backend == "openai":
                api.append(f"{key} ({spec.path})")
            continue
        try:
            params = model_parameters(spec)
        except ShapeError as exc:
            problems.append(f"driver model {key}: {exc}")
            units.append(Unit("driver", key, spec.path or spec.clip_name or "?", 1, None))
            continue
        weights = params * weight_bytes(spec, 4 if spec.backend == "open_clip" else 2)

        def driver_mem(n: int) -> MemoryEstimate:
            return MemoryEstimate(weights=_gb(weights / n), activations=_gb(weights * cc.driver_headroom / n),
                                  reserve=cc.reserve_gb)

        if key in cc.driver_gpus:
            n = cc.driver_gpus[key]
        elif spec.backend == "vllm":
            n = spec.tensor_parallel_size
        else:  # one GPU unless the model does not fit on one
            n = next((k for k in range(1, cc.gpus_per_node + 1) if driver_mem(k).peak <= usable), 1)
        mem = driver_mem(n)
        if spec.kind == "vision" and spec.backend in ("hf", "eagle"):
            mem = _vision_driver_memory(key, spec, driver_team, len(driver_team.agents) * episodes_at_once,
                                        _gb(weights / n), cc, usable if mem_gb is not None else None, requests,
                                        problems, notes, sized) or mem
        units.append(Unit("driver", key, spec.path or spec.clip_name or "tiny", n, mem))
    if on_cpu:
        notes.append("on the CPU (no GPU planned): " + ", ".join(on_cpu))
    if api:
        notes.append("behind an API (no GPU planned): " + ", ".join(api))

    if mem_gb is None and units and sum(nodes):
        raise PlanError("GPU memory unknown: give --gpu-mem GB or cluster.gpu_mem_gb (Ray does not report it)")
    check_memory = mem_gb is not None  # without GPUs nor a size, only the count problem below is reported
    mem_gb = mem_gb or 0.0

    # memory of each unit against one GPU
    for u in units:
        if not check_memory or u.memory is None or u.memory.peak <= usable or (u.role == "driver" and u.name in sized):
            continue
        short = u.memory.peak - usable
        head = (f"needs {u.memory.peak:.1f} GB per GPU on {u.gpus} GPU(s), the GPUs have {mem_gb:g} GB "
                f"({usable:.1f} GB planned after the {cc.headroom:.0%} headroom; short {short:.1f} GB)")
        if u.role == "learner":
            fix = _learner_fix(u.name, shapes[u.name], learner, reference, kv_seqs, cc, usable)
            problems.append(f"agent {u.name}: learner {head}; {fix}")
        elif u.role == "engine":
            problems.append(f"agent {u.name}: rollout engine {head}; raise cluster.engine_gpus")
        else:
            problems.append(f"driver model {u.name}: {head}; set cluster.driver_gpus.{u.name} higher")

    # whole GPUs, node by node: learners, engines, drivers (units are in that order)
    free = [list(range(k)) for k in nodes]
    for u in units:
        u.slots = _allocate(free, u.gpus) or []
        if len(u.slots) > 1 and len({s.node for s in u.slots}) > 1:
            notes.append(f"{u.role} {u.name} spans nodes {sorted({s.node for s in u.slots})}")
    unplaced = [u for u in units if not u.slots and u.gpus]
    if unplaced:
        need, have = sum(u.gpus for u in units), sum(nodes)
        what = ", ".join(f"{'agent ' + u.name + ' learner' if u.role == 'learner' else u.role + ' ' + u.name} "
                         f"({u.gpus} GPU{'s' if u.gpus > 1 else ''})" for u in unplaced)
        by_role = ", ".join(f"{r}s {sum(u.gpus for u in units if u.role == r)}"
                            for r in ("learner", "engine", "driver") if any(u.role == r for u in units))
        problems.append(f"needs {need} GPUs ({by_role}), the cluster has {have} (short {need - have}); "
                        f"not placed: {what}")

    per_agent: dict[str, float] = {}  # every trained agent writes a checkpoint, on a GPU or not
    for agent in trained:
        try:
            per_agent[agent] = _gb(checkpoint_bytes(shapes.get(agent) or chat_shape(team.models[key_of[agent]]),
                                                    learner))
        except ShapeError:  # a CPU model whose folder is not there yet: a learner problem names GPU ones
            pass
    one = sum(per_agent.values())
    zero = learner.deepspeed is not None
    ref_gb = ({a: _gb(reference_bytes(shape, learner)) for a, shape in shapes.items()}
              if not sft and learner.finetune == "full" else {})
    return PlacementPlan(name=cfg.name, nodes=list(nodes), gpu_mem_gb=mem_gb, usable_gb=usable, units=units,
                         checkpoint_one_gb=one, checkpoint_gb=one * cfg.checkpoint.keep_last,
                         problems=problems, notes=notes, cpus_per_gpu=cc.cpus_per_gpu,
                         checkpoint_agents_gb=per_agent,
                         checkpoint_bytes_per_param=trained_weight_bytes(learner, zero) + (12 if zero else 8),
                         reference_gb=ref_gb, beta=None if sft else cfg.grpo.beta, rollout=rollout,
                         requests=requests)


def _vision_driver_memory(key: str, spec: ModelSpec, team, most: int, weights_gb: float, cc: ClusterConfig,
                          usable: float | None, requests: dict[str, RequestBatch], problems: list[str],
                          notes: list[str], sized: set[str]) -> MemoryEstimate | None:
    """The memory of a vision driver model with its request batch: its weights, then as many requests per generate
    call as fit what the GPU has left (`kv_fit`; auto) or as the spec sets, each counted by `vision_request_bytes`.
    Records the batch in `requests`; a GPU that cannot hold one request, or a set batch that does not fit, is a
    problem. None when the model's request size is unknown here (a note says so; the share-of-weights estimate
    stays)."""
    from m1.models.hf import DEFAULT_VISION_BATCH

    try:
        shape = driver_vision_shape(spec)
    except ShapeError as exc:
        notes.append(f"driver {key}: its request batch is not counted ({exc})")
        return None
    t = team.tools
    frames = request_frames(team, key)
    new = max(t.rough_tokens, t.fine_tokens, t.space_tokens, t.grounding_tokens)  # what the tools ask of each call
    tokens, kv1, act1 = vision_request_bytes(shape, spec, frames, new)
    per = kv1 + act1
    base = MemoryEstimate(weights=weights_gb, reserve=cc.reserve_gb)
    fits = None if usable is None else kv_fit([(base, per, 1)], usable)
    auto = spec.max_batch_requests == "auto"
    if auto:
        n = DEFAULT_VISION_BATCH if fits is None else max(1, min(fits, most))
    else:
        n = int(spec.max_batch_requests)
    one = (f"one request ({frames} frames x {shape.tokens_per_frame(spec.max_pixels)} visual tokens + "
           f"{VISION_PROMPT_TOKENS} prompt + {new} new = {tokens} tokens) needs {_gb(per):.2f} GB of KV cache and "
           "activations")
    if fits is not None and fits < 1:
        left = usable - weights_gb - cc.reserve_gb
        problems.append(f"driver model {key}: {one}, and its GPU has {max(left, 0.0):.2f} GB left after the weights "
                        f"and reserve: no request fits; give it fewer frames (tools.*_frames), a lower max_pixels, "
                        "or larger GPUs")
        sized.add(key)
    elif fits is not None and n > fits:
        problems.append(f"driver model {key}: max_batch_requests {n} does not fit its GPU: {one}, at most {fits} "
                        f"fit after the weights; set max_batch_requests to at most {fits}, or auto")
        sized.add(key)
    requests[key] = RequestBatch(n, "max_batch_requests: auto" if auto else "max_batch_requests", most, fits, tokens,
                                 _gb(per))
    return replace(base, activations=_gb(n * per), kv=_gb(n * kv1))


def _learner_fix(agent: str, shape: TextShape, learner: LearnerConfig, reference: bool, kv_seqs: int,
                 cc: ClusterConfig, usable: float, limit: int = 64) -> str:
    """What would make a learner fit: the smallest GPU count, or, when none does, what else to change."""
    if learner.deepspeed is not None:
        for n in range(1, limit + 1):  # a group of n splits the rollout requests over its ranks
            if learner_memory(shape, learner, n, reference, -(-kv_seqs // n), cc.reserve_gb).peak <= usable:
                return f"give it learner.gpus >= {n} (or cluster.learner_gpus.{agent}: {n})"
    else:
        zero = learner_memory(shape, learner, 8, reference, -(-kv_seqs // 8), cc.reserve_gb)
        if zero.peak <= usable:
            return "set learner.deepspeed (ZeRO-2) and give it more GPUs (learner.gpus)"
    return ("no GPU count fits it (the per-GPU weights, reference and activations alone are too large): use "
            "learner.finetune: lora, a smaller micro_batch_size, gradient_checkpointing, or larger GPUs")


# ================================================================================================ the real cluster
@dataclass
class ClusterInfo:
    gpus_per_node: list[int]  # GPUs of each node that has any
    gpu_mem_gb: float | None  # None: not known (Ray does not report GPU memory)
    node_ips: list[str] | None = None
    node_ids: list[str] | None = None  # Ray node ids (hex), same order: what tells two nodes of one machine apart


def cluster_gpus_from_ray(address: str | None = "auto") -> ClusterInfo:
    """GPUs per node of a Ray cluster (joined at `address`; "auto": the running one). GPU memory is taken from
    this machine's GPUs when it has any (the nodes of a training cluster are alike); else it is None."""
    try:
        import ray
    except ImportError as exc:
        raise PlanError("asking the cluster for its GPUs needs the `ray` package (pip install ray); or plan for a "
                        "cluster you describe: --gpus N --gpu-mem GB") from exc
    joined = not ray.is_initialized()
    if joined:
        try:
            ray.init(address=address, logging_level="ERROR", log_to_driver=False)
        except ConnectionError as exc:
            raise PlanError(f"no Ray cluster at {address!r} ({exc}); start one, or plan with --gpus N --gpu-mem GB") \
                from exc
    try:
        alive = [n for n in ray.nodes() if n.get("Alive")]
    finally:
        if joined:  # leave Ray as it was found
            ray.shutdown()
    with_gpus = [(n.get("NodeManagerAddress", "?"), n.get("NodeID"), int(n.get("Resources", {}).get("GPU", 0)))
                 for n in alive]
    with_gpus = [(ip, nid, g) for ip, nid, g in with_gpus if g > 0]
    return ClusterInfo([g for _, _, g in with_gpus], local_gpu_memory_gb(), [ip for ip, _, _ in with_gpus],
                       [nid for _, nid, _ in with_gpus])


def local_gpu_memory_gb() -> float | None:
    """Memory of the smallest GPU of this machine (GB), or None without CUDA."""
    try:
        import torch
    except ImportError:
        return None
    if not torch.cuda.is_available():
        return None
    return min(torch.cuda.get_device_properties(i).total_memory for i in range(torch.cuda.device_count())) / GiB


def local_cluster() -> ClusterInfo:
    """This machine as a one-node cluster (no node when it has no GPU)."""
    mem = local_gpu_memory_gb()
    if mem is None:
        return ClusterInfo([], None)
    import torch

    return ClusterInfo([torch.cuda.device_count()], mem)


def detect_cluster(address: str | None = None) -> ClusterInfo:
    """The GPUs a run would get: the Ray cluster at `address`, else a running Ray cluster, else this machine."""
    if address:
        return cluster_gpus_from_ray(address)
    try:
        import ray  # noqa: F401
    except ImportError:
        return local_cluster()
    try:
        return cluster_gpus_from_ray("auto")
    except PlanError:
        return local_cluster()


def plan_summary(plan: PlacementPlan) -> dict[str, Any]:
    """The plan as JSON-friendly data (logs, run records)."""
    units = [{"role": u.role, "name": u.name, "model": u.model, "gpus": u.gpus,
              "slots": [[s.node, s.gpu] for s in u.slots],
              "peak_gb": None if u.memory is None else round(u.memory.peak, 2)} for u in plan.units]
    r = plan.rollout
    return {"name": plan.name, "nodes": plan.nodes, "gpu_mem_gb": plan.gpu_mem_gb, "fits": plan.fits,
            "problems": plan.problems, "checkpoint_gb": round(plan.checkpoint_gb, 2),
            "checkpoint_one_gb": round(plan.checkpoint_one_gb, 2),
            "checkpoint_agents_gb": {a: round(v, 2) for a, v in plan.checkpoint_agents_gb.items()},
            "checkpoint_bytes_per_param": plan.checkpoint_bytes_per_param,
            "reference_gb": {a: round(v, 2) for a, v in plan.reference_gb.items()}, "beta": plan.beta,
            "rollout": None if r is None else {"episodes": r.episodes, "setting": r.setting, "step": r.step,
                                               "fits": r.fits, "kv_tokens": r.kv_tokens,
                                               "fits_without_reference": r.fits_without_reference},
            "requests": {k: {"requests": b.requests, "setting": b.setting, "most": b.most, "fits": b.fits,
                             "tokens": b.tokens, "request_gb": round(b.request_gb, 3)}
                         for k, b in plan.requests.items()},
            "units": units}
