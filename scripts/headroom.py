"""Headroom on M1-Synth: accuracy and frames per question family for
(a) the fixed plan Global Sampling -> Rough Browser, (b) the teacher team, (c) the oracle best
plan per question (right if any of the 16 select x browse plans is right; frames of the
cheapest right plan).

Plans (a) and (c) run the tools directly with the synth vision model: the plan's answer is the
browser's answer line (the span for grounding). (b) runs the whole CPP team through the engine.

    python scripts/headroom.py --videos 12 --seed 101 --out runs/headroom
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections import defaultdict
from itertools import product
from pathlib import Path

from tqdm import tqdm

os.environ.setdefault("HF_HUB_OFFLINE", "1")
REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from m1.text import format_time, parse_timestamp  # noqa: E402
from m1.config import load_team  # noqa: E402
from m1.data.metrics import is_correct  # noqa: E402
from m1.models.base import SamplingParams  # noqa: E402
from m1.models.hub import ModelHub  # noqa: E402
from m1.data.questions import read_questions  # noqa: E402
from m1.run import run_questions  # noqa: E402
from m1.synth.make import make_dataset  # noqa: E402
from m1.tools import BROWSE_TOOLS, SELECT_TOOLS, browse  # noqa: E402
from m1.tools.base import ToolContext, ToolError  # noqa: E402
from m1.tools.clip_index import ClipIndex  # noqa: E402
from m1.tools.select import SELECT  # noqa: E402
from m1.video import VideoPool  # noqa: E402

FIXED = ("Global Sampling", "Rough Browser")


def run_plan(q, plan, pool, cfg, clip, vision, key_info):
    """One select + one browse tool, as an agent would run them; returns (answer, frames)."""
    sel, brw = plan
    video = pool.open(q.video)
    ctx = ToolContext(question=q, video=video, key_info=key_info, cfg=cfg.tools, clip=clip)
    try:
        focus = SELECT[sel](ctx).focus
    except ToolError:
        focus = SELECT["Global Sampling"](ctx).focus  # as the engine does when a browser has no focus
    req, idx = browse.prepare(brw, ctx, focus)
    reply = vision.describe([req], SamplingParams(max_new_tokens=browse.max_tokens(brw, ctx)))[0]
    res = browse.finish(brw, ctx, focus, reply, idx)
    return res.answer, len(idx)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--videos", type=int, default=12)
    ap.add_argument("--seed", type=int, default=101)
    ap.add_argument("--duration", type=float, default=300.0)
    ap.add_argument("--questions-per-video", type=int, default=8)
    ap.add_argument("--team", default="synth_teacher")
    ap.add_argument("--out", type=Path, default=REPO / "runs" / "headroom")
    args = ap.parse_args()
    t_start = time.perf_counter()
    data = args.out / "data"
    if not (data / "questions.jsonl").exists():
        make_dataset(data, args.videos, args.seed, duration=args.duration,
                     questions_per_video=args.questions_per_video)
    qs, issues = read_questions(data / "questions.jsonl", data)
    assert not issues, issues
    cfg = load_team(args.team)
    hub = ModelHub(cfg.models)
    vision, clip = hub.vision(cfg.tools.browser), ClipIndex(hub.clip(cfg.tools.clip))
    pool = VideoPool()

    rows = defaultdict(lambda: {"fixed": [0, 0], "oracle": [0, 0], "team": [0, 0], "n": 0})
    plans = list(product(SELECT_TOOLS, BROWSE_TOOLS))
    plan_right = defaultdict(lambda: defaultdict(int))  # family -> plan -> questions it got right
    for q in tqdm(qs, desc="plans", unit="q"):
        fam = q.meta.get("family", q.task)
        key = q.meta.get("key_info") or q.text  # the key info a good planner would state
        if "time" in q.meta and not parse_timestamp(key):  # the oracle may know when to look
            key += f" at {format_time(q.meta['time'])}"
        r = rows[fam]
        r["n"] += 1
        ans, frames = run_plan(q, FIXED, pool, cfg, clip, vision, key)
        r["fixed"][0] += is_correct(q, ans)
        r["fixed"][1] += frames
        right = []
        for plan in plans:
            a, f = (ans, frames) if plan == FIXED else run_plan(q, plan, pool, cfg, clip, vision, key)
            if is_correct(q, a):
                right.append((f, plan))
                plan_right[fam][" → ".join(plan)] += 1
        if right:
            f, plan = min(right)
            r["oracle"][0] += 1
            r["oracle"][1] += f
        else:
            r["oracle"][1] += frames

    team_out = args.out / "team.jsonl"
    team_out.unlink(missing_ok=True)
    run_questions(cfg, qs, team_out, progress=True)
    for line in team_out.read_text().splitlines():
        row = json.loads(line)
        q = next(x for x in qs if x.id == row["id"])
        r = rows[q.meta.get("family", q.task)]
        r["team"][0] += bool(row.get("correct"))
        r["team"][1] += row["frames_used"]

    lines = ["| family | n | (a) fixed GS→RB acc | frames | (b) teacher team acc | frames | (c) oracle plan acc | frames | best single plan for the family (acc) |",
             "|---|---|---|---|---|---|---|---|---|"]
    tot = {"fixed": [0, 0], "team": [0, 0], "oracle": [0, 0], "n": 0}
    for fam in sorted(rows):
        r = rows[fam]
        n = r["n"]
        tot["n"] += n
        cells = []
        for k in ("fixed", "team", "oracle"):
            tot[k][0] += r[k][0]
            tot[k][1] += r[k][1]
            cells += [f"{r[k][0] / n:.0%}", f"{r[k][1] / n:.0f}"]
        if plan_right[fam]:
            plan, hits = max(plan_right[fam].items(), key=lambda kv: kv[1])
            top = f"{plan} ({hits / n:.0%})"
        else:
            top = "—"
        lines.append(f"| {fam} | {n} | " + " | ".join(cells) + f" | {top} |")
    n = tot["n"]
    lines.append(f"| **all** | {n} | " + " | ".join(
        f"**{tot[k][0] / n:.0%}** | {tot[k][1] / n:.0f}" for k in ("fixed", "team", "oracle")) + " | |")
    table = "\n".join(lines)
    took = time.perf_counter() - t_start
    footer = (f"\n{len(qs)} questions on {args.videos} M1-Synth videos of {args.duration:.0f} s (seed {args.seed}); "
              f"team `{cfg.name}`; frames = frames given to the browser (team: unique frames per episode); "
              f"{took:.0f} s on {os.cpu_count()} CPUs.")
    print(table + footer)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "headroom.md").write_text(table + footer + "\n")
    (args.out / "headroom.json").write_text(json.dumps({"rows": rows, "plan_right": plan_right}, indent=1))


if __name__ == "__main__":
    main()
