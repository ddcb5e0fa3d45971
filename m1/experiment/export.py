"""`m1 experiment export`: an arm's trained agents, as its eval seats them, written as plain model folders.

A shipped team (configs/team/mini_trained.yaml reads assets/mini_team/<agent>) should not depend on an experiment's
checkpoint layout, on a LoRA adapter and its base, or carry optimizer state: each trained agent is loaded exactly as
the arm's eval stage seats it (a LoRA adapter merged into its base on load) and saved with its tokenizer.
"""
from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any, Callable

from m1.config import load_team
from m1.experiment.config import Experiment, ExperimentError
from m1.experiment.stages import STAGE_FILE, StageRun, eval_overrides, eval_team, read_stage
from m1.models.hf import HFChatModel

SOURCE_FILE = "SOURCE.md"


def _finished(exp: Experiment, arm: str, seed: int, stage: str) -> dict[str, Any]:
    folder = exp.stage_dir(arm, seed, stage)
    record = read_stage(folder)
    if record is None:
        raise ExperimentError(f"arm {arm} seed {seed}: stage {stage} has not finished ({folder / STAGE_FILE} is "
                              f"missing); run `m1 experiment run` first")
    return record


def seated_team(exp: Experiment, arm: str, seed: int):
    """(team config, its overrides) the arm's eval answers with: the eval stage's recorded overrides once it ran,
    else the seat its last training stage recorded (so a team can be exported before its eval is done)."""
    if exp.eval is None:
        raise ExperimentError(f"experiment {exp.name}: no eval stage, so no team seats the trained agents")
    run = StageRun(arm, seed, "eval", exp.stage_dir(arm, seed, "eval"))
    done = read_stage(run.folder) if "eval" in exp.arm_stages(arm) else None
    if done is not None:
        sets = list(done["overrides"])
    else:
        last = [s for s in exp.arm_stages(arm) if s != "eval"][-1]
        sets = eval_overrides(exp, run, _finished(exp, arm, seed, last)["seat"])
    return load_team(eval_team(exp, arm), sets), sets


def trained_agents(exp: Experiment, arm: str, seed: int, team) -> list[str]:
    """The agents the arm's training stages trained (each stage's `train_agents`, or every agent of the team), in
    the team's order."""
    stages = [s for s in exp.arm_stages(arm) if s != "eval"]
    if not stages:
        raise ExperimentError(f"arm {arm} runs no training stage (stages: {exp.arm_stages(arm)}): nothing to export")
    names: set[str] = set()
    for stage in stages:
        chosen = _finished(exp, arm, seed, stage).get("resolved", {}).get("train_agents")
        names |= set(chosen or [a.name for a in team.agents])
    return [a.name for a in team.agents if a.name in names]


def _replace_dir(tmp: Path, dest: Path) -> None:
    """Put the finished folder `tmp` at `dest`, whose old content goes whole: renames only, so `dest` holds either
    the old folder or the new one, never a mix of both."""
    if dest.exists():
        old = dest.with_name(f".{dest.name}.old")
        shutil.rmtree(old, ignore_errors=True)
        os.replace(dest, old)
        os.replace(tmp, dest)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(tmp, dest)


def export_agents(exp: Experiment, arm: str, seed: int, dest: str | Path,
                  progress: Callable[[str], None] = print) -> dict[str, Path]:
    """Write each trained agent of (arm, seed) to dest/<agent> as a full model folder (weights, config, tokenizer;
    no optimizer state) and a SOURCE.md naming where they came from. Returns {agent: folder}."""
    if arm not in exp.arms:
        raise ExperimentError(f"--arm {arm!r}: not an arm of experiment {exp.name} (arms: {list(exp.arms)})")
    if seed not in exp.seeds:
        raise ExperimentError(f"--seed {seed}: not a seed of experiment {exp.name} (seeds: {exp.seeds})")
    team, _ = seated_team(exp, arm, seed)
    agents = trained_agents(exp, arm, seed, team)
    dest = Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    written, sources = {}, []
    for agent in agents:
        key = next(a.model for a in team.agents if a.name == agent)
        spec = team.models[key]
        if spec.backend != "hf" or spec.interface != "chat":
            raise ExperimentError(f"arm {arm} seed {seed}: agent {agent}'s model {key!r} is {spec.interface}/"
                                  f"{spec.backend}; only hf chat models are exported")
        how = f"{spec.path}" + (f" + adapter {spec.adapter} (merged)" if spec.adapter else "")
        progress(f"export {agent}: {how} -> {dest / agent}")
        chat = HFChatModel(spec, key)
        tmp = dest / f".{agent}.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        chat.model.save_pretrained(tmp)
        chat.tokenizer.save_pretrained(tmp)
        del chat
        _replace_dir(tmp, dest / agent)
        written[agent] = dest / agent
        sources.append(f"- `{agent}`: {how}")
    text = (f"Written by `m1 experiment export {exp.name} --arm {arm} --seed {seed} {dest}`: the trained agents of "
            f"arm `{arm}`, seed {seed}, as its eval seats them (team `{eval_team(exp, arm)}`, experiment out_dir "
            f"`{exp.out_dir}`), LoRA adapters merged into their base, no optimizer state.\n\n"
            + "\n".join(sources) + "\n")
    tmp_source = dest / f".{SOURCE_FILE}.tmp"
    tmp_source.write_text(text)
    os.replace(tmp_source, dest / SOURCE_FILE)
    return written
