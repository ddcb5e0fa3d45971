"""Learner groups: where each trained agent's learner runs, behind one interface the trainers use.

`LocalLearners`: every learner in this process (CPU runs, tests, one small GPU).
`RayLearners`: each agent's learner is a group of Ray actors, one per GPU (`learner.gpus`), that form one
torch.distributed process group (NCCL on GPU, gloo on CPU) under DeepSpeed ZeRO-2. Every rank holds the whole
weights (ZeRO-2 shards gradients and optimizer state, not weights), so every rank can also generate: the team's
requests for an agent are split across its ranks. A step's samples are split across the ranks inside
`Actor.update`. With a placement plan (m1/marl/plan/planner.py), each rank runs in the placement-group bundle the
plan gave it, so no part lands on a GPU another part holds.

Both are a `LearnerGroup` (m1/contracts.py): `chat_models()` (what the team generates with), `update(samples, lr,
family)`, `save(folder)`, `load(folder)`, `parameters(agent)`, `shutdown()`, ...
"""
from __future__ import annotations

import json
import logging
import os
import shutil
import socket
import time
import uuid
from pathlib import Path
from typing import Any, Callable

from m1.config import ModelSpec
from m1.contracts import LearnerGroup
from m1.models.base import with_seeds
from m1.marl.plan.placement_plan import with_request_batches
from m1.marl.config import GRPOSettings, LearnerConfig
from m1.marl.actor.distributed import DistributedError, _require_ray, prepare_process_group
from m1.models.vllm_server import free_port
from m1.marl.actor.learner import AgentLearner
from m1.marl.actor.learner_io import export_weights, load_actor, reload_probe, save_actor
from m1.marl.actor.sampler import Sampler
from m1.marl.rollout.episodes import Sample
from m1.marl.plan.cluster import cluster_gpus_from_ray
from m1.marl.plan.planner import make_plan
from m1.models.hub import ModelHub

log = logging.getLogger(__name__)


class LocalLearners:
    """All learners in this process (one device per agent, or all on CPU)."""

    def __init__(self, specs: dict[str, tuple[str, ModelSpec]], learner_cfg: LearnerConfig, grpo: GRPOSettings,
                 seed: int):
        self.learners = {agent: AgentLearner.build(agent, key, spec, learner_cfg, grpo, seed)
                         for agent, (key, spec) in specs.items()}

    def chat_models(self) -> dict[str, Sampler]:
        return {agent: learner.sampler for agent, learner in self.learners.items()}

    def sft_samples(self, agent: str, examples: list) -> list[Sample]:
        return [self.learners[agent].actor.scorer.sft_sample(e) for e in examples]

    def update(self, samples: dict[str, list[Sample]], lr: float, family: str = "grpo") -> dict[str, dict]:
        return {a: learner.actor.update(samples.get(a, []), lr, family) for a, learner in self.learners.items()}

    def save(self, folder: Path) -> None:
        for agent, learner in self.learners.items():
            save_actor(learner.actor, Path(folder) / agent)

    def export_weights(self, agent: str, folder: Path) -> None:
        export_weights(self.learners[agent].actor, folder)

    def probe_logprobs(self, agent: str, probe: tuple[list[int], list[int]]) -> tuple[list[float], float]:
        return reload_probe(self.learners[agent].actor, probe)

    def load(self, folder: Path) -> None:
        for agent, learner in self.learners.items():
            load_actor(learner.actor, Path(folder) / agent)

    def parameters(self, agent: str) -> dict[str, Any]:
        return self.learners[agent].actor.parameters()

    def shutdown(self) -> None:
        pass


# ------------------------------------------------------------------------------------------------ Ray
class LearnerRank:
    """One rank of an agent's learner group, run as a Ray actor: joins the group, then holds an AgentLearner."""

    def __init__(self):
        self.learner: AgentLearner | None = None

    @property
    def _built(self) -> AgentLearner:
        if self.learner is None:
            raise DistributedError("this learner rank was called before `build`")
        return self.learner

    def address(self) -> tuple[str, int]:
        """Where this rank can host the group's rendezvous (rank 0 is asked)."""
        import ray

        return ray.util.get_node_ip_address(), free_port()

    def build(self, agent: str, key: str, spec: ModelSpec, cfg: LearnerConfig, grpo: GRPOSettings, seed: int,
              rank: int, world: int, addr: str, port: int) -> dict[str, Any]:
        if world > 1:
            prepare_process_group(rank, world, addr, port)
        self.learner = AgentLearner.build(agent, key, spec, cfg, grpo, seed, rank=rank, world=world)
        import torch.distributed as dist

        return {**self.where(), "world": dist.get_world_size() if dist.is_initialized() else 1}

    def where(self) -> dict[str, Any]:
        """Host, GPU ids, placement group and resources Ray gave this actor (bundle resources are named
        `<resource>_group_<bundle index>_<group id>`): for the log and the placement tests."""
        import ray

        ctx = ray.get_runtime_context()
        return {"host": socket.gethostname(), "node_id": ctx.get_node_id(), "actor_id": ctx.get_actor_id(),
                "ip": ray.util.get_node_ip_address(), "gpu_ids": ray.get_gpu_ids(),
                "placement_group": ctx.get_placement_group_id(), "resources": ctx.get_assigned_resources(),
                "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES")}

    def generate(self, requests, params):
        return self._built.sampler.generate(requests, params)

    def sft_samples(self, examples: list) -> list[Sample]:
        return [self._built.actor.scorer.sft_sample(e) for e in examples]

    def update(self, samples, lr, family):
        return self._built.actor.update(samples, lr, family)

    def save(self, folder: str, include_rng: bool) -> None:
        save_actor(self._built.actor, folder, include_rng)

    def load(self, folder: str, include_rng: bool) -> None:
        load_actor(self._built.actor, folder, include_rng)

    def export_weights(self, folder: str) -> None:
        export_weights(self._built.actor, folder)

    def probe_logprobs(self, probe):
        return reload_probe(self._built.actor, probe)

    def parameters(self) -> dict[str, Any]:
        return self._built.actor.parameters()

    def write_marker(self, folder: str, name: str, token: str) -> str:
        return write_storage_marker(folder, name, token)


class RemoteChat:
    """A ChatModel whose generation runs on an agent's learner ranks; requests are split across the ranks."""

    remote = True  # the driver only waits on it: the team engine calls every agent's model of a phase at once

    def __init__(self, name: str, actors: list, accepts_images: bool = False):
        self.name, self._actors = name, list(actors)
        self.accepts_images = accepts_images  # a vision-language learner: the team sends it frames

    def generate(self, requests, params):
        """Each request keeps the seed of its place in the whole call (stamped before the split), so the K copies
        of a question sample distinct rollouts on whichever rank they land, as they would on one."""
        ray = _require_ray()
        if not requests:
            return []
        requests = with_seeds(requests, params)
        n = min(len(self._actors), len(requests))
        size = -(-len(requests) // n)
        refs = [actor.generate.remote(requests[i * size:(i + 1) * size], params)
                for i, actor in enumerate(self._actors[:n]) if requests[i * size:(i + 1) * size]]
        return [c for part in ray.get(refs) for c in part]


class RayLearners:
    """Per trained agent a group of `learner.gpus` Ray actors (one ZeRO-2 process group); the interface of
    `LocalLearners`. `placement(agent, rank)` gives the Ray options of each rank (a placement-group bundle);
    without it each rank asks for `ray.num_gpus_per_learner` GPUs wherever Ray finds them."""

    def __init__(self, specs: dict[str, tuple[str, ModelSpec]], learner_cfg: LearnerConfig, grpo: GRPOSettings,
                 seed: int, ray_cfg, out_dir: str | Path | None = None, worlds: dict[str, int] | None = None,
                 placement: RayPlacement | None = None):
        ray = ray_session(ray_cfg)
        worlds = {agent: (worlds or {}).get(agent, learner_cfg.gpus) for agent in specs}
        default = {"num_gpus": ray_cfg.num_gpus_per_learner, "num_cpus": ray_cfg.num_cpus_per_learner}
        actor_cls = ray.remote(LearnerRank)
        self.keys = {agent: key for agent, (key, _) in specs.items()}
        self.interfaces = {agent: spec.interface for agent, (_, spec) in specs.items()}
        self.worlds = worlds
        self.groups: dict[str, list] = {
            agent: [actor_cls.options(**(placement.options("learner", agent, r) if placement else default)).remote()
                    for r in range(worlds[agent])] for agent in specs}
        builds: dict[tuple[str, int], Any] = {}
        for agent, (key, spec) in specs.items():
            world = worlds[agent]
            addr, port = ray.get(self.groups[agent][0].address.remote()) if world > 1 else ("127.0.0.1", 0)
            for r, actor in enumerate(self.groups[agent]):
                builds[(agent, r)] = actor.build.remote(agent, key, spec, learner_cfg, grpo, seed, r, world, addr, port)
        # all ranks of a group start together: each blocks in the rendezvous until its group is complete
        self.where = dict(zip(builds, ray.get(list(builds.values()))))  # load errors surface here
        for (agent, r), w in self.where.items():
            log.info("learner %s rank %d of %d on host %s, GPUs %s", agent, r, worlds[agent], w["host"], w["gpu_ids"])
        if out_dir is not None:
            check_shared_storage(out_dir, {f"agent {agent} rank {r} (host {self.where[(agent, r)]['host']}, "
                                           f"Ray node {self.where[(agent, r)]['node_id']})":
                                           _marker_writer(actor)
                                           for agent, group in self.groups.items() for r, actor in enumerate(group)})

    def chat_models(self) -> dict[str, RemoteChat]:
        return {agent: RemoteChat(self.keys[agent], group, self.interfaces.get(agent) == "vision")
                for agent, group in self.groups.items()}

    def sft_samples(self, agent: str, examples: list) -> list[Sample]:
        ray = _require_ray()
        return ray.get(self.groups[agent][0].sft_samples.remote(examples)) if examples else []

    def update(self, samples: dict[str, list], lr: float, family: str = "grpo") -> dict[str, dict[str, float]]:
        ray = _require_ray()
        refs = {a: [actor.update.remote(samples.get(a, []), lr, family) for actor in group]
                for a, group in self.groups.items()}
        return {a: ray.get(r)[0] for a, r in refs.items()}  # every rank returns the whole step's stats

    # Folders go to the ranks as absolute paths: a relative one would name a folder on each actor's own disk and
    # working directory (the storage check at start made sure the absolute one is the same folder everywhere).
    def save(self, folder: Path) -> None:
        ray = _require_ray()
        ray.get([actor.save.remote(str(Path(folder).resolve() / agent), True)
                 for agent, group in self.groups.items() for actor in group])

    def load(self, folder: Path) -> None:
        ray = _require_ray()
        ray.get([actor.load.remote(str(Path(folder).resolve() / agent), True)
                 for agent, group in self.groups.items() for actor in group])

    def export_weights(self, agent: str, folder: Path) -> None:
        ray = _require_ray()
        ray.get(self.groups[agent][0].export_weights.remote(str(Path(folder).resolve())))

    def probe_logprobs(self, agent: str, probe: tuple[list[int], list[int]]) -> tuple[list[float], float]:
        """Rank 0's log-probs of a reload probe (m1/marl/actor/learner_io.py reload_probe)."""
        ray = _require_ray()
        return ray.get(self.groups[agent][0].probe_logprobs.remote(probe))

    def parameters(self, agent: str) -> dict[str, Any]:
        ray = _require_ray()
        return ray.get(self.groups[agent][0].parameters.remote())

    def lost_ranks(self, exc: BaseException, wait_s: float | None = None) -> str | None:
        """What a Ray failure took from these groups, for a one-line error: each Ray node that died (id, address)
        with the agents' ranks it held, or the one rank whose process died on a node that is still up. None when
        `exc` is not Ray's or every rank's node is up and no rank of ours died (a learner's own error, to be raised
        as it is).

        A node's death reaches the driver by more than one road: the dead rank's ActorDiedError, or first a
        surviving rank's collective failing on its closed connection. Ray's table of nodes can lag either by
        seconds, so it is polled for up to `wait_s` (default 30 s after an actor died, 5 s after another Ray error).
        """
        ray = _require_ray()
        if not isinstance(exc, ray.exceptions.RayError):
            return None
        actor_died = isinstance(exc, ray.exceptions.RayActorError)
        wait_s = (30.0 if actor_died else 5.0) if wait_s is None else wait_s
        ours = {w["node_id"] for w in self.where.values()}
        deadline = time.monotonic() + wait_s
        while True:
            dead = ours - {n["NodeID"] for n in ray.nodes() if n.get("Alive")}
            if dead or time.monotonic() >= deadline:
                break
            time.sleep(0.5)
        if dead:
            return "; ".join(
                f"Ray node {node} (address {self._node_ip(node)}) died: it held "
                + self._ranks([k for k, w in self.where.items() if w["node_id"] == node]) for node in sorted(dead))
        gone = [k for k, w in self.where.items() if actor_died and w.get("actor_id") == exc.actor_id]
        if gone:
            node = self.where[gone[0]]["node_id"]
            return (f"{self._ranks(gone)} died on Ray node {node} (address {self._node_ip(node)}), which is still up: "
                    "its process was killed (out of host memory? see the node's raylet.out and dmesg)")
        return None

    def _node_ip(self, node: str) -> str:
        return next(w["ip"] for w in self.where.values() if w["node_id"] == node)

    def _ranks(self, keys: list[tuple[str, int]]) -> str:
        """'agent alpha rank 1 of 2, agent beta ranks 0, 1 of 2'"""
        by_agent: dict[str, list[int]] = {}
        for agent, r in sorted(keys):
            by_agent.setdefault(agent, []).append(r)
        return ", ".join(f"agent {a} rank{'s' if len(rs) > 1 else ''} {', '.join(map(str, rs))} of {self.worlds[a]}"
                         for a, rs in by_agent.items())

    def shutdown(self) -> None:
        ray = _require_ray()
        for group in self.groups.values():
            for actor in group:
                ray.kill(actor)
        self.groups = {}


def ray_session(ray_cfg):
    """The `ray` module with a session started (a local one, or the cluster at `ray.address`)."""
    ray = _require_ray()
    if not ray.is_initialized():
        kw: dict[str, Any] = {"include_dashboard": False, "log_to_driver": True}
        if ray_cfg.address:
            kw["address"] = ray_cfg.address
        ray.init(**kw)
    return ray


class RayPlacement:
    """The plan's GPUs reserved as one Ray placement group: one bundle per planned GPU, pinned to its node when the
    cluster's node addresses are known. `options(role, name, rank)` are the Ray actor options of one planned part."""

    def __init__(self, plan, node_ips: list[str] | None = None, timeout_s: float = 300.0,
                 node_ids: list[str] | None = None):
        ray = _require_ray()
        from ray.util.placement_group import placement_group

        self.plan = plan
        self.bundles = plan.ray_bundles(node_ips=node_ips, node_ids=node_ids)
        self.group = placement_group(self.bundles.bundles, strategy="PACK", bundle_label_selector=self.bundles.labels)
        try:
            ray.get(self.group.ready(), timeout=timeout_s)
        except ray.exceptions.GetTimeoutError as exc:
            ray.util.remove_placement_group(self.group)
            raise DistributedError(
                f"placement: Ray could not reserve the plan's {len(self.bundles.bundles)} GPU bundles within "
                f"{timeout_s:.0f} s (cluster has {ray.cluster_resources()}, free now {ray.available_resources()}); "
                "another job may hold GPUs, or a node named in the plan is gone") from exc

    def options(self, role: str, name: str, rank: int = 0) -> dict[str, Any]:
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        key = (role, name, rank)
        if key not in self.bundles.index:
            raise DistributedError(f"placement: the plan has no GPU for {role} {name!r} rank {rank}")
        i = self.bundles.index[key]
        return {"num_gpus": self.bundles.bundles[i]["GPU"], "num_cpus": self.bundles.bundles[i].get("CPU", 0),
                "scheduling_strategy": PlacementGroupSchedulingStrategy(
                    self.group, placement_group_bundle_index=i, placement_group_capture_child_tasks=True)}

    def release(self) -> None:
        ray = _require_ray()
        ray.util.remove_placement_group(self.group)


def reserve_placement(cfg) -> RayPlacement | None:
    """Start Ray, plan the run (`cfg`: a TrainConfig or SFTConfig) on the GPUs the cluster reports, refuse a plan
    that does not fit, and reserve its GPUs. None on a cluster without GPUs (CPU runs place actors freely)."""
    ray_session(cfg.ray)
    info = cluster_gpus_from_ray(cfg.ray.address or "auto")
    if not info.gpus_per_node:
        return None
    plan = make_plan(cfg, nodes=info.gpus_per_node, gpu_mem_gb=cfg.cluster.gpu_mem_gb or info.gpu_mem_gb)
    if not plan.fits:
        raise DistributedError("the placement plan does not fit this cluster: " + "; ".join(plan.problems)
                               + f" (see it with: m1 {'sft' if hasattr(cfg, 'epochs') else 'train'} --plan)")
    if not plan.gpus_needed:
        return None
    log.info("placement plan:\n%s", plan.render())
    return RayPlacement(plan, info.node_ips, node_ids=info.node_ids)


# ------------------------------------------------------------------------------------------------ driver models
class ModelHost:
    """A Ray actor holding one of the driver's models (a browser VLM, a tool model, CLIP, a local judge) on the GPU
    the plan gave it, so it never shares a GPU with a learner."""

    def __init__(self, key: str, spec: ModelSpec):
        self.model = getattr(ModelHub({key: spec}), spec.interface)(key)

    def attributes(self) -> dict[str, Any]:
        """The model's plain attributes (name, dims...), which tools read without calling it."""
        return {k: v for k, v in vars(self.model).items()
                if not k.startswith("_") and isinstance(v, (str, int, float, bool, type(None)))}

    def call(self, method: str, *args, **kwargs):
        return getattr(self.model, method)(*args, **kwargs)


class RemoteModel:
    """The driver's stand-in for a model hosted by `ModelHost`: the same methods, run on the host's GPU."""

    remote = True

    def __init__(self, key: str, interface: str, actor, attributes: dict[str, Any]):
        self.__dict__.update(attributes)
        self.name, self.interface, self._actor = key, interface, actor

    def _call(self, method: str, *args, **kwargs):
        ray = _require_ray()
        return ray.get(self._actor.call.remote(method, *args, **kwargs))

    def generate(self, requests, params):
        return self._call("generate", requests, params)

    def describe(self, requests, params):
        return self._call("describe", requests, params)

    def encode_images(self, frames):
        return self._call("encode_images", frames)

    def encode_texts(self, texts):
        return self._call("encode_texts", texts)


def host_driver_models(placement: RayPlacement, specs: dict[str, ModelSpec]) -> dict[str, RemoteModel]:
    """Start a `ModelHost` for every driver model the plan put on a GPU; {key: RemoteModel} to register in a hub. A
    vision model at `max_batch_requests: auto` answers in calls of the plan's number of requests (what fits its GPU)."""
    ray = _require_ray()
    specs = with_request_batches(specs, placement.plan)
    hosts = {}
    for key, slots in placement.plan.driver.items():
        if key not in specs:
            continue
        if len(slots) > 1:
            raise DistributedError(f"placement: driver model {key!r} is planned on {len(slots)} GPUs; a driver model "
                                   "runs on one GPU (use a smaller model, or serve it with vLLM behind an "
                                   "OpenAI-compatible endpoint: backend openai)")
        hosts[key] = ray.remote(ModelHost).options(**placement.options("driver", key, 0)).remote(key, specs[key])
    attrs = ray.get([h.attributes.remote() for h in hosts.values()])  # load errors surface here
    return {key: RemoteModel(key, specs[key].interface, host, a) for (key, host), a in zip(hosts.items(), attrs)}


def lost_ranks(learners, exc: BaseException) -> str | None:
    """`RayLearners.lost_ranks` for any learners (None for those in this process: no node of theirs can die alone)."""
    return learners.lost_ranks(exc) if isinstance(learners, RayLearners) else None


def stop_on_lost_ranks(learners, exc: BaseException, during: str, checkpointed: int) -> None:
    """A learner rank lost with its Ray node (or its process) mid-step: raise one error naming the node, its address
    and the ranks it held, and where a rerun resumes (Ray's own error says only that some actor died). Returns for
    any other error, which the caller re-raises as it is. Shared by the SFT and GRPO trainers."""
    lost = lost_ranks(learners, exc)
    if lost is None:
        return
    resume = (f"it resumes from the checkpoint of step {checkpointed}" if checkpointed
              else "no checkpoint was written yet, so it starts again from step 0")
    raise DistributedError(f"{lost}, during {during}; the run stopped. Start the node again (or give the run other "
                           f"GPUs) and rerun the same command: {resume}") from exc


def _marker_writer(actor) -> Callable[[str, str, str], str]:
    def write(folder: str, name: str, token: str) -> str:
        import ray

        return ray.get(actor.write_marker.remote(folder, name, token))
    return write


# ------------------------------------------------------------------------------------------------ storage
STORAGE_CHECK_DIR = ".storage-check"


def write_storage_marker(folder: str, name: str, token: str) -> str:
    """Write `<folder>/<name>.json` holding `token` and this host's name, as a remote rank sees `folder`."""
    path = Path(folder)
    path.mkdir(parents=True, exist_ok=True)
    (path / f"{name}.json").write_text(json.dumps({"token": token, "host": socket.gethostname()}))
    return socket.gethostname()


def check_shared_storage(out_dir: str | Path, writers: dict[str, Callable[[str, str, str], str]]) -> None:
    """Refuse to train unless every writer (a rank, maybe on another node) writes where this process reads.

    Checkpoints are written by the ranks and renamed and pruned by the driver, so `out_dir` must be one folder for
    all of them (a shared file system). Each writer is handed the same absolute folder and a fresh token; a marker
    the driver cannot read back, or one with another run's token, names the writer and its host.
    """
    folder = Path(out_dir).resolve() / STORAGE_CHECK_DIR / uuid.uuid4().hex
    token = uuid.uuid4().hex
    missing = []
    try:
        for i, (who, write) in enumerate(writers.items()):
            name = f"writer-{i}"
            host = write(str(folder), name, token)
            marker = folder / f"{name}.json"
            try:
                ok = json.loads(marker.read_text()).get("token") == token
            except (OSError, json.JSONDecodeError):
                ok = False
            if not ok:
                missing.append(f"{who} wrote on host {host}")
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    if missing:
        raise DistributedError(
            f"out_dir {Path(out_dir).resolve()} is not shared storage: the driver (host {socket.gethostname()}) "
            f"cannot read what {'; '.join(missing)} wrote there. Put out_dir on a file system every node mounts "
            "at the same path (NFS, Lustre, a mounted bucket)")


def build_learners(specs: dict[str, tuple[str, ModelSpec]], learner_cfg: LearnerConfig, grpo: GRPOSettings,
                   seed: int, placement: str = "local", ray_cfg=None, out_dir: str | Path | None = None,
                   worlds: dict[str, int] | None = None, reserved: RayPlacement | None = None) -> LearnerGroup:
    """The learners of a run: in this process, or Ray actor groups (`worlds`: GPUs per agent) in the bundles
    `reserved` for them."""
    if placement == "ray":
        return RayLearners(specs, learner_cfg, grpo, seed, ray_cfg, out_dir, worlds, reserved)
    many = {a: n for a, n in (worlds or {a: learner_cfg.gpus for a in specs}).items() if n > 1}
    if many:
        raise DistributedError(f"learners on several GPUs ({many}) are groups of processes: set placement: ray "
                               "(scripts/train_ray.sh)")
    return LocalLearners(specs, learner_cfg, grpo, seed)
