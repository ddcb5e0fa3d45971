"""Training checkpoints: one folder per saved step, written atomically; found again on resume.

A checkpoint holds each learner's weights (or adapter) and optimizer state, the process RNG states and the trainer's
state (step, data cursor, seed, agents), so a resumed run repeats an uninterrupted one exactly on CPU.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

from m1.marl.learner import _rng_state, _set_rng_state

CHECKPOINT_DIR = "checkpoints"
LATEST = "latest"


def save_checkpoint(out_dir: Path, step: int, learners, state: dict[str, Any], keep_last: int) -> Path:
    """Write <out>/checkpoints/step-NNNNNN atomically (temp folder, then rename); keep the newest `keep_last`.

    Holds every learner's weights/adapter and optimizer, the process RNG states and `state` (step, data cursor...).
    """
    import torch

    root = Path(out_dir) / CHECKPOINT_DIR
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"step-{step:06d}"
    tmp = root / f".{final.name}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    learners.save(tmp / "agents")
    torch.save(_rng_state(), tmp / "rng.pt")
    (tmp / "trainer_state.json").write_text(json.dumps(state, indent=2))
    shutil.rmtree(final, ignore_errors=True)
    tmp.rename(final)
    (root / LATEST).write_text(final.name)
    done = sorted(p for p in root.glob("step-*") if p.is_dir())
    for old in done[:-keep_last]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def load_checkpoint(folder: Path, learners, agents: list[str], seed: int) -> dict[str, Any]:
    """Restore learners and RNG states from a checkpoint folder; returns its saved state."""
    import torch

    state = json.loads((folder / "trainer_state.json").read_text())
    if sorted(state["agents"]) != sorted(agents):
        raise ValueError(f"{folder}: checkpoint trains agents {state['agents']}, the config {agents}")
    if state["seed"] != seed:
        raise ValueError(f"{folder}: checkpoint seed {state['seed']} differs from the config's {seed}")
    learners.load(folder / "agents")
    _set_rng_state(torch.load(folder / "rng.pt", weights_only=False))
    return state

def finished_checkpoints(out_dir: Path) -> list[Path]:
    """The complete checkpoint folders of a run, oldest first."""
    return sorted(p for p in (Path(out_dir) / CHECKPOINT_DIR).glob("step-*") if (p / "trainer_state.json").is_file())


def find_latest_checkpoint(out_dir: Path) -> Path | None:
    root = Path(out_dir) / CHECKPOINT_DIR
    marker = root / LATEST
    if marker.is_file():
        cand = root / marker.read_text().strip()
        if (cand / "trainer_state.json").is_file():
            return cand
    done = finished_checkpoints(out_dir)
    return done[-1] if done else None
