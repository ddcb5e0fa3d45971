"""The placement plan as data: which GPUs each learner group, rollout engine and driver model gets, with its memory
estimate, and how the plan reads (`render`) and becomes Ray placement-group bundles.

m1/marl/plan/planner.py `make_plan` builds it; the trainer, the learner groups and `--plan` only read it, so they import
these records without the planning logic.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from m1.config import ModelSpec
from m1.marl.plan.cluster import RAY_NODE_ID_LABEL, PlanError
from m1.marl.plan.memory_model import MemoryEstimate


@dataclass
class RolloutChunk:
    """How many of a step's episodes the team runs at once when the learners generate (rollout.engine hf)."""

    episodes: int  # what the run uses
    setting: str  # where the number comes from: "rollout.batch_episodes: auto", "rollout.batch_episodes", ...
    step: int  # episodes of one step (questions_per_step * num_generations)
    fits: int | None  # most episodes whose KV cache fits every learner GPU; None: unknown (no GPU size, CPU run)
    kv_tokens: int | None = None  # the KV token budget of the tightest learner GPU (fits: its sequences * tokens)
    fits_without_reference: int | None = None  # what `fits` would be at grpo.beta = 0 (no reference copy)


@dataclass
class RequestBatch:
    """How many requests a driver's vision model (hf / eagle) answers in one generate call, and what one costs."""

    requests: int  # what the run uses (written into the model's spec: `with_request_batches`)
    setting: str  # "max_batch_requests: auto" or "max_batch_requests"
    most: int  # the longest request list one call of the run can carry (episodes at once x agents)
    fits: int | None  # most requests whose KV cache and activations fit its GPU after the weights; None: unknown
    tokens: int  # of one request: frames x visual tokens per frame + prompt + new tokens
    request_gb: float  # KV cache + activations of one request


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
    rollout: RolloutChunk | None = None  # HF rollouts: episodes at once; None: SFT or vLLM engines
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
        lines += self._gpu_table()
        unplaced = [u for u in self.units if len(u.slots) < u.gpus]
        for u in unplaced:
            peak = f"{u.memory.peak:.1f} GB per GPU" if u.memory else "size unknown"
            lines.append(f"  not placed: {u.role} {u.name} ({u.model}), {u.gpus} GPU(s), {peak}")
        lines.append("(peak = weights + optimizer + grads + reference + max(activations, kv) + reserve)")
        lines += self._storage_lines()
        lines += self._batch_lines()
        lines += [f"note: {n}" for n in self.notes]
        if self.fits:
            lines.append("fits: yes")
        else:
            lines.append("fits: NO")
            lines += [f"problem: {p}" for p in self.problems]
        return "\n".join(lines)

    def _gpu_table(self) -> list[str]:
        """The header and one line per GPU (a run of free GPUs on a node is one line)."""
        short = {"optimizer": "optim", "reference": "ref", "activations": "act"}
        head = f"{'node':>4} {'gpu':>5}  {'role':<7} {'name':<14} {'rank':>5} {'est GB':>7}  " + " ".join(
            f"{short.get(k, k):>7}" for k in MemoryEstimate().parts())
        lines = [head, "-" * len(head)]
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
        return lines

    def _storage_lines(self) -> list[str]:
        """What the checkpoints take on disk and what the reference copy takes on the GPUs."""
        lines = [f"checkpoint: {self.checkpoint_one_gb:.1f} GB each, {self.checkpoint_gb:.1f} GB kept on disk"]
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
        return lines

    def _batch_lines(self) -> list[str]:
        """How many rollout episodes, and how many requests of each vision driver, are in flight at once."""
        lines = []
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
        return lines


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
