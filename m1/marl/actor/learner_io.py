"""An actor's state on disk: the checkpoint folder of one agent, the weights a rollout engine loads (and the probe
that checks the engine loaded them), and the process's random number generators.

An actor's folder holds its weights (`model/`, a whole HF folder, or `adapter/`, the peft adapter), its optimizer
state (`optimizer.pt`, or one ZeRO shard per rank, `zero-rank{rank}.pt`), `learner.json` (updates, fine-tune mode,
ranks) and optionally each rank's RNG states. Functions of the actor (m1/marl/actor/learner.py `Actor`) rather than
its methods, so that the class keeps to its update.
"""
from __future__ import annotations

import json
import random
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from m1.marl.actor.learner import Actor

ZERO_SHARD = "zero-rank{rank}.pt"  # one rank's ZeRO-2 optimizer state in an agent's checkpoint folder


def save_actor(actor: Actor, folder: str | Path, include_rng: bool = False) -> None:
    """Weights (HF folder, or the peft adapter folder), optimizer state, and optionally this process's RNG."""
    import torch

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    if actor.rank == 0:  # the weights are whole on every rank of a ZeRO-2 group: one copy is written
        weights = folder / ("adapter" if actor.cfg.finetune == "lora" else "model")
        actor.policy.save_pretrained(weights)
        _processor(actor).save_pretrained(weights)
    if actor.engine is not None:
        # each rank its own ZeRO shard (fp32 master and Adam moments of its partition), straight from the ZeRO
        # optimizer: DeepSpeed's save_checkpoint would also write the whole bf16 weights again (2 bytes per
        # parameter more), and its load reads every rank's shard on every rank
        torch.save(actor.optim.optimizer.state_dict(), folder / ZERO_SHARD.format(rank=actor.rank))
    else:
        torch.save(actor.optim.optimizer.state_dict(), folder / "optimizer.pt")
    if actor.rank == 0:
        state: dict[str, Any] = {"agent": actor.agent, "model_key": actor.name, "updates": actor.updates,
                                 "finetune": actor.cfg.finetune, "world": actor.world}
        if actor.engine is not None:  # the engine's own counters (not in the shards)
            state["engine_steps"] = [actor.engine.global_steps, actor.engine.global_samples,
                                     actor.engine.skipped_steps]
        (folder / "learner.json").write_text(json.dumps(state, indent=2))
    if include_rng:
        torch.save(rng_state(), folder / _rng_file(actor))


def export_weights(actor: Actor, folder: str | Path) -> None:
    """The weights as a rollout engine loads them: the peft adapter folder (LoRA) or a whole HF model folder."""
    if actor.rank == 0:
        actor.policy.save_pretrained(folder)
        _processor(actor).save_pretrained(folder)


def load_actor(actor: Actor, folder: str | Path, include_rng: bool = False) -> None:
    """What `save_actor` wrote into `actor`, which must have the same fine-tune mode and number of ranks."""
    import torch

    folder = Path(folder)
    state = json.loads((folder / "learner.json").read_text())
    if state["finetune"] != actor.cfg.finetune:
        raise ValueError(f"{folder}: checkpoint is a {state['finetune']} run, the config says "
                         f"{actor.cfg.finetune}")
    if state.get("world", 1) != actor.world:
        raise ValueError(f"{folder}: agent {actor.agent!r} was trained on {state.get('world', 1)} GPUs and is now "
                         f"given {actor.world}; its ZeRO optimizer shards fit that many ranks only (set "
                         f"learner.gpus back to {state.get('world', 1)} to resume)")
    if actor.cfg.finetune == "lora":
        from peft import set_peft_model_state_dict

        set_peft_model_state_dict(actor.policy, read_safetensors(folder / "adapter", "adapter_model"))
    else:
        _load_full(actor.policy, read_safetensors(folder / "model", "model"), folder / "model")
    if actor.engine is not None:
        _load_zero_shard(actor, folder, state)
    else:
        actor.optim.optimizer.load_state_dict(torch.load(folder / "optimizer.pt", weights_only=False))
    actor.updates = int(state["updates"])
    actor.weights_changed()
    if include_rng:
        set_rng_state(torch.load(folder / _rng_file(actor), weights_only=False))


def _load_zero_shard(actor: Actor, folder: Path, state: dict[str, Any]) -> None:
    """This rank's ZeRO shard into the ZeRO optimizer: Adam moments and the fp32 master of its partition (the
    bf16 weights were read from model/ or adapter/ already, once). A checkpoint written by DeepSpeed's own
    save_checkpoint (before the shards) still loads, through DeepSpeed."""
    import torch

    shard = folder / ZERO_SHARD.format(rank=actor.rank)
    if not shard.is_file() and (folder / "deepspeed").is_dir():
        actor.engine.load_checkpoint(str(folder / "deepspeed"), tag="state", load_module_strict=False)
        return
    if not shard.is_file():
        raise FileNotFoundError(f"{folder}: no ZeRO optimizer shard {shard.name} for rank {actor.rank}")
    mine = torch.load(shard, map_location="cpu", weights_only=False)
    listed: list[Any] = [None] * actor.world  # the ZeRO optimizer picks its own rank's entry
    listed[actor.rank] = mine
    actor.optim.optimizer.load_state_dict(listed, load_optimizer_states=True, load_from_fp32_weights=True)
    steps = state.get("engine_steps")
    if steps:
        actor.engine.global_steps, actor.engine.global_samples, actor.engine.skipped_steps = steps


def _processor(actor: Actor):
    """What a saved folder needs to be loaded again: the tokenizer, or a VL model's whole processor (its image
    and video processors too)."""
    return actor.scorer.chat.processor if actor.vl else actor.tokenizer


def _rng_file(actor: Actor) -> str:
    return "rng.pt" if actor.rank == 0 else f"rng-rank{actor.rank}.pt"


def reload_probe(actor: Actor, probe: tuple[list[int], list[int]]) -> tuple[list[float], float]:
    """The log-probs (temperature 1) of a rollout engine's reload probe at the actor's weights, and how close the
    engine's must be after it loads them: float32 1e-3, else 0.1 (bf16 rounding), far below what a layer left at its
    old weights changes. Any rank can answer: every rank holds the whole weights (ZeRO-2 shards only gradients and
    optimizer state)."""
    import torch

    was_training = actor.policy.training
    actor.policy.eval()
    try:
        with torch.no_grad():
            logp, _ = actor.compute_logprobs([probe], 1.0, model=actor.policy)
    finally:
        actor.policy.train(was_training)
    dtype = next(actor.policy.parameters()).dtype
    return logp[0, :len(probe[1])].tolist(), 1e-3 if dtype == torch.float32 else 0.1


def read_safetensors(folder: Path, stem: str) -> dict[str, Any]:
    """All tensors of a (possibly sharded) safetensors checkpoint in `folder`."""
    from safetensors.torch import load_file

    single = folder / f"{stem}.safetensors"
    if single.is_file():
        return load_file(single)
    index = folder / f"{stem}.safetensors.index.json"
    if not index.is_file():
        raise FileNotFoundError(f"{folder}: neither {single.name} nor {index.name}")
    out: dict[str, Any] = {}
    for shard in sorted(set(json.loads(index.read_text())["weight_map"].values())):
        out.update(load_file(folder / shard))
    return out


def _load_full(model, state: dict[str, Any], where: Path) -> None:
    missing, unexpected = model.load_state_dict(state, strict=False)
    tied = set(getattr(model, "_tied_weights_keys", None) or [])
    if isinstance(getattr(model, "_tied_weights_keys", None), dict):
        tied = set(model._tied_weights_keys)
    missing = [k for k in missing if k not in tied]
    if missing or unexpected:
        raise ValueError(f"{where}: weights do not match the model (missing {missing[:5]}, "
                         f"unexpected {unexpected[:5]})")


def rng_state() -> dict[str, Any]:
    import numpy as np
    import torch

    return {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else []}


def set_rng_state(state: dict[str, Any]) -> None:
    import numpy as np
    import torch

    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if state.get("cuda") and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def seed_everything(seed: int) -> None:
    import numpy as np
    import torch

    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)
