"""DeepSpeed setup for the learners, and Ray as an optional import.

DeepSpeed. Each agent's policy gets its own engine (agents have different architectures, so they cannot share one).
The caller owns gradient accumulation: the number of samples an agent produces varies from step to step, so the
engine runs with `managed_gradient_accumulation: false` — every `backward` accumulates, every `step` is a boundary.
`configs/deepspeed/zero2.json` is the GPU config; values written "auto" are filled from the learner config, and bf16
runs accumulate gradients in fp32. In a plain process, or a rank of a learner group (m1/marl/actor/groups.py),
`prepare_process_group` sets the rendezvous variables DeepSpeed insists on and, on CPU, skips the JIT build of the
shared-memory comm op (see environment notes §3), so collectives go through gloo.
"""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

from m1.config_files import CONFIG_DIR
from m1.models.vllm_server import free_port

_RENDEZVOUS = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1"}


class DistributedError(RuntimeError):
    pass


# ------------------------------------------------------------------------------------------------ DeepSpeed
def prepare_process_group(rank: int = 0, world: int = 1, addr: str | None = None, port: int | None = None) -> None:
    """Make `deepspeed.initialize` work in a plain `python` process or Ray actor (no launcher, no MPI).

    World size 1: sets RANK/LOCAL_RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT unless a launcher already did. A rank of a
    learner group (one process per GPU, each seeing only its own GPU as cuda:0): sets them for that rank and the
    group's rendezvous address, which every rank must be given alike. On CPU the shared-memory comm op builder (a
    ~25 s C++ JIT build, an optional speed-up for single-host CPU collectives) is replaced by a no-op, so DeepSpeed's
    collectives go through torch.distributed (gloo).
    """
    import torch

    if world > 1:
        if addr is None or port is None:
            raise DistributedError(f"rank {rank} of a group of {world}: needs the rendezvous address and port")
        os.environ.update({"RANK": str(rank), "LOCAL_RANK": "0", "WORLD_SIZE": str(world),
                           "MASTER_ADDR": addr, "MASTER_PORT": str(port)})
    elif "WORLD_SIZE" not in os.environ:
        for k, v in _RENDEZVOUS.items():
            os.environ.setdefault(k, v)
        os.environ.setdefault("MASTER_PORT", str(port or free_port()))
    if not torch.cuda.is_available():
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
        import deepspeed.comm.torch  # noqa: F401  (the attribute is shadowed by the torch module: use sys.modules)

        sys.modules["deepspeed.comm.torch"].build_shm_op = lambda: None


def resolve_ds_config(source: str | Path | dict, *, micro_batch_size: int, max_grad_norm: float | None,
                      bf16: bool) -> dict[str, Any]:
    """Read a DeepSpeed JSON (a path, a name in configs/deepspeed/, or a dict) and fill its "auto" values."""
    if isinstance(source, dict):
        cfg = json.loads(json.dumps(source))
        where = "<dict>"
    else:
        path = Path(source)
        if not path.is_file():
            cand = CONFIG_DIR / "deepspeed" / (path.name if path.suffix else f"{path.name}.json")
            if not cand.is_file():
                raise DistributedError(f"deepspeed config not found: {source} (also looked for {cand})")
            path = cand
        try:
            cfg = json.loads(path.read_text())
        except json.JSONDecodeError as exc:
            raise DistributedError(f"{path}: not valid JSON: {exc}") from exc
        where = str(path)
    if "optimizer" in cfg:
        raise DistributedError(f"{where}: remove the 'optimizer' block; the learner passes its own torch AdamW "
                               "(DeepSpeed's fused Adam would JIT-compile and change the numerics)")
    if cfg.get("gradient_accumulation_steps", 1) not in (1, "auto"):
        raise DistributedError(f"{where}: gradient_accumulation_steps must be 1; the learner accumulates over a "
                               "step's micro-batches itself (learner.micro_batch_size)")
    stage = cfg.get("zero_optimization", {}).get("stage", 0)
    if stage == 3:
        raise DistributedError(f"{where}: ZeRO-3 shards the weights, so rollouts could not generate from them; "
                               "use stage 2 (the paper's setting)")
    fills = {"train_micro_batch_size_per_gpu": micro_batch_size, "gradient_clipping": max_grad_norm or 0.0}
    for k, v in fills.items():
        if cfg.get(k, "auto") == "auto":
            cfg[k] = v
    cfg["gradient_accumulation_steps"] = 1
    cfg["managed_gradient_accumulation"] = False
    for k in ("bf16", "fp16"):
        block = cfg.setdefault(k, {})
        if block.get("enabled", "auto") == "auto":
            block["enabled"] = bf16 if k == "bf16" else False
    if cfg["bf16"]["enabled"]:  # a step sums ~50 micro-batches of gradients: accumulate them in fp32, not bf16
        cfg.setdefault("data_types", {}).setdefault("grad_accum_dtype", "fp32")
    return cfg


def deepspeed_engine(model, optimizer, ds_config: dict[str, Any]):
    """Wrap `model` and its torch optimizer in a DeepSpeed engine; returns (engine, wrapped optimizer)."""
    prepare_process_group()  # a no-op for the rendezvous when a learner group already set it
    import deepspeed

    engine, opt, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=ds_config)
    return engine, opt


# ------------------------------------------------------------------------------------------------ Ray
def _require_ray():
    try:
        import ray
    except ImportError as exc:
        raise DistributedError("placement: ray needs the `ray` package (pip install ray==2.60.0)") from exc
    return ray
