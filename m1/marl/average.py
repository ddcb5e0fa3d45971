"""Weight averaging of a MARL run's checkpoints (ours; the paper keeps the last weights).

A few dozen GRPO steps on small batches leave the last weights wherever the noise of the last steps put them. The
mean of several checkpoints' weights (checkpoint averaging, the idea behind stochastic weight averaging) keeps the
direction the checkpoints share and cancels much of the rest. With the starting weights as one more member, the
average also moves part of the way back toward them, as WiSE-FT's interpolation does.

Full weights are averaged tensor by tensor. LoRA adapters cannot be averaged factor by factor (the mean of B_i A_i
is not the product of the means), so N adapters of rank r are stacked into one of rank N*r whose update is exactly
the mean of the N updates; the starting point of a LoRA run is the base model, an update of zero.
"""
from __future__ import annotations

import json
import math
import shutil
from pathlib import Path
from typing import Any

START_DIR = "start"  # <out_dir>/start/agents: the weights training started from (average.include_start)
AVERAGE_DIR = "average"  # <out_dir>/average/agents/<agent>/{model,adapter}: the averaged weights to use
WEIGHT_FILES = {"model": "model", "adapter": "adapter_model"}  # folder name -> safetensors stem


def average_full(members: list[Path], out: Path) -> None:
    """Mean of full-model folders (HF layout) into `out`; config and tokenizer files come from the last member."""
    import torch
    from safetensors.torch import save_file

    states = [_weights(m, "model") for m in members]
    keys = _same_keys(states, members)
    mean: dict[str, Any] = {}
    for k in keys:
        acc = torch.zeros(states[0][k].shape, dtype=torch.float64)
        for s in states:
            acc += s[k].to(torch.float64)
        mean[k] = (acc / len(states)).to(states[0][k].dtype).contiguous()
    _copy_side_files(members[-1], out)
    save_file(mean, str(out / "model.safetensors"), metadata={"format": "pt"})


def average_adapters(members: list[Path], out: Path, zero_members: int = 0) -> None:
    """One LoRA adapter whose update is the mean of the members' updates and of `zero_members` zero updates.

    Member i adds s*B_i A_i (s = lora_alpha/r, or lora_alpha/sqrt(r) with rsLoRA). Stacking A_i by rows and B_i/n
    by columns gives a rank n*r adapter with B A = (1/n) sum B_i A_i; lora_alpha is raised so s is unchanged.
    LoRA biases are means over all n members; whole trained modules (modules_to_save) are means over the members,
    and cannot be averaged with the start, which the adapter does not hold.
    """
    import torch
    from safetensors.torch import save_file

    cfgs = [json.loads((m / "adapter_config.json").read_text()) for m in members]
    first = cfgs[0]
    for m, c in zip(members, cfgs):
        for key in ("r", "lora_alpha", "use_rslora", "target_modules", "base_model_name_or_path"):
            if c.get(key) != first.get(key):
                raise ValueError(f"{m}: adapter_config.json {key}={c.get(key)!r} differs from "
                                 f"{members[0]}'s {first.get(key)!r}; only adapters of one run can be averaged")
        for key in ("rank_pattern", "alpha_pattern"):
            if c.get(key):
                raise ValueError(f"{m}: adapter_config.json sets {key}; averaging supports one rank for all modules")
        if c.get("use_dora"):
            raise ValueError(f"{m}: a DoRA adapter (use_dora) has a magnitude vector that does not average linearly")
    n = len(members) + zero_members
    states = [_weights(m, "adapter") for m in members]
    out_state: dict[str, Any] = {}
    for k in _same_keys(states, members):
        dim = states[0][k].dim()
        if ("lora_A" in k or "lora_embedding_A" in k) and dim == 2:  # (r, in): stack the rows
            out_state[k] = torch.cat([s[k] for s in states], dim=0).contiguous()
        elif ("lora_B" in k or "lora_embedding_B" in k) and dim == 2:  # (out, r): stack the columns, each 1/n
            out_state[k] = (torch.cat([s[k] for s in states], dim=1) / n).to(states[0][k].dtype).contiguous()
        elif "lora_" in k or not zero_members:  # a LoRA bias is part of the update (zero at the start)
            out_state[k] = (sum(s[k].to(torch.float64) for s in states) / n).to(states[0][k].dtype).contiguous()
        else:
            raise ValueError(f"{members[0]}: {k} is a whole trained module (modules_to_save), whose starting "
                             f"weights the adapter does not hold; average it without the start "
                             f"(average.include_start: false)")
    k_members = len(members)
    cfg = dict(first)
    cfg["r"] = first["r"] * k_members
    cfg["lora_alpha"] = first["lora_alpha"] * (math.sqrt(k_members) if first.get("use_rslora") else k_members)
    _copy_side_files(members[-1], out)
    (out / "adapter_config.json").write_text(json.dumps(cfg, indent=2))
    save_file(out_state, str(out / "adapter_model.safetensors"), metadata={"format": "pt"})


def write_average(out_dir: Path, checkpoints: list[Path], agents: list[str], finetune: str,
                  include_start: bool) -> Path:
    """Average each agent's weights over `checkpoints` (and the start) into <out_dir>/average, atomically.

    Returns the folder; `average.json` in it names the members, so a reader can tell which steps it holds.
    """
    out_dir = Path(out_dir)
    kind = "adapter" if finetune == "lora" else "model"
    start = out_dir / START_DIR / "agents"
    if include_start and not start.is_dir():
        raise FileNotFoundError(f"{start}: average.include_start needs the starting weights, which a run saves at "
                                f"step 0; this run began without them (set average.include_start: false, or "
                                f"train again in an empty out_dir)")
    final = out_dir / AVERAGE_DIR
    tmp = out_dir / f".{AVERAGE_DIR}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    for agent in agents:
        members = [c / "agents" / agent / kind for c in checkpoints]
        dest = tmp / "agents" / agent / kind
        if kind == "model":
            average_full(([start / agent / kind] if include_start else []) + members, dest)
        else:
            average_adapters(members, dest, zero_members=int(include_start))
    names = ([START_DIR] if include_start else []) + [c.name for c in checkpoints]
    (tmp / "average.json").write_text(json.dumps({"members": names, "finetune": finetune}, indent=2))
    shutil.rmtree(final, ignore_errors=True)
    tmp.rename(final)
    return final


def _weights(folder: Path, kind: str) -> dict[str, Any]:
    from m1.marl.learner import read_safetensors

    return read_safetensors(folder, WEIGHT_FILES[kind])


def _same_keys(states: list[dict[str, Any]], members: list[Path]) -> list[str]:
    keys = sorted(states[0])
    for m, s in zip(members, states):
        if sorted(s) != keys:
            odd = sorted(set(s) ^ set(keys))[:5]
            raise ValueError(f"{m}: its tensors differ from {members[0]}'s ({odd}); only one run's weights average")
        bad = [k for k in keys if s[k].shape != states[0][k].shape]
        if bad:
            raise ValueError(f"{m}: tensor {bad[0]} has shape {tuple(s[bad[0]].shape)}, "
                             f"{members[0]} {tuple(states[0][bad[0]].shape)}")
    return keys


def _copy_side_files(src: Path, dest: Path) -> None:
    """Everything but the weights (config, tokenizer, chat template), so the folder loads on its own."""
    dest.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.is_file() and not f.name.endswith(".safetensors") and not f.name.endswith(".safetensors.index.json"):
            shutil.copy2(f, dest / f.name)
