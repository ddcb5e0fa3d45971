"""Building the placement plan: `make_plan` checks a run against its GPUs before any model loads.

A 7-8B full fine-tune that does not fit its GPUs fails minutes into a run, after every model has loaded, with an
out-of-memory error that names nothing. `make_plan` answers the same question from the models' shapes alone
(m1/marl/plan/memory_model.py) in well under a second: it estimates the peak memory of every GPU, hands out whole GPUs
node by node, and lists every shortfall by agent or model with the setting that would fix it. It goes in the order the
plan is read: learners, their rollout batch, rollout engines, driver models, then memory checks, GPU assignment and
checkpoint sizes, one helper each (`_Draft` carries what they gather). Nothing here imports torch or ray; the
cluster is asked through m1/marl/plan/cluster.py.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path

from m1.config import ModelSpec, TeamConfig
from m1.marl.plan.cluster import PlanError, detect_cluster, local_cluster
from m1.marl.config import ClusterConfig, LearnerConfig, SFTConfig, TrainConfig
from m1.marl.plan.memory_model import (VISION_PROMPT_TOKENS, MemoryEstimate, chat_shape, checkpoint_bytes,
                                  driver_vision_shape, in_gb, kv_fit, kv_token_bytes, learner_memory, model_parameters,
                                  needs_gpu, reference_bytes, request_frames, trained_weight_bytes,
                                  vision_request_bytes, weight_bytes)
from m1.marl.plan.placement_plan import GpuSlot, PlacementPlan, RequestBatch, RolloutChunk, Unit
from m1.models.hf import DEFAULT_VISION_BATCH
from m1.models.shapes import ShapeError, TextShape
from m1.registry import TOOLS


def resolve_rollout_batch(cfg: TrainConfig, fits: int | None, kv_tokens: int | None = None) -> RolloutChunk:
    """The episodes a MARL run's HF rollouts run at once: rollout.batch_episodes (auto: the step's episodes, or as
    many as `fits` when fewer fit), else the team's limits.batch_episodes."""
    r = cfg.rollout
    step = r.questions_per_step * r.num_generations
    if r.batch_episodes == "auto":
        n = step if fits is None else max(1, min(fits, step))
        return RolloutChunk(n, "rollout.batch_episodes: auto", step, fits, kv_tokens)
    if r.batch_episodes is not None:
        return RolloutChunk(r.batch_episodes, "rollout.batch_episodes", step, fits, kv_tokens)
    return RolloutChunk(cfg.team_config().limits.batch_episodes, "limits.batch_episodes", step, fits, kv_tokens)


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

    specs = [s for name, s in TOOLS.items() if name in enabled]
    viewing = [s.model_attr for s in specs if s.model_attr]
    if any(a == "browser" or not getattr(t, a) for a in viewing):  # the fallback first, as before
        add(t.browser)
    for attr in viewing:
        add(getattr(t, attr))
    if any(s.clip for s in specs):
        add(t.clip)
    key_of = {a.name: a.model for a in team.agents}
    for agent in frozen:
        add(key_of[agent])
    return used



@dataclass
class _Draft:
    """What `make_plan` gathers as it goes: the run's settings, and the units, problems and notes found so far (each
    list in the order the plan reports them)."""

    cfg: TrainConfig | SFTConfig
    team: TeamConfig
    trained: list[str]  # agents the run trains, in team order
    units: list[Unit] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    on_cpu: list[str] = field(default_factory=list)  # "learner a" / "driver k": models that get no GPU
    shapes: dict[str, TextShape] = field(default_factory=dict)  # each GPU learner's decoder

    @property
    def cc(self) -> ClusterConfig:
        return self.cfg.cluster

    @property
    def learner(self) -> LearnerConfig:
        return self.cfg.learner

    @property
    def sft(self) -> bool:
        return isinstance(self.cfg, SFTConfig)

    @property
    def key_of(self) -> dict[str, str]:
        return {a.name: a.model for a in self.team.agents}


def make_plan(cfg: TrainConfig | SFTConfig, gpus: int | None = None, gpu_mem_gb: float | None = None,
              nodes: list[int] | None = None, teacher: bool | None = None) -> PlacementPlan:
    """Plan a MARL (TrainConfig) or SFT (SFTConfig) run on `gpus` GPUs (ceil(gpus / cluster.gpus_per_node) nodes)
    or on `nodes` (GPUs of each node); with neither, the cluster Ray or this machine reports (`detect_cluster`).

    GPU memory: `gpu_mem_gb`, else cluster.gpu_mem_gb, else what the detected cluster reports. Learners are placed
    first (agent order), then rollout engines, then driver models. `teacher` (SFT): also plan the teacher team's
    models, which build the examples first; None: only when data.examples does not exist yet. The plan never
    changes a configured GPU count: a learner that does not fit is a problem that says which count would.
    """
    nodes, mem_gb = _cluster_size(cfg, gpus, gpu_mem_gb, nodes)
    d = _draft(cfg)
    # rollouts from vLLM servers: no KV cache in the learners; engines M1 launches get GPUs of their own
    on_engines = not d.sft and cfg.rollout.engine == "vllm"
    reference = (not d.sft) and cfg.grpo.beta > 0 and d.learner.finetune == "full"
    _plan_learners(d, reference)
    rollout = None if d.sft or on_engines else _plan_rollout(d, mem_gb, reference)
    if on_engines and not cfg.rollout.engine_url:
        _plan_engines(d)
    drivers, driver_team, episodes_at_once = _driver_models_of(d, teacher, on_engines, rollout)
    usable = (mem_gb or 0.0) * (1 - d.cc.headroom)
    requests, sized = _plan_drivers(d, drivers, driver_team, episodes_at_once, mem_gb, usable)
    if mem_gb is None and d.units and sum(nodes):
        raise PlanError("GPU memory unknown: give --gpu-mem GB or cluster.gpu_mem_gb (Ray does not report it)")
    if mem_gb is not None:  # without GPUs nor a size, only the count problem of `_assign_gpus` is reported
        _memory_problems(d, mem_gb, usable, reference, 0 if rollout is None else rollout.episodes, sized)
    _assign_gpus(d, nodes)
    return _finish(d, nodes, mem_gb or 0.0, usable, rollout, requests)


def _cluster_size(cfg: TrainConfig | SFTConfig, gpus: int | None, gpu_mem_gb: float | None,
                  nodes: list[int] | None) -> tuple[list[int], float | None]:
    """The GPUs of each node and their memory (GB; None: unknown): as given, else as the cluster reports."""
    cc: ClusterConfig = cfg.cluster
    if nodes is None and gpus is not None:
        if gpus < 0:
            raise PlanError(f"--gpus must be >= 0, got {gpus}")
        nodes = node_sizes(gpus, cc.gpus_per_node)
    mem_gb = gpu_mem_gb if gpu_mem_gb is not None else cc.gpu_mem_gb
    if nodes is None:
        info = detect_cluster(getattr(getattr(cfg, "ray", None), "address", None))
        nodes = info.gpus_per_node
        mem_gb = mem_gb if mem_gb is not None else info.gpu_mem_gb
    return nodes, mem_gb


def _draft(cfg: TrainConfig | SFTConfig) -> _Draft:
    """An empty draft of `cfg`'s plan; refuses learner GPU counts set for agents the run does not train."""
    team = cfg.team_config()
    trained = list(cfg.train_agents or [a.name for a in team.agents])
    for agent in cfg.cluster.learner_gpus:
        if agent not in trained:
            raise PlanError(f"cluster.learner_gpus: {agent!r} is not a trained agent (trained: {trained})")
    return _Draft(cfg, team, trained)


def _plan_learners(d: _Draft, reference: bool) -> None:
    """One unit per trained agent on a GPU, its memory before any rollout KV cache (`_plan_rollout` adds it)."""
    learner, key_of = d.learner, d.key_of
    for agent in d.trained:
        spec = d.team.models[key_of[agent]]
        n = d.cc.gpus_of(agent, learner)
        if not needs_gpu(spec):
            d.on_cpu.append(f"learner {agent}")
            continue
        try:
            d.shapes[agent] = shape = chat_shape(spec)
        except ShapeError as exc:
            d.problems.append(f"agent {agent}: {exc}")
            d.units.append(Unit("learner", agent, spec.path or "tiny", n, None))
            continue
        zero = learner.deepspeed is not None
        if n > 1 and not zero:
            d.problems.append(f"agent {agent}: a learner of {n} GPUs needs learner.deepspeed (a ZeRO-2 JSON such as "
                              "configs/deepspeed/zero2.json) to shard its optimizer and gradients")
        d.units.append(Unit("learner", agent, spec.path or "tiny", n,
                            learner_memory(shape, learner, n, reference, 0, d.cc.reserve_gb, zero)))


def _plan_rollout(d: _Draft, mem_gb: float | None, reference: bool) -> RolloutChunk:
    """HF rollouts: the learners generate for the batch's episodes at once, their KV cache in what each GPU has
    left; sets each learner unit's KV cache to its share of the batch."""
    learner = d.learner
    seq = learner.max_prompt_tokens + learner.max_completion_tokens
    per_seq = {a: seq * kv_token_bytes(shape, learner) for a, shape in d.shapes.items()}
    fits, tokens, fits0 = _learner_kv_fit(d, mem_gb, reference, per_seq, seq)
    rollout = resolve_rollout_batch(d.cfg, fits, tokens)
    rollout.fits_without_reference = fits0
    kv_seqs = rollout.episodes
    for u in d.units:
        if u.role == "learner" and u.memory is not None:
            u.memory.kv = in_gb(-(-kv_seqs // u.gpus) * per_seq[u.name])
    return rollout


def _learner_kv_fit(d: _Draft, mem_gb: float | None, reference: bool, per_seq: dict[str, int],
                    seq: int) -> tuple[int | None, int | None, int | None]:
    """(episodes whose KV cache fits the tightest learner GPU, its KV token budget, the episodes that would fit
    without the reference copy); all None when unknown (no GPU size, or a learner on the CPU or of unknown size)."""
    gpu_learners = [u for u in d.units if u.role == "learner" and u.memory is not None]
    if not (gpu_learners and mem_gb is not None and len(gpu_learners) == len(d.shapes)):
        return None, None, None
    usable_kv = mem_gb * (1 - d.cc.headroom)
    if d.cfg.placement == "local":  # one process: learners naming the same device share its memory
        key_of = d.key_of
        device = {u.name: d.team.models[key_of[u.name]].device.replace("auto", "cuda") for u in gpu_learners}
        device = {a: "cuda:0" if dev == "cuda" else dev for a, dev in device.items()}
        groups = [[u for u in gpu_learners if device[u.name] == dev] for dev in sorted(set(device.values()))]
    else:
        groups = [[u] for u in gpu_learners]
    fit_of = [(kv_fit([(u.memory, per_seq[u.name], u.gpus if len(g) == 1 else 1) for u in g], usable_kv), g)
              for g in groups]
    fits, tight = min(fit_of, key=lambda x: x[0])
    tokens = seq * -(-fits // tight[0].gpus) if len(tight) == 1 else seq * fits
    fits0 = None
    if reference:  # what the memory of the reference copy would hold instead
        fits0 = min(kv_fit([(replace(u.memory, reference=0.0), per_seq[u.name], u.gpus if len(g) == 1 else 1)
                            for u in g], usable_kv) for g in groups)
    return fits, tokens, fits0


def _plan_engines(d: _Draft) -> None:
    """The vLLM engines M1 launches: cluster.engine_gpus GPUs each, for every trained agent on a GPU."""
    learner, cc, key_of = d.learner, d.cc, d.key_of
    for agent in d.trained:
        if agent not in d.shapes:
            continue
        shape, n = d.shapes[agent], cc.engine_gpus
        seq = learner.max_prompt_tokens + learner.max_completion_tokens
        d.units.append(Unit("engine", agent, d.team.models[key_of[agent]].path or "tiny", n, MemoryEstimate(
            weights=in_gb(2 * shape.parameters() / n), reserve=cc.reserve_gb,
            kv=in_gb(d.team.limits.batch_episodes * seq * shape.kv_bytes_per_token() / n))))
    d.notes.append("a vLLM engine claims gpu_memory_utilization of its GPUs whatever the estimate; the rest is "
                   "its KV cache")


def _driver_models_of(d: _Draft, teacher: bool | None, on_engines: bool, rollout: RolloutChunk | None
                      ) -> tuple[dict[str, ModelSpec], TeamConfig, int]:
    """The models the driver process loads (tool models, frozen agents, a local judge; for SFT the teacher team's
    when it builds the examples), the team whose tools they serve, and the episodes that team runs at once."""
    cfg, team = d.cfg, d.team
    drivers: dict[str, ModelSpec] = {}
    driver_team, episodes_at_once = team, team.limits.batch_episodes  # whose tools the driver models serve
    if d.sft:
        build = teacher if teacher is not None else not (cfg.data.examples and Path(cfg.data.examples).is_file())
        teacher_cfg = cfg.teacher_config()
        if build and teacher_cfg is not None:
            drivers = _driver_models(teacher_cfg, [a.name for a in teacher_cfg.agents])
            driver_team, episodes_at_once = teacher_cfg, teacher_cfg.limits.batch_episodes
            d.notes.append("the driver models are the teacher's, loaded to build data.examples before training")
        return drivers, driver_team, episodes_at_once
    drivers = _driver_models(team, [a.name for a in team.agents if a.name not in d.trained])
    if on_engines:  # the trainer sends a vLLM step's episodes to the team at once (m1/marl/trainer.py)
        episodes_at_once = max(team.limits.batch_episodes,
                               cfg.rollout.questions_per_step * cfg.rollout.num_generations)
    elif rollout is not None:
        episodes_at_once = rollout.episodes
    j = cfg.judge
    if j.method == "llm" and j.model is not None:
        drivers["judge"] = j.model
    return drivers, driver_team, episodes_at_once


def _plan_drivers(d: _Draft, drivers: dict[str, ModelSpec], driver_team: TeamConfig, episodes_at_once: int,
                  mem_gb: float | None, usable: float) -> tuple[dict[str, RequestBatch], set[str]]:
    """A unit per driver model on a GPU, and notes naming those on the CPU or behind an API. Returns the vision
    models' request batches and the models whose batch is already a problem (not reported twice)."""
    on_gpus = sorted(k for k, spec in drivers.items() if needs_gpu(spec))
    for key in d.cc.driver_gpus:
        if key not in on_gpus:
            raise PlanError(f"cluster.driver_gpus: {key!r} is not a model the driver loads on a GPU "
                            f"(those: {on_gpus})")
    api = []
    requests: dict[str, RequestBatch] = {}
    sized: set[str] = set()
    for key, spec in drivers.items():
        if not needs_gpu(spec):
            if spec.backend in ("hf", "vllm", "open_clip", "eagle"):
                d.on_cpu.append(f"driver {key}")
            elif spec.backend == "openai":
                api.append(f"{key} ({spec.path})")
            continue
        d.units.append(_driver_unit(d, key, spec, driver_team, episodes_at_once,
                                    usable if mem_gb is not None else None, usable, requests, sized))
    if d.on_cpu:
        d.notes.append("on the CPU (no GPU planned): " + ", ".join(d.on_cpu))
    if api:
        d.notes.append("behind an API (no GPU planned): " + ", ".join(api))
    return requests, sized


def _driver_unit(d: _Draft, key: str, spec: ModelSpec, driver_team: TeamConfig, episodes_at_once: int,
                 known_usable: float | None, usable: float, requests: dict[str, RequestBatch],
                 sized: set[str]) -> Unit:
    """One driver model on the GPU: cluster.driver_gpus of them, a vLLM model's tensor_parallel_size, else the
    fewest GPUs its share of weights fits on; a vision model's memory counts its request batch.
    `known_usable`: the planned GB per GPU, None when the GPU size is unknown."""
    cc = d.cc
    try:
        params = model_parameters(spec)
    except ShapeError as exc:
        d.problems.append(f"driver model {key}: {exc}")
        return Unit("driver", key, spec.path or spec.clip_name or "?", 1, None)
    weights = params * weight_bytes(spec, 4 if spec.backend == "open_clip" else 2)

    def driver_mem(n: int) -> MemoryEstimate:
        return MemoryEstimate(weights=in_gb(weights / n), activations=in_gb(weights * cc.driver_headroom / n),
                              reserve=cc.reserve_gb)

    if key in cc.driver_gpus:
        n = cc.driver_gpus[key]
    elif spec.backend == "vllm":
        n = spec.tensor_parallel_size
    else:  # one GPU unless the model does not fit on one
        n = next((k for k in range(1, cc.gpus_per_node + 1) if driver_mem(k).peak <= usable), 1)
    mem = driver_mem(n)
    if spec.interface == "vision" and spec.backend in ("hf", "eagle"):
        mem = _vision_driver_memory(d, key, spec, driver_team, len(driver_team.agents) * episodes_at_once,
                                    in_gb(weights / n), known_usable, requests, sized) or mem
    return Unit("driver", key, spec.path or spec.clip_name or "tiny", n, mem)


def _memory_problems(d: _Draft, mem_gb: float, usable: float, reference: bool, kv_seqs: int,
                     sized: set[str]) -> None:
    """A problem for each unit whose peak does not fit one GPU, with the setting that would fix it."""
    cc = d.cc
    for u in d.units:
        if u.memory is None or u.memory.peak <= usable or (u.role == "driver" and u.name in sized):
            continue
        short = u.memory.peak - usable
        head = (f"needs {u.memory.peak:.1f} GB per GPU on {u.gpus} GPU(s), the GPUs have {mem_gb:g} GB "
                f"({usable:.1f} GB planned after the {cc.headroom:.0%} headroom; short {short:.1f} GB)")
        if u.role == "learner":
            fix = _learner_fix(u.name, d.shapes[u.name], d.learner, reference, kv_seqs, cc, usable)
            d.problems.append(f"agent {u.name}: learner {head}; {fix}")
        elif u.role == "engine":
            d.problems.append(f"agent {u.name}: rollout engine {head}; raise cluster.engine_gpus")
        else:
            d.problems.append(f"driver model {u.name}: {head}; set cluster.driver_gpus.{u.name} higher")


def _assign_gpus(d: _Draft, nodes: list[int]) -> None:
    """Whole GPUs, node by node, in unit order (learners, engines, drivers); one problem lists what is left over."""
    units = d.units
    free = [list(range(k)) for k in nodes]
    for u in units:
        u.slots = _allocate(free, u.gpus) or []
        if len(u.slots) > 1 and len({s.node for s in u.slots}) > 1:
            d.notes.append(f"{u.role} {u.name} spans nodes {sorted({s.node for s in u.slots})}")
    unplaced = [u for u in units if not u.slots and u.gpus]
    if unplaced:
        need, have = sum(u.gpus for u in units), sum(nodes)
        what = ", ".join(f"{'agent ' + u.name + ' learner' if u.role == 'learner' else u.role + ' ' + u.name} "
                         f"({u.gpus} GPU{'s' if u.gpus > 1 else ''})" for u in unplaced)
        by_role = ", ".join(f"{r}s {sum(u.gpus for u in units if u.role == r)}"
                            for r in ("learner", "engine", "driver") if any(u.role == r for u in units))
        d.problems.append(f"needs {need} GPUs ({by_role}), the cluster has {have} (short {need - have}); "
                          f"not placed: {what}")


def _finish(d: _Draft, nodes: list[int], mem_gb: float, usable: float, rollout: RolloutChunk | None,
            requests: dict[str, RequestBatch]) -> PlacementPlan:
    """The plan, with its checkpoint sizes and each full fine-tune's reference copy."""
    cfg, learner, key_of = d.cfg, d.learner, d.key_of
    per_agent: dict[str, float] = {}  # every trained agent writes a checkpoint, on a GPU or not
    for agent in d.trained:
        try:
            per_agent[agent] = in_gb(checkpoint_bytes(d.shapes.get(agent) or chat_shape(d.team.models[key_of[agent]]),
                                                      learner))
        except ShapeError:  # a CPU model whose folder is not there yet: a learner problem names GPU ones
            pass
    one = sum(per_agent.values())
    zero = learner.deepspeed is not None
    ref_gb = ({a: in_gb(reference_bytes(shape, learner)) for a, shape in d.shapes.items()}
              if not d.sft and learner.finetune == "full" else {})
    return PlacementPlan(name=cfg.name, nodes=list(nodes), gpu_mem_gb=mem_gb, usable_gb=usable, units=d.units,
                         checkpoint_one_gb=one, checkpoint_gb=one * cfg.checkpoint.keep_last,
                         problems=d.problems, notes=d.notes, cpus_per_gpu=d.cc.cpus_per_gpu,
                         checkpoint_agents_gb=per_agent,
                         checkpoint_bytes_per_param=trained_weight_bytes(learner, zero) + (12 if zero else 8),
                         reference_gb=ref_gb, beta=None if d.sft else cfg.grpo.beta, rollout=rollout,
                         requests=requests)


def _vision_driver_memory(d: _Draft, key: str, spec: ModelSpec, team: TeamConfig, most: int, weights_gb: float,
                          usable: float | None, requests: dict[str, RequestBatch],
                          sized: set[str]) -> MemoryEstimate | None:
    """The memory of a vision driver model with its request batch: its weights, then as many requests per generate
    call as fit what the GPU has left (`kv_fit`; auto) or as the spec sets, each counted by `vision_request_bytes`.
    Records the batch in `requests`; a GPU that cannot hold one request, or a set batch that does not fit, is a
    problem. None when the model's request size is unknown here (a note says so; the share-of-weights estimate
    stays)."""
    cc, problems = d.cc, d.problems
    try:
        shape = driver_vision_shape(spec)
    except ShapeError as exc:
        d.notes.append(f"driver {key}: its request batch is not counted ({exc})")
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
           f"{VISION_PROMPT_TOKENS} prompt + {new} new = {tokens} tokens) needs {in_gb(per):.2f} GB of KV cache and "
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
                                 in_gb(per))
    return replace(base, activations=in_gb(n * per), kv=in_gb(n * kv1))


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
