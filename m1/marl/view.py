"""The front page of a training run for `m1 view RUN_DIR`: its plots and an index of the steps whose episodes were
kept (`log.samples_every`, m1/marl/samples.py), each linking to that step's trace pages.

The page is written to <run_dir>/index.html (whole, so a browser never reads half of it) and the plots are drawn
again when metrics.jsonl is newer than them, so a run still going on shows its latest steps.
"""
from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any

from m1.files import write_whole
from m1.marl.samples import SAMPLES_DIR, SAMPLES_FILE
from m1.plots import PLOTS_DIR, PlotError, plot_run, read_metrics
from m1.trace import _CSS, INDEX_NAME, _e

METRICS = "metrics.jsonl"
SHOWN = ("loss", "reward/mean", "reward/team_res", "reward/res")  # the step metrics the index shows when logged


def is_training_run(run_dir: str | Path) -> bool:
    """An `m1 train` / `m1 sft` out_dir: it has a metrics file or kept samples."""
    run_dir = Path(run_dir)
    return (run_dir / METRICS).is_file() or (run_dir / SAMPLES_DIR).is_dir()


def _stale(plots: Path, metrics: Path) -> bool:
    pngs = list(plots.glob("*.png")) if plots.is_dir() else []
    return metrics.is_file() and (not pngs or min(p.stat().st_mtime_ns for p in pngs) < metrics.stat().st_mtime_ns)


def step_summary(folder: Path) -> dict[str, Any]:
    """A kept step's counts and means, read from its samples.jsonl (a torn line, from a killed run, is skipped)."""
    rows = []
    path = folder / SAMPLES_FILE
    for line in (path.read_text().splitlines() if path.is_file() else []):
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            continue

    def mean(xs):
        xs = [x for x in xs if x is not None and not math.isnan(x)]
        return sum(xs) / len(xs) if xs else None

    return {"episodes": len({r["episode"] for r in rows}), "generations": len(rows),
            "trained": sum(bool(r.get("trained")) for r in rows), "reward": mean([r.get("reward") for r in rows]),
            "adv_abs": mean([abs(r["advantage"]) for r in rows if r.get("advantage") is not None]),
            "agents": sorted({r["agent"] for r in rows})}


def _fmt(x) -> str:
    return "–" if x is None or (isinstance(x, float) and not math.isfinite(x)) else (
        f"{x:.4g}" if isinstance(x, float) else str(x))


def render_run_index(run_dir: str | Path) -> str:
    """The page: the run's name and progress, its PNG plots, and one row per kept step linking its trace pages."""
    run_dir = Path(run_dir)
    try:
        metrics = {r.get("step"): r for r in read_metrics(run_dir)}
    except PlotError:
        metrics = {}
    steps = sorted((p for p in (run_dir / SAMPLES_DIR).glob("step-*") if p.is_dir()), key=lambda p: p.name)
    shown = [k for k in SHOWN if any(k in r for r in metrics.values())]
    rows = []
    for folder in steps:
        n = int(folder.name.split("-")[1])
        s = step_summary(folder)
        m = metrics.get(n, {})
        rows.append(f"<tr class='step' data-step='{n}'><td><a href='{SAMPLES_DIR}/{folder.name}/{INDEX_NAME}'>"
                    f"step {n}</a></td><td>{s['episodes']}</td><td>{s['generations']} ({s['trained']} trained)</td>"
                    f"<td>{_fmt(s['reward'])}</td><td>{_fmt(s['adv_abs'])}</td>"
                    + "".join(f"<td>{_fmt(m.get(k))}</td>" for k in shown) + "</tr>")
    plots = sorted((run_dir / PLOTS_DIR).glob("*.png")) if (run_dir / PLOTS_DIR).is_dir() else []
    figs = "".join(f"<figure><a href='{PLOTS_DIR}/{_e(p.name)}'><img src='{PLOTS_DIR}/{_e(p.name)}' "
                   f"alt='{_e(p.stem)}' width='560'></a><figcaption>{_e(p.stem)}</figcaption></figure>"
                   for p in plots)
    last = max(metrics) if metrics else 0
    head = "".join(f"<th>{_e(k)}</th>" for k in shown)
    return (f"<!doctype html><html lang='en'><head><meta charset='utf-8'><title>{_e(run_dir.resolve().name)} · "
            f"M1 training</title><meta name='viewport' content='width=device-width'><style>{_CSS}"
            ".plots{display:flex;flex-wrap:wrap;gap:8px}.plots figure{margin:0;font-size:12px;color:#555}"
            ".plots img{border:1px solid #ddd}</style></head><body>"
            f"<h1>M1 training · {_e(run_dir.resolve().name)}</h1>"
            f"<p class='muted'>{last} steps logged · {len(steps)} steps with their episodes kept · written "
            f"{time.strftime('%Y-%m-%d %H:%M:%S')}</p>"
            "<h2>Steps with their episodes</h2>"
            + ("<table class='steps'><tr><th>step</th><th>episodes</th><th>generations</th><th>mean reward</th>"
               f"<th>mean |advantage|</th>{head}</tr>" + "".join(rows) + "</table>" if rows else
               "<p class='muted no-samples'>No episodes kept: set <code>log.samples_every: N</code> to keep every "
               "N-th step's episodes.</p>")
            + "<h2>Plots</h2>"
            + (f"<div class='plots'>{figs}</div>" if figs else "<p class='muted'>No plots yet (no step logged).</p>")
            + "</body></html>")


def build_run_index(run_dir: str | Path) -> Path:
    """Draw the plots again when metrics are newer, then write <run_dir>/index.html; returns its path."""
    run_dir = Path(run_dir)
    if _stale(run_dir / PLOTS_DIR, run_dir / METRICS):
        try:
            plot_run(run_dir)
        except PlotError:
            pass  # no step logged yet: the page says so
    path = run_dir / INDEX_NAME
    write_whole(path, render_run_index(run_dir).encode())
    return path
