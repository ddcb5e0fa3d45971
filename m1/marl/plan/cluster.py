"""The real cluster: how many GPUs of what size a run would get, asked of Ray or of this machine.

Ray and torch are imported here only inside the functions that ask them, so planning a cluster one describes
(`m1 train --plan --gpus N --gpu-mem GB`) needs neither. `PlanError` lives here, below
m1/marl/plan/placement_plan.py and planner.py, since a cluster that cannot be asked is the first refusal a plan meets.
"""
from __future__ import annotations

from dataclasses import dataclass

from m1.marl.plan.memory_model import GiB

RAY_NODE_ID_LABEL = "ray.io/node-id"  # the label Ray puts on every node: its node id


class PlanError(ValueError):
    """A cluster or plan request that cannot be answered (a typo in cluster:, no cluster to ask)."""


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
