"""`m1 demo`: generate a small M1-Synth set and run an offline team on it, printing each
question with the team's answer, the truth and the agents' votes, then accuracy per family."""
from __future__ import annotations

import json
import shutil
from collections import defaultdict
from pathlib import Path

from m1.config import load_team
from m1.data.questions import read_questions
from m1.locks import hold_dir
from m1.results import ResultsFile, check_team
from m1.run import run_questions
from m1.synth.make import make_dataset


def run_demo(out: Path, team: str, videos: int = 3, seed: int = 0, duration: float = 120.0,
             questions_per_video: int = 6, overrides: list[str] | None = None, echo=print) -> dict:
    """Held for one run at a time: a second demo into the same folder is refused before it touches its data."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    with hold_dir(out, "demo folder"):
        return _run_demo(out, team, videos, seed, duration, questions_per_video, overrides, echo)


def _run_demo(out: Path, team: str, videos: int, seed: int, duration: float, questions_per_video: int,
              overrides: list[str] | None, echo) -> dict:
    data = out / "data"
    stamp = data / "params.json"
    params = {"videos": videos, "seed": seed, "duration": duration, "questions_per_video": questions_per_video}
    if not stamp.exists() or json.loads(stamp.read_text()) != params:
        if stamp.exists():  # the demo's own set of other params: make_dataset would refuse to mix the two
            shutil.rmtree(data)
        make_dataset(data, videos, seed, duration=duration, questions_per_video=questions_per_video)
        stamp.write_text(json.dumps(params))
        (out / "results.jsonl").unlink(missing_ok=True)  # results of another data set are stale
    questions, issues = read_questions(data / "questions.jsonl", data)
    for msg in issues:
        echo(f"skipped: {msg}")
    cfg = load_team(team, overrides or [])
    check_team(out / "results.jsonl", cfg, restart=True)  # another team's (or weights') answers are stale here
    summary = run_questions(cfg, questions, out / "results.jsonl", trace_dir=out / "traces")
    rows = {r["id"]: r for r in ResultsFile(out / "results.jsonl").read()}
    per_family: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    for q in questions:
        r = rows.get(q.id)
        if r is None:
            continue
        fam = q.meta.get("family", q.task)
        ok = bool(r.get("correct"))
        per_family[fam][0] += ok
        per_family[fam][1] += 1
        votes = ", ".join(f"{a}={v['answer'] or '∅'}" for a, v in r["agents"].items())
        opts = "  ".join(f"{chr(65 + i)}) {o}" for i, o in enumerate(q.options))
        echo(f"[{'✓' if ok else '✗'}] {q.id} ({fam}) {q.text}" + (f"\n      {opts}" if opts else ""))
        echo(f"      team: {r['answer']}   truth: {q.answer}   votes: {votes}"
             + (f"   error: {r['error']}" if r.get("error") else ""))
    total = [sum(v[0] for v in per_family.values()), sum(v[1] for v in per_family.values())]
    echo("\nfamily       correct")
    for fam, (c, n) in sorted(per_family.items()):
        echo(f"{fam:<12} {c}/{n}")
    echo(f"{'all':<12} {total[0]}/{total[1]} = {total[0] / max(1, total[1]):.1%}  (team {cfg.name})")
    echo(f"results: {out / 'results.jsonl'}   traces: {out / 'traces'}")
    echo(summary.describe().splitlines()[0])
    echo(f"trace index: {out / 'traces' / 'index.html'}   (serve it: m1 view {out})")
    return {"correct": total[0], "total": total[1], "per_family": dict(per_family)}
