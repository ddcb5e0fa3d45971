"""`m1 experiment report`'s files: report.md and report.csv from the numbers `stats.report_stats` computes, plans.csv
and behaviour.csv where the eval rows carry plans or seed-kind behaviour, and the training curves per arm.
"""
from __future__ import annotations

import csv
import io
import math
from pathlib import Path
from typing import Any

from m1.experiment.config import Experiment, ExperimentError
from m1.experiment.rows import plan_name
from m1.experiment.stats import ALL, BEHAVIOUR, ReportStats, report_stats
from m1.files import write_whole
from m1.plots import PlotError, read_metrics


def _pct(x: float | None, digits: int = 1) -> str:
    return "n/a" if x is None or math.isnan(x) else f"{100 * x:.{digits}f}"


def _signed(x: float) -> str:
    return "n/a" if math.isnan(x) else f"{100 * x:+.1f}"


def render_markdown(exp: Experiment, stats: ReportStats) -> str:
    """report.md: each table of `stats` formatted, in %, the sections without numbers left out."""
    base, families = exp.base_arm, stats.families
    by = {(r["arm"], r["family"]): r for r in stats.rows}
    lines = [f"# Experiment {exp.name}", "",
             f"Seeds {exp.seeds}; eval questions {exp.eval.source if exp.eval else '-'}. Accuracy in %, mean ± sd "
             f"over seeds (sd n/a with one seed). Paired difference: arm minus {base}, seed by seed; SE = sd/√n of "
             f"those; 95% interval mean ± t(0.975, n−1)·SE (n/a with one seed).", "",
             "## Accuracy", "", "| arm | " + " | ".join(families) + " |", "|---" * (len(families) + 1) + "|"]
    for arm in exp.arms:
        cells = ["n/a" if not r["seeds"] else f"{_pct(r['mean'])} ± {_pct(r['sd'])}"
                 for r in (by[(arm, fam)] for fam in families)]
        lines.append(f"| {arm} | " + " | ".join(cells) + " |")
    if len(exp.arms) > 1:
        lines += _paired_section(exp, by, families)
    if stats.changes:
        lines += _changes_section(base, stats.changes)
    if stats.plans and stats.plans["best"]:
        lines += _plans_section(exp, stats.plans, families)
    if stats.formats:
        lines += _formats_section(stats.formats)
    if stats.behaviour:
        lines += _behaviour_section(stats.behaviour)
    lines += ["", "## Per seed", "", "| arm | seed | " + " | ".join(families) + " |",
              "|---" * (len(families) + 2) + "|"]
    for arm in exp.arms:
        for s in by[(arm, families[0])]["seeds"]:
            cells = [_pct(r["accuracy"][r["seeds"].index(s)]) if s in r["seeds"] else "n/a"
                     for r in (by[(arm, fam)] for fam in families)]
            lines.append(f"| {arm} | {s} | " + " | ".join(cells) + " |")
    if stats.notes:
        lines += ["", "## Notes", ""] + [f"- {n}" for n in stats.notes]
    return "\n".join(lines) + "\n"


def _paired_section(exp: Experiment, by: dict[tuple[str, str], dict[str, Any]], families: list[str]) -> list[str]:
    """Each arm's paired difference to the baseline, per family: per seed, mean ± SE, 95% interval."""
    lines = ["", f"## Paired difference to {exp.base_arm} (points)", "",
             "| arm | family | per seed | mean ± SE | 95% interval |", "|---|---|---|---|---|"]
    for arm in (a for a in exp.arms if a != exp.base_arm):
        for fam in families:
            r = by[(arm, fam)]
            per = ", ".join(f"seed{s}: {_signed(d)}" for s, d in zip(r["diff_seeds"], r["diff"])) or "n/a"
            ci = ("n/a" if math.isnan(r["diff_low"]) else f"[{_signed(r['diff_low'])}, {_signed(r['diff_high'])}]")
            mean = _signed(r["diff_mean"]) + ("" if math.isnan(r["diff_se"]) else f" ± {100 * r['diff_se']:.1f}")
            lines.append(f"| {arm} | {fam} | {per} | {mean} | {ci} |")
    return lines


def _changes_section(base: str, changes: list[dict[str, Any]]) -> list[str]:
    """Per arm and seed, the answers it changed, fixed and broke against the baseline, with the sign test's p."""
    lines = ["", f"## Answers changed against {base}, per seed", "",
             f"On the questions both graded: answers that differ; fixed = wrong for {base}, right for the arm; "
             "broken = the reverse; p = exact two-sided sign test on fixed vs broken.", "",
             "| arm | seed | questions | changed | fixed | broken | sign test p |", "|---" * 7 + "|"]
    for c in changes:
        lines.append(f"| {c['arm']} | {c['seed']} | {c['n']} | {c['changed']} | {c['fixed']} | {c['broken']} | "
                     f"{c['p']:.3g} |")
    return lines


def _plans_section(exp: Experiment, plans: dict[str, Any], families: list[str]) -> list[str]:
    """Per family its best plan and, per arm, how often it chose it, what its choices are worth, its favourite."""
    fams = [ALL] + [f for f in families if f in plans["best"]]
    arms = [a for a in exp.arms if a in plans["arms"]]
    lines = ["", "## Plans chosen (every agent's first plan, all seeds)", "",
             "Best plan of a family: the plan whose agents answered right most often, over every arm (≥ 20 "
             "uses; success rates pooled over the student arms, not the reference teams). Cells: % of the "
             "arm's plans that are that best plan; the mean success rate of the plans it wrote in the strict "
             "format (what its plan choice alone is worth); its most chosen plan and that plan's %. GS Global "
             "Sampling, VR Video Retrieval, TSR Time Stamp Retrieval, IR Image Retrieval, "
             "RB Rough / FB Fine Browser, ST Space Tool, GT Grounding Tool.", "",
             "| family | best plan (its agents right, uses) | " + " | ".join(arms) + " |",
             "|---" * (len(arms) + 2) + "|"]
    for fam in fams:
        plan, acc, n = plans["best"].get(fam, ((), float("nan"), 0))
        cells = []
        for arm in arms:
            c = plans["arms"][arm].get(fam)
            cells.append("n/a" if c is None else
                         f"{_pct(c['best_share'], 0)}; {_pct(c['value'])}; "
                         f"{plan_name(c['top'])} {100 * c['top_share']:.0f}")
        head = "each family's own" if fam == ALL else f"{plan_name(plan)} ({_pct(acc)}%, {n})"
        lines.append(f"| {fam} | {head} | " + " | ".join(cells) + " |")
    lines.append("| plans in the strict format | | " + " | ".join(
        f"{100 * plans['strict'][a]:.0f}%" for a in arms) + " |")
    return lines


def _formats_section(formats: dict[str, dict[str, float]]) -> list[str]:
    """Per traced arm and phase, the % of replies in the strict format."""
    phases = [p for p in ("plan", "communicate", "answer", "summary") if any(p in f for f in formats.values())]
    lines = ["", "## Replies in the strict format (% of generations, all seeds; from the eval traces)", "",
             "| arm | " + " | ".join(phases) + " |", "|---" * (len(phases) + 1) + "|"]
    for arm, f in formats.items():
        lines.append(f"| {arm} | " + " | ".join(f"{100 * f[p]:.0f}" if p in f else "n/a" for p in phases) + " |")
    return lines


def _behaviour_section(behaviour: list[dict[str, Any]]) -> list[str]:
    """The seed-kind teams' frames, tool calls and zooms per seed (all families), zoom columns where any zoomed."""
    zoom = any(r["zoom_s"] is not None for r in behaviour)
    lines = ["", "## Behaviour of the seed-kind teams (all families)", "",
             "Per graded question: frames the team saw (policy and tools), tool calls, % answered without a "
             "tool call" + ("; over every executed zoom: its segment length (s) and fps" if zoom else "") +
             ". Mean: over the seeds; n/a: not recorded (rows written before these fields).", "",
             "| arm | seed | questions | frames | tool calls | no tool call % |"
             + (" zoom s | zoom fps |" if zoom else ""), "|---" * (8 if zoom else 6) + "|"]

    def num(x: float | None, fmt: str) -> str:
        return "n/a" if x is None else format(x, fmt)

    for r in (r for r in behaviour if r["family"] == ALL):
        lines.append(f"| {r['arm']} | {r['seed']} | {r['questions']} | {num(r['frames'], '.1f')} | "
                     f"{num(r['calls'], '.2f')} | {_pct(r['no_tool'])} |"
                     + (f" {num(r['zoom_s'], '.1f')} | {num(r['zoom_fps'], '.2f')} |" if zoom else ""))
    return lines


def _write_csv(path: Path, header: list[str], rows: list[list[Any]]) -> Path:
    """One CSV written whole (m1.files.write_whole): a reader never sees half a report."""
    buf = io.StringIO(newline="")
    w = csv.writer(buf)
    w.writerow(header)
    w.writerows(rows)
    write_whole(path, buf.getvalue().encode())
    return path


def write_csv(path: Path, rows: list[dict[str, Any]]) -> Path:
    """Fractions, unrounded: arm, family, seeds and accuracies (';'-joined), mean, sd, and the paired difference."""
    cols = ["arm", "family", "n_seeds", "seeds", "accuracy", "graded", "mean", "sd", "diff", "diff_mean",
            "diff_low", "diff_high"]
    return _write_csv(path, cols, [
        [r["arm"], r["family"], len(r["seeds"]), ";".join(map(str, r["seeds"])),
         ";".join(repr(a) for a in r["accuracy"]), r["graded"], repr(r["mean"]), repr(r["sd"]),
         ";".join(repr(d) for d in r.get("diff", []))]
        + [repr(r[k]) if k in r else "" for k in ("diff_mean", "diff_low", "diff_high")] for r in rows])


def write_plans_csv(path: Path, plans: dict[str, Any]) -> Path:
    """Every plan each arm chose, per family: its share of the arm's plans, and its success rate (and uses) over the
    pooled student arms: the whole distribution behind the report's compact plan table."""
    out = []
    for arm, fams in plans["arms"].items():
        for fam, c in fams.items():
            for plan, share in c["shares"].items():
                rate, n = plans["rates"].get(fam, {}).get(plan, (float("nan"), 0))
                out.append([arm, fam, plan_name(plan), repr(share), c["n"], repr(rate), n])
    return _write_csv(path, ["arm", "family", "plan", "share", "plans", "success_rate", "success_uses"], out)


def write_behaviour_csv(path: Path, table: list[dict[str, Any]]) -> Path:
    """`behaviour_table` unrounded, one row per arm x family x seed (and "mean"); a value not measured is empty."""
    return _write_csv(path, ["arm", "family", "seed", "questions", *BEHAVIOUR],
                      [[r["arm"], r["family"], r["seed"], r["questions"]]
                       + ["" if r[k] is None else repr(r[k]) for k in BEHAVIOUR] for r in table])


# Panels drawn per training stage: (stage, [(metric, label), ...] the first one present, moving-average window).
# The greedy team's result (the mean team reward of greedy runs on each step's questions, what evaluation measures;
# logged with `grpo.baseline: greedy`) is noisy over a few questions a step, hence the 10-step mean.
PANELS = [("sft", [("loss", "SFT loss")], 1),
          ("marl", [("reward/mean", "MARL mean reward"), ("loss", "MARL loss")], 1),
          ("marl", [("greedy/team_res", "greedy team result, 10-step mean")], 10)]


def moving_mean(points: list[tuple[float, float]], window: int) -> list[tuple[float, float]]:
    """Trailing mean over the last `window` points (fewer at the start)."""
    out = []
    for i, (x, _) in enumerate(points):
        ys = [y for _, y in points[max(0, i + 1 - window):i + 1]]
        out.append((x, sum(ys) / len(ys)))
    return out


def plot_arms(exp: Experiment, out: Path) -> list[Path]:
    """One PNG per arm that trained: a panel per training stage metric it logged (PANELS), a line per seed."""
    metrics: dict[tuple[str, int, str], list[dict]] = {}
    for arm in exp.arms:
        for seed in exp.seeds:
            for stage in {s for s, _, _ in PANELS if getattr(exp, s) is not None}:
                if exp.stage_seed(arm, seed, stage) != seed:  # another seed's run (sft_share): drawn once
                    continue
                try:
                    metrics[(arm, seed, stage)] = read_metrics(exp.stage_dir(arm, seed, stage))
                except PlotError:
                    continue

    def logged(arm: str, stage: str, keys: list[tuple[str, str]]) -> bool:
        return any(k in r for seed in exp.seeds for r in metrics.get((arm, seed, stage), []) for k, _ in keys)

    if not any(logged(arm, stage, keys) for arm in exp.arms for stage, keys, _ in PANELS):
        return []
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out.mkdir(parents=True, exist_ok=True)
    written = []
    for arm in exp.arms:
        panels = [(stage, keys, window) for stage, keys, window in PANELS if logged(arm, stage, keys)]
        if not panels:
            continue
        fig, axes = plt.subplots(1, len(panels), figsize=(6 * len(panels), 4), dpi=100, squeeze=False)
        drawn = False
        for ax, (stage, keys, window) in zip(axes[0], panels):
            label = keys[0][1]
            for seed in exp.seeds:
                rows = metrics.get((arm, seed, stage))
                if not rows:
                    continue
                key, label = next(((k, lab) for k, lab in keys if any(k in r for r in rows)), keys[0])
                pts = [(r["step"], r[key]) for r in rows
                       if isinstance(r.get(key), (int, float)) and not math.isnan(r[key])]
                if pts:
                    pts = moving_mean(pts, window) if window > 1 else pts
                    ax.plot(*zip(*pts), marker="o" if len(pts) < 30 else None, markersize=3, label=f"seed {seed}")
                    drawn = True
            ax.set_title(f"{arm}: {label}")
            ax.set_xlabel("step")
            ax.grid(alpha=0.3)
            if ax.lines:
                ax.legend(fontsize=8)
        fig.tight_layout()
        if drawn:
            path = out / f"{arm}.png"
            fig.savefig(path)
            written.append(path)
        plt.close(fig)
    return written


def write_report(exp: Experiment) -> dict[str, Any]:
    """Write report.md, report.csv, plans.csv (when the results rows carry plans), behaviour.csv (when they carry
    frames and tool calls: seed-kind teams) and plots/<arm>.png (from the training stages' metrics, where their run
    folders are here) into the experiment's out_dir; returns paths and rows."""
    out = Path(exp.out_dir)
    stats = report_stats(exp)
    if stats.empty:
        raise ExperimentError(f"{out}: no finished eval stage yet (run `m1 experiment run` first)")
    out.mkdir(parents=True, exist_ok=True)
    md = render_markdown(exp, stats)
    (out / "report.md").write_text(md)
    csv_path = write_csv(out / "report.csv", stats.rows)
    if stats.plans:
        write_plans_csv(out / "plans.csv", stats.plans)
    if stats.behaviour:
        write_behaviour_csv(out / "behaviour.csv", stats.behaviour)
    plots = plot_arms(exp, out / "plots")
    return {"markdown": out / "report.md", "csv": csv_path, "plots": plots, "rows": stats.rows, "text": md,
            "notes": stats.notes, "changes": stats.changes, "formats": stats.formats, "plans": stats.plans,
            "behaviour": stats.behaviour}
