"""Run an experiment: every (arm, seed) goes through its stages in order, each an ordinary run in its own folder.

Folder of a stage: <out_dir>/<arm>/seed<k>/<stage>. A stage is finished when that folder holds `stage.json`, written
last and atomically (the config used, wall seconds, result paths, and for a training stage the overrides that seat
its trained agents). A rerun skips finished stages and lets an unfinished one resume the way its own command does
(training from its newest checkpoint, eval from the answers already in its results file).

Chaining: a stage's "seat" is the list of team overrides that puts the trained weights in place — the stage
config's own `team_overrides` (the weights it started from) plus `trained_agent_overrides` of its last checkpoint
(full weights replace the model's source, a LoRA adapter goes on top). MARL starts from the seat of its arm's SFT;
eval answers with the seat of the last training stage.
"""
from __future__ import annotations

import json
import math
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from m1.config import ConfigError
from m1.experiment.config import Experiment

STAGE_FILE = "stage.json"
RESULTS_FILE = "results.jsonl"


class ExperimentError(ValueError):
    pass


@dataclass(frozen=True)
class StageRun:
    arm: str
    seed: int
    stage: str
    folder: Path

    @property
    def label(self) -> str:
        return f"{self.arm} seed{self.seed} {self.stage}"


def stage_runs(exp: Experiment) -> list[StageRun]:
    """Arm by arm, seed by seed, stages in order: a killed experiment has finished whole arms first."""
    return [StageRun(arm, seed, stage, exp.stage_dir(arm, seed, stage))
            for arm in exp.arms for seed in exp.seeds for stage in exp.stages]


def read_stage(folder: Path) -> dict[str, Any] | None:
    """The record of a finished stage, or None while it is not finished."""
    path = Path(folder) / STAGE_FILE
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ExperimentError(f"{path}: not JSON ({exc}); delete it to rerun the stage") from None


def _write_stage(folder: Path, record: dict[str, Any]) -> Path:
    path = Path(folder) / STAGE_FILE
    tmp = path.with_name(f".{STAGE_FILE}.tmp")
    with open(tmp, "w") as f:
        f.write(json.dumps(record, indent=1))
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return path


# ------------------------------------------------------------------------------------------------ overrides
def train_overrides(exp: Experiment, run: StageRun, seat: list[str] | None = None,
                    base_team_overrides: list[str] | None = None) -> list[str]:
    """The stage's overrides, the arm's, then seed and out_dir; with a seat, `team_overrides` = the config's own
    followed by the seat (later overrides win, so the seated weights replace what the config starts from)."""
    spec = getattr(exp, run.stage)
    sets = list(spec.overrides) + list(getattr(exp.arm(run.arm), run.stage))
    sets += [f"seed={run.seed}", f"out_dir={run.folder}"]
    if seat:
        sets.append("team_overrides=" + json.dumps(list(base_team_overrides or []) + list(seat)))
    return sets


def eval_overrides(exp: Experiment, run: StageRun, seat: list[str]) -> list[str]:
    """Team overrides of an eval stage: the seat first, then the experiment's and the arm's (so an arm can still
    change anything), then the seed of sampling and of a random topology."""
    assert exp.eval is not None
    return (list(seat) + list(exp.eval.overrides) + list(exp.arm(run.arm).eval)
            + [f"sampling.seed={run.seed}", f"topology.seed={run.seed}"])


def load_stage_config(exp: Experiment, run: StageRun, seat: list[str] | None = None):
    """The SFT / MARL config a training stage runs with (checked before anything runs)."""
    from m1.marl.config import load_sft_config, load_train_config

    spec = getattr(exp, run.stage)
    loader = load_sft_config if run.stage == "sft" else load_train_config
    base = loader(spec.config, train_overrides(exp, run)) if seat else None
    sets = train_overrides(exp, run, seat, base.team_overrides if base is not None else None)
    return loader(spec.config, sets), sets


def _seat_of(cfg, folder: Path) -> tuple[list[str], str]:
    """(seat, checkpoint root) of a finished training stage: its team_overrides plus its trained agents."""
    from m1.marl.checkpoint import find_latest_checkpoint
    from m1.marl.launch import trained_agent_overrides

    root = find_latest_checkpoint(folder)
    average = getattr(cfg, "average", None)
    if average is not None and average.checkpoints:
        from m1.marl.average import AVERAGE_DIR

        root = folder / AVERAGE_DIR
    if root is None:
        raise ExperimentError(f"{folder}: the stage ended without a checkpoint; nothing to seat for the next stage")
    team = cfg.team_config()
    agents = list(cfg.train_agents or [a.name for a in team.agents])
    sets, notes = trained_agent_overrides(team, agents, root, cfg.learner.finetune)
    if notes:  # an agent left unseated would make the next stage silently use untrained weights
        raise ExperimentError(f"{folder}: cannot seat every trained agent: " + "; ".join(notes))
    return list(cfg.team_overrides) + sets, str(root)


MERGED_DIR = "merged"


def merge_adapters(cfg, seat: list[str], out: Path, progress: Callable[[str], None]) -> list[str]:
    """A model holds one adapter, so a LoRA stage followed by another training stage hands on whole models: each
    trained agent's base with its adapter merged in, written to out/<agent> (kept across reruns once complete).
    Returns the seat pointing at them (source replaced, adapter cleared)."""
    from m1.config import load_team
    from m1.models.hf import HFChatModel

    team = cfg.team_config()
    seated = load_team(cfg.team, seat) if isinstance(cfg.team, str) else None
    if seated is None:
        raise ExperimentError(f"{cfg.name}: an inline team cannot be seated for the next stage; name a team config")
    sets = list(seat)
    for agent in cfg.train_agents or [a.name for a in team.agents]:
        key = next(a.model for a in team.agents if a.name == agent)
        folder = out / agent
        if not (folder / "config.json").is_file():
            progress(f"  merging {agent}'s adapter into its base -> {folder}")
            chat = HFChatModel(seated.models[key], key)
            tmp = out / f".{agent}.tmp"
            chat.model.save_pretrained(tmp)
            chat.tokenizer.save_pretrained(tmp)
            os.replace(tmp, folder)
        sets += [f"models.{key}.tiny=null", f"models.{key}.path={folder}", f"models.{key}.adapter=null"]
    return sets


# ------------------------------------------------------------------------------------------------ stages
def _run_train(exp: Experiment, run: StageRun, seat: list[str], progress: Callable[[str], None]) -> dict:
    from m1.marl.launch import train_main
    from m1.marl.sft import sft_main

    cfg, sets = load_stage_config(exp, run, seat)
    spec = getattr(exp, run.stage)
    main = sft_main if run.stage == "sft" else train_main
    main(spec.config, sets, progress=lambda msg: progress(f"  {msg}"))
    new_seat, root = _seat_of(cfg, run.folder)
    later = [st for st in exp.stages[exp.stages.index(run.stage) + 1:] if st != "eval"]
    if later and cfg.learner.finetune == "lora":
        new_seat = merge_adapters(cfg, new_seat, run.folder / MERGED_DIR, progress)
    return {"config": spec.config, "overrides": sets, "resolved": cfg.model_dump(mode="json"),
            "results": {"metrics": str(run.folder / "metrics.jsonl"), "checkpoint": root,
                        "plots": str(run.folder / "plots")},
            "finetune": cfg.learner.finetune, "seat": new_seat}


def eval_questions(exp: Experiment):
    """The eval stage's questions (malformed lines are reported, not fatal, as in `m1 infer`)."""
    from m1.run import build_questions, read_questions

    assert exp.eval is not None
    e = exp.eval
    if e.video_dir:
        return build_questions(Path(e.video_dir), questions_file=Path(e.questions))
    return read_questions(Path(e.questions))


def _run_eval(exp: Experiment, run: StageRun, seat: list[str], progress: Callable[[str], None]) -> dict:
    from m1.config import load_team
    from m1.run import run_questions

    assert exp.eval is not None
    sets = eval_overrides(exp, run, seat)
    cfg = load_team(exp.eval.team, sets)
    qs, issues = eval_questions(exp)
    for msg in issues:
        progress(f"  skipped: {msg}")
    if not qs:
        raise ExperimentError(f"{exp.eval.questions}: no usable questions ({len(issues)} skipped)")
    run.folder.mkdir(parents=True, exist_ok=True)
    out = run.folder / RESULTS_FILE
    summary = run_questions(cfg, qs, out, progress=False)
    progress(f"  {summary.describe()}")
    return {"config": exp.eval.team, "overrides": sets, "resolved": cfg.model_dump(mode="json"),
            "results": {"results": str(out), "questions": exp.eval.questions},
            "answered": summary.answered + summary.skipped_done, "graded": summary.graded,
            "correct": summary.correct, "errors": summary.errors}


def check_configs(exp: Experiment) -> None:
    """Load every training stage's config (arm overrides included) and the eval team before anything runs, so a
    typo in the last arm does not surface hours in."""
    from m1.config import load_team

    for arm in exp.arms:
        run0 = StageRun(arm, exp.seeds[0], "", Path())
        for stage in ("sft", "marl"):
            if getattr(exp, stage) is not None:
                run = StageRun(arm, run0.seed, stage, exp.stage_dir(arm, run0.seed, stage))
                try:
                    load_stage_config(exp, run)
                except ConfigError as exc:
                    raise ConfigError(f"arm {arm!r}, stage {stage}: {exc}") from None
        if exp.eval is not None:
            run = StageRun(arm, run0.seed, "eval", exp.stage_dir(arm, run0.seed, "eval"))
            try:
                load_team(exp.eval.team, eval_overrides(exp, run, []))
            except ConfigError as exc:
                raise ConfigError(f"arm {arm!r}, stage eval: {exc}") from None


def run_experiment(exp: Experiment, progress: Callable[[str], None] = print) -> list[dict[str, Any]]:
    """Run every unfinished stage; returns the stage records in order. A finished stage (stage.json) is skipped;
    one finished with other overrides than the experiment now gives is refused rather than silently reused."""
    check_configs(exp)
    runs = stage_runs(exp)
    records: list[dict[str, Any]] = []
    seats: dict[tuple[str, int], list[str]] = {}
    for i, run in enumerate(runs, 1):
        tag = f"[{i}/{len(runs)}] {run.label}"
        seat = seats.get((run.arm, run.seed), [])
        done = read_stage(run.folder)
        if done is not None:
            if run.stage != "eval":
                expected = load_stage_config(exp, run, seat)[1]
            else:
                expected = eval_overrides(exp, run, seat)
            if done.get("overrides") != expected:
                raise ExperimentError(
                    f"{run.folder / STAGE_FILE}: finished with other overrides than the experiment now gives "
                    f"({done.get('overrides')} vs {expected}); delete that folder to rerun it, or use another out_dir")
            progress(f"{tag}: done before ({done['wall_s']:.1f}s), skipped -> {run.folder}")
        else:
            progress(f"{tag}: running -> {run.folder}")
            t0 = time.perf_counter()
            body = (_run_eval if run.stage == "eval" else _run_train)(exp, run, seat, progress)
            done = {"experiment": exp.name, "arm": run.arm, "seed": run.seed, "stage": run.stage,
                    "wall_s": time.perf_counter() - t0, **body}
            _write_stage(run.folder, done)
            progress(f"{tag}: finished in {done['wall_s']:.1f}s -> {run.folder}")
        if run.stage != "eval":
            seats[(run.arm, run.seed)] = done["seat"]
        records.append(done)
    return records


# ------------------------------------------------------------------------------------------------ --plan
def _measured_step_s(exp: Experiment, arm: str, stage: str) -> float | None:
    """Mean wall seconds per step measured by earlier runs of this arm's stage (any seed), else None."""
    from m1.plots import PlotError, read_metrics

    times = []
    for seed in exp.seeds:
        try:
            rows = read_metrics(exp.stage_dir(arm, seed, stage))
        except PlotError:
            continue
        for r in rows:
            t = r.get("time/step", r.get("time/total"))
            if isinstance(t, (int, float)) and math.isfinite(t):
                times.append(float(t))
    return sum(times) / len(times) if times else None


def _steps(cfg, stage: str) -> int | None:
    """Optimizer steps of one run: MARL `steps`; SFT `max_steps`, else epochs x batches of an existing examples
    file (None when the examples are still to be built)."""
    if stage == "marl":
        return cfg.steps
    if cfg.max_steps:
        return cfg.max_steps
    path = Path(cfg.data.examples) if cfg.data.examples else None
    if path is None or not path.is_file():
        return None
    with open(path) as f:
        n = sum(1 for line in f if line.strip())
    return math.ceil(n / cfg.batch_size) * cfg.epochs


def plan_text(exp: Experiment, gpus: int | None, gpu_mem_gb: float | None) -> tuple[str, bool]:
    """(text, fits): the stages x arms x seeds, and per training stage and arm its placement plan, GPU count and,
    where a step time was measured in this experiment's folders, estimated GPU-hours. Loads no model."""
    from m1.marl.cluster import make_plan

    runs = stage_runs(exp)
    lines = [f"experiment {exp.name}: stages {' -> '.join(exp.stages)}; arms {list(exp.arms)}; seeds {exp.seeds}; "
             f"{len(runs)} stage runs in {exp.out_dir}"]
    for run in runs:
        state = "done" if (run.folder / STAGE_FILE).is_file() else "to run"
        lines.append(f"  {run.label:<32} {state:<7} {run.folder}")
    fits = True
    total_hours: float | None = 0.0
    for stage in ("sft", "marl"):
        if getattr(exp, stage) is None:
            continue
        for arm in exp.arms:
            run = StageRun(arm, exp.seeds[0], stage, exp.stage_dir(arm, exp.seeds[0], stage))
            cfg, _ = load_stage_config(exp, run)  # planned on the config's own weights: seats change paths, not shapes
            plan = make_plan(cfg, gpus=gpus, gpu_mem_gb=gpu_mem_gb)
            fits = fits and plan.fits
            extra = " + the arm's overrides" if getattr(exp.arm(arm), stage) else ""
            lines += ["", f"== {stage} / arm {arm} ({getattr(exp, stage).config}{extra}) =="]
            if stage == "marl" and exp.sft is not None:
                lines.append("(starts from this arm's SFT weights: same shapes as planned here)")
            lines.append(plan.render())
            steps, step_s = _steps(cfg, stage), _measured_step_s(exp, arm, stage)
            n = len(exp.seeds)
            if steps is not None and step_s is not None:
                if plan.gpus_needed:
                    hours = plan.gpus_needed * steps * step_s / 3600 * n
                    total_hours = None if total_hours is None else total_hours + hours
                    lines.append(f"time: {steps} steps x {step_s:.1f} s/step (measured here) x {plan.gpus_needed} "
                                 f"GPUs x {n} seeds = {hours:.1f} GPU-hours")
                else:  # a CPU run: wall time, not GPU time
                    lines.append(f"time: {steps} steps x {step_s:.1f} s/step (measured here) x {n} seeds = "
                                 f"{steps * step_s / 3600 * n:.2f} wall-hours on CPU, no GPU")
            else:
                total_hours = None
                why = ("no step time measured yet" if steps is not None
                       else "step count unknown until the SFT examples exist")
                lines.append(f"time: not estimated ({why}); {plan.gpus_needed} GPUs per run x {n} seeds"
                             + (f", {steps} steps each" if steps is not None else ""))
    if exp.eval is not None:
        lines += ["", f"== eval: team {exp.eval.team} on {exp.eval.questions}: not planned (inference, "
                      f"{len(exp.arms) * len(exp.seeds)} runs) =="]
    if total_hours is not None and total_hours > 0:
        lines.append(f"total training: {total_hours:.1f} GPU-hours")
    elif exp.sft is not None or exp.marl is not None:
        lines.append("total training GPU-hours: not estimated")
    return "\n".join(lines), fits
