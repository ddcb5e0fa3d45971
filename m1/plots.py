"""Training curves as PNG files: `m1 plot RUN_DIR`, and what `m1 train` / `m1 sft` write when they end.

A run's `metrics.jsonl` holds one line per step (m1/marl/rollout/stream.py). Each figure below is drawn only from the
keys a run logged, so MARL and SFT runs (and runs with optional metrics off) get the figures that mean something for
them: the reward parts, the team's result on the training questions, KL and the truncated-importance-sampling
ratio per agent, the loss, and per-agent rewards and losses.
"""
from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

PLOTS_DIR = "plots"


class PlotError(ValueError):
    pass


def read_metrics(run_dir: str | Path) -> list[dict[str, Any]]:
    """The rows of `<run_dir>/metrics.jsonl` in step order; a torn last line (a killed run) is skipped."""
    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        raise PlotError(f"{path}: no metrics file (is {run_dir} the out_dir of an `m1 train` or `m1 sft` run?)")
    rows = []
    for line in path.read_text().splitlines():
        if not line.strip():
            continue
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            continue  # the line a killed run was writing; the steps before it are whole
    if not rows:
        raise PlotError(f"{path}: no steps logged yet")
    return sorted(rows, key=lambda r: r.get("step", 0))


def _series(rows: list[dict[str, Any]], key: str, window: int = 1) -> tuple[list[float], list[float]]:
    """(steps, values) of `key` where it is finite; with `window` > 1 each value is the mean of the last `window`
    values logged (a family's decisions are logged only on the steps that drew its questions)."""
    xs, ys = [], []
    for r in rows:
        v = r.get(key)
        if isinstance(v, (int, float)) and math.isfinite(v):
            xs.append(r.get("step", len(xs) + 1))
            ys.append(float(v))
    if window > 1:
        ys = [sum(ys[max(0, i + 1 - window):i + 1]) / (i + 1 - max(0, i + 1 - window)) for i in range(len(ys))]
    return xs, ys


def _agents(rows: list[dict[str, Any]]) -> list[str]:
    """Agents that logged a loss or samples (keys `<agent>/loss`, `<agent>/samples`)."""
    names = {k.split("/", 1)[0] for r in rows for k in r if k.endswith(("/loss", "/samples"))
             and not k.startswith(("reward/", "greedy/", "time/", "topology/", "answer_groups/"))}
    return sorted(names)


def figures(rows: list[dict[str, Any]]) -> dict[str, list[tuple[str, str]]]:
    """{file stem: [(metric key, label)]} for every figure this run's metrics can draw."""
    have = {k for r in rows for k in r}
    agents = _agents(rows)
    specs: dict[str, list[tuple[str, str]]] = {
        "rewards": [(k, lbl) for k, lbl in (("reward/total", "total"), ("reward/res", "result R_res"),
                                            ("reward/format", "format R_format (share parsed)"),
                                            ("reward/col", "collaboration R_col"), ("reward/mean", "mean"))
                    if k in have],
        "team_result": [(k, lbl) for k, lbl in (("reward/team_res", "team answer, sampled (+1 right, -1 wrong)"),
                                                ("greedy/team_res", "team answer, greedy"))
                        if k in have],
        "loss": [("loss", "mean over agents")] + [(f"{a}/loss", a) for a in agents if f"{a}/loss" in have],
        "kl": [(f"{a}/kl", a) for a in agents if f"{a}/kl" in have],
        "importance_ratio": [(f"{a}/is/ratio_mean", a) for a in agents if f"{a}/is/ratio_mean" in have],
        "agent_rewards": [(f"{a}/reward", a) for a in agents if f"{a}/reward" in have],
        "sft_nll": [(f"{a}/nll", a) for a in agents if f"{a}/nll" in have],
        # asynchronous rollouts (rollout.max_staleness): how old the sampling weights were, and who waited
        "staleness": [("async/staleness", "versions behind the learners")],
        "throughput": [(k, lbl) for k, lbl in (("throughput/episodes_per_s", "episodes per second"),
                                              ("throughput/tokens_per_s", "sampled tokens per second"))],
        "wait_times": [(k, lbl) for k, lbl in (("time/wall", "step (wall)"), ("time/rollout", "rollouts"),
                                              ("time/update", "update"),
                                              ("time/wait_rollout", "learners waiting for rollouts"),
                                              ("time/wait_weights", "producer waiting for weights"))],
        # the CPP team's decisions per question family (m1/marl/team_training.py): do plans and revisions move?
        "plan_entropy": [(k, k.rsplit("/", 1)[1]) for k in sorted(have) if k.startswith("plans/entropy/")],
        "revisions": [(k, k.rsplit("/", 1)[1]) for k in sorted(have) if k.startswith("revisions/rate/")],
    }
    drawn = {name: [(k, lbl) for k, lbl in lines if _series(rows, k)[0]] for name, lines in specs.items()}
    return {name: lines for name, lines in drawn.items() if lines}


TITLES = {"rewards": "Reward parts (mean over agents and episodes)",
          "team_result": "Team result on the training questions", "loss": "Loss", "kl": "KL to the reference",
          "importance_ratio": "Engine -> trainer importance ratio (mean)", "agent_rewards": "Reward per agent",
          "sft_nll": "SFT negative log-likelihood per token", "staleness": "Staleness of the sampled weights",
          "throughput": "Throughput", "wait_times": "Seconds per step",
          "plan_entropy": "First-plan entropy (nats) per family",
          "revisions": "Decisions that add a tool (share) per family"}
# figures drawn as a running mean over the last N values logged, and N
SMOOTHED = {"plan_entropy": 10, "revisions": 10}


def plot_run(run_dir: str | Path, out_dir: str | Path | None = None) -> list[Path]:
    """Write one PNG per figure into `out_dir` (default `<run_dir>/plots`); returns their paths."""
    import matplotlib

    matplotlib.use("Agg")  # files only: no display on training nodes
    import matplotlib.pyplot as plt

    rows = read_metrics(run_dir)
    out = Path(out_dir) if out_dir is not None else Path(run_dir) / PLOTS_DIR
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for name, lines in figures(rows).items():
        fig, ax = plt.subplots(figsize=(7, 4), dpi=100)
        window = SMOOTHED.get(name, 1)
        for key, label in lines:
            xs, ys = _series(rows, key, window)
            if xs:
                ax.plot(xs, ys, marker="o" if len(xs) < 30 else None, markersize=3, label=label)
        ax.set_title(TITLES[name] + (f", mean of the last {window}" if window > 1 else ""))
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        fig.tight_layout()
        path = out / f"{name}.png"
        fig.savefig(path)
        plt.close(fig)
        written.append(path)
    return written


def plot_finished_run(run_dir: str | Path, progress) -> list[Path]:
    """What `m1 train` / `m1 sft` do when they end: write the run's plots and say where (nothing to draw when the
    run logged no step yet)."""
    try:
        paths = plot_run(run_dir)
    except PlotError as exc:
        progress(f"no plots: {exc}")
        return []
    if paths:
        progress(f"plots: {Path(run_dir) / PLOTS_DIR} ({', '.join(p.stem for p in paths)})")
    return paths
