"""A learner's state on disk: the checkpoint folder of one agent, the weights a rollout engine loads, and the
process's random number generators.

A learner's folder holds its weights (`model/`, a whole HF folder, or `adapter/`, the peft adapter), its optimizer
state (`optimizer.pt`, or one ZeRO shard per rank, `zero-rank{rank}.pt`), `learner.json` (updates, fine-tune mode,
ranks) and optionally each rank's RNG states. Functions of the learner (m1/marl/actor/learner.py `AgentLearner`) rather
than its methods, so that the class keeps to training.
"""
from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

ZERO_SHARD = "zero-rank{rank}.pt"  # one rank's ZeRO-2 optimizer state in a learner's checkpoint folder


def save_learner(learner, folder: str | Path, include_rng: bool = False) -> None:
    """Weights (HF folder, or the peft adapter folder), optimizer state, and optionally this process's RNG."""
    import torch

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    if learner.rank == 0:  # the weights are whole on every rank of a ZeRO-2 group: one copy is written
        weights = folder / ("adapter" if learner.cfg.finetune == "lora" else "model")
        learner.policy.save_pretrained(weights)
        _processor(learner).save_pretrained(weights)
    if learner.engine is not None:
        # each rank its own ZeRO shard (fp32 master and Adam moments of its partition), straight from the ZeRO
        # optimizer: DeepSpeed's save_checkpoint would also write the whole bf16 weights again (2 bytes per
        # parameter more), and its load reads every rank's shard on every rank
        torch.save(learner.optimizer.state_dict(), folder / ZERO_SHARD.format(rank=learner.rank))
    else:
        torch.save(learner.optimizer.state_dict(), folder / "optimizer.pt")
    if learner.rank == 0:
        state: dict[str, Any] = {"agent": learner.agent, "model_key": learner.name, "updates": learner.updates,
                                 "finetune": learner.cfg.finetune, "world": learner.world}
        if learner.engine is not None:  # the engine's own counters (not in the shards)
            state["engine_steps"] = [learner.engine.global_steps, learner.engine.global_samples,
                                     learner.engine.skipped_steps]
        (folder / "learner.json").write_text(json.dumps(state, indent=2))
    if include_rng:
        torch.save(rng_state(), folder / _rng_file(learner))


def export_learner_weights(learner, folder: str | Path) -> None:
    """The weights as a rollout engine loads them: the peft adapter folder (LoRA) or a whole HF model folder."""
    if learner.rank == 0:
        learner.policy.save_pretrained(folder)
        _processor(learner).save_pretrained(folder)


def load_learner(learner, folder: str | Path, include_rng: bool = False) -> None:
    """What `save_learner` wrote into `learner`, which must have the same fine-tune mode and number of ranks."""
    import torch

    folder = Path(folder)
    state = json.loads((folder / "learner.json").read_text())
    if state["finetune"] != learner.cfg.finetune:
        raise ValueError(f"{folder}: checkpoint is a {state['finetune']} run, the config says "
                         f"{learner.cfg.finetune}")
    if state.get("world", 1) != learner.world:
        raise ValueError(f"{folder}: agent {learner.agent!r} was trained on {state.get('world', 1)} GPUs and is now "
                         f"given {learner.world}; its ZeRO optimizer shards fit that many ranks only (set "
                         f"learner.gpus back to {state.get('world', 1)} to resume)")
    if learner.cfg.finetune == "lora":
        from peft import set_peft_model_state_dict

        set_peft_model_state_dict(learner.policy, read_safetensors(folder / "adapter", "adapter_model"))
    else:
        _load_full(learner.policy, read_safetensors(folder / "model", "model"), folder / "model")
    if learner.engine is not None:
        _load_zero_shard(learner, folder, state)
    else:
        learner.optimizer.load_state_dict(torch.load(folder / "optimizer.pt", weights_only=False))
    learner.updates = int(state["updates"])
    if include_rng:
        set_rng_state(torch.load(folder / _rng_file(learner), weights_only=False))


def _load_zero_shard(learner, folder: Path, state: dict[str, Any]) -> None:
    """This rank's ZeRO shard into the ZeRO optimizer: Adam moments and the fp32 master of its partition (the
    bf16 weights were read from model/ or adapter/ already, once). A checkpoint written by DeepSpeed's own
    save_checkpoint (before the shards) still loads, through DeepSpeed."""
    import torch

    shard = folder / ZERO_SHARD.format(rank=learner.rank)
    if not shard.is_file() and (folder / "deepspeed").is_dir():
        learner.engine.load_checkpoint(str(folder / "deepspeed"), tag="state", load_module_strict=False)
        return
    if not shard.is_file():
        raise FileNotFoundError(f"{folder}: no ZeRO optimizer shard {shard.name} for rank {learner.rank}")
    mine = torch.load(shard, map_location="cpu", weights_only=False)
    listed: list[Any] = [None] * learner.world  # the ZeRO optimizer picks its own rank's entry
    listed[learner.rank] = mine
    learner.optimizer.load_state_dict(listed, load_optimizer_states=True, load_from_fp32_weights=True)
    steps = state.get("engine_steps")
    if steps:
        learner.engine.global_steps, learner.engine.global_samples, learner.engine.skipped_steps = steps


def _processor(learner):
    """What a saved folder needs to be loaded again: the tokenizer, or a VL model's whole processor (its image
    and video processors too)."""
    return learner.chat.processor if learner.vl else learner.tokenizer


def _rng_file(learner) -> str:
    return "rng.pt" if learner.rank == 0 else f"rng-rank{learner.rank}.pt"


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
