"""`m1 experiment run --plan`: what an experiment would run, each training stage's placement plan and model
preflight, and its GPU-hours where a step time was measured in this experiment's folders. Loads no weights."""
from __future__ import annotations

import math
from pathlib import Path

from m1.experiment.config import Experiment
from m1.experiment.stages import STAGE_FILE, StageRun, load_stage_config, stage_runs
from m1.marl.plan.planner import make_plan
from m1.marl.preflight import check_run
from m1.models.preflight import summary
from m1.plots import PlotError, read_metrics


def _measured_step_s(exp: Experiment, arm: str, stage: str) -> float | None:
    """Mean wall seconds per step measured by earlier runs of this arm's stage (any seed), else None."""
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


def _seated_models(exp: Experiment, arm: str, cfg) -> set[str]:
    """Model keys of a MARL stage that this arm's SFT stage replaces with its trained weights: their configured
    paths need not exist before the experiment runs, so the plan's preflight leaves them to the seating."""
    if "sft" not in exp.arm_stages(arm):
        return set()
    sft_cfg, _ = load_stage_config(exp, StageRun(arm, exp.seeds[0], "sft", exp.stage_dir(arm, exp.seeds[0], "sft")))
    trained = set(sft_cfg.train_agents or [a.name for a in sft_cfg.team_config().agents])
    return {a.model for a in cfg.team_config().agents if a.name in trained}


def plan_text(exp: Experiment, gpus: int | None, gpu_mem_gb: float | None) -> tuple[str, bool]:
    """(text, fits): the stages x arms x seeds, and per training stage and arm its placement plan, GPU count and,
    where a step time was measured in this experiment's folders, estimated GPU-hours, and the preflight of its models
    (a model that cannot be built makes `fits` false, as a plan that does not fit does). Loads no weights."""
    lines = _stage_lines(exp)
    fits = True
    total_hours: float | None = 0.0
    for stage in ("sft", "marl"):
        if getattr(exp, stage) is None:
            continue
        for arm in exp.arms:
            if stage not in exp.arm_stages(arm):
                continue
            if exp.owner(arm, stage) != arm:
                lines += ["", f"== {stage} / arm {arm}: the same as arm {exp.owner(arm, stage)}'s, run once =="]
                continue
            text, ok, hours = _training_plan(exp, stage, arm, gpus, gpu_mem_gb)
            lines += text
            fits = fits and ok
            total_hours = None if total_hours is None or hours is None else total_hours + hours
    if exp.eval is not None:
        lines += ["", f"== eval: team {exp.eval.team} on {exp.eval.source}: not planned (inference, "
                      f"{len(exp.arms) * len(exp.seeds)} runs) =="]
    if total_hours is not None and total_hours > 0:
        lines.append(f"total training: {total_hours:.1f} GPU-hours")
    elif exp.sft is not None or exp.marl is not None:
        lines.append("total training GPU-hours: not estimated")
    return "\n".join(lines), fits


def _stage_lines(exp: Experiment) -> list[str]:
    """The plan's head: every stage run with its folder and whether it is done here, recorded or still to run."""
    runs = stage_runs(exp)
    lines = [f"experiment {exp.name}: stages {' -> '.join(exp.stages)}; arms {list(exp.arms)}; seeds {exp.seeds}; "
             f"{len(runs)} stage runs in {exp.out_dir}"]
    if exp.data is not None:
        state = "done" if (Path(exp.out_dir) / "data" / STAGE_FILE).is_file() else "to run"
        lines.append(f"  {'data (worlds, SFT examples)':<32} {state:<7} {Path(exp.out_dir) / 'data'}")
    for run in runs:
        state = ("done" if (run.folder / STAGE_FILE).is_file() else "recorded"
                 if exp.record_path(run.arm, run.seed, run.stage).is_file() else "to run")
        lines.append(f"  {run.label:<32} {state:<8} {run.folder}")
    return lines


def _training_plan(exp: Experiment, stage: str, arm: str, gpus: int | None, gpu_mem_gb: float | None
                   ) -> tuple[list[str], bool, float | None]:
    """(lines, fits, GPU-hours) of one training stage of an arm that runs it: its placement plan, the preflight of
    its models and its time (`_time_estimate`; hours 0 on a CPU, None when not estimated)."""
    run = StageRun(arm, exp.seeds[0], stage, exp.stage_dir(arm, exp.seeds[0], stage))
    cfg, _ = load_stage_config(exp, run)  # planned on the config's own weights: seats change paths, not shapes
    plan = make_plan(cfg, gpus=gpus, gpu_mem_gb=gpu_mem_gb)
    extra = " + the arm's overrides" if getattr(exp.arm(arm), stage) else ""
    lines = ["", f"== {stage} / arm {arm} ({getattr(exp, stage).config}{extra}) =="]
    if stage == "marl" and "sft" in exp.arm_stages(arm):
        lines.append("(starts from this arm's SFT weights: same shapes as planned here)")
    lines.append(plan.render())
    checks = check_run(cfg)
    seated = _seated_models(exp, arm, cfg) if stage == "marl" else set()
    refused = [c for c in checks if c.status == "refused" and c.key not in seated]
    lines += summary([c for c in checks if c.key not in seated])
    if seated:
        lines.append(f"models this arm's SFT stage makes (checked when seated): {', '.join(sorted(seated))}")
    lines += [f"model refused: {c.line()}" for c in refused]
    line, hours = _time_estimate(exp, arm, stage, cfg, plan.gpus_needed)
    return lines + [line], plan.fits and not refused, hours


def _time_estimate(exp: Experiment, arm: str, stage: str, cfg, gpus_needed: int) -> tuple[str, float | None]:
    """The time line of a training stage over every seed and its GPU-hours: steps x the step time measured in this
    experiment's folders; 0 hours for a CPU run (wall time, not GPU time), None without a step count or time."""
    steps, step_s = _steps(cfg, stage), _measured_step_s(exp, arm, stage)
    n = len(exp.seeds)
    if steps is not None and step_s is not None:
        if gpus_needed:
            hours = gpus_needed * steps * step_s / 3600 * n
            return (f"time: {steps} steps x {step_s:.1f} s/step (measured here) x {gpus_needed} "
                    f"GPUs x {n} seeds = {hours:.1f} GPU-hours"), hours
        return (f"time: {steps} steps x {step_s:.1f} s/step (measured here) x {n} seeds = "
                f"{steps * step_s / 3600 * n:.2f} wall-hours on CPU, no GPU"), 0.0
    why = "no step time measured yet" if steps is not None else "step count unknown until the SFT examples exist"
    return (f"time: not estimated ({why}); {gpus_needed} GPUs per run x {n} seeds"
            + (f", {steps} steps each" if steps is not None else "")), None
