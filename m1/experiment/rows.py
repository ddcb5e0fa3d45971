"""The compact rows of an eval stage: what `m1 experiment report` reads, and what the runner commits under rows_dir
(docs/experiments/<name>/<arm>/seed<k>/<stage>.jsonl, gzipped when long), so that neither a report nor a later run
needs out_dir."""
from __future__ import annotations

import gzip
import json
from pathlib import Path
from typing import Any

from m1.data.metrics import is_correct
from m1.experiment.config import ExperimentError
from m1.files import write_whole
from m1.registry import TOOLS

RESULTS_FILE = "results.jsonl"  # an eval stage's answers (`m1 infer`'s results file) in its folder
GZIP_LINES = 50  # committed rows longer than this are stored as <stage>.jsonl.gz (git keeps them ~8x smaller)

def plan_name(plan: tuple[str, ...], sep: str = "→") -> str:
    """A plan in tool abbreviations (ToolSpec.short): "VR+FB"."""
    return sep.join(TOOLS[t].short if t in TOOLS else t for t in plan)


def tools(plan: str) -> tuple[str, ...]:
    """A compact row's plan ("VR+FB") as the tool names it abbreviates."""
    long = {s.short: s.name for s in TOOLS.values()}
    return tuple(long.get(t, t) for t in plan.split("+"))


def rows_file(path: Path) -> Path | None:
    """The rows file of `path` (a `.jsonl` name) as stored: itself, else its `.gz` twin; None without either."""
    path = Path(path)
    gz = path.with_name(path.name + ".gz")
    return path if path.is_file() else gz if gz.is_file() else None


def read_results(path: Path) -> list[dict[str, Any]]:
    """JSON lines of `path`, or of `path.gz` where only the compressed copy is there (`rows_file`)."""
    path = rows_file(path) or Path(path)
    data = path.read_bytes()
    text = (gzip.decompress(data) if path.suffix == ".gz" else data).decode("utf-8")
    rows = []
    for n, line in enumerate(text.splitlines(), 1):
        if line.strip():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as exc:
                raise ExperimentError(f"{path}:{n}: not a JSON line ({exc})") from None
    return rows


def write_rows(path: Path, rows: list[dict[str, Any]]) -> Path:
    """Write committed rows whole to `path` (a `.jsonl` name), gzipped past GZIP_LINES (`store_rows`); returns the
    file written."""
    path = Path(path)
    write_whole(path, "".join(json.dumps(r, separators=(",", ":")) + "\n" for r in rows).encode())
    return store_rows(path)


def store_rows(path: Path) -> Path:
    """Store a finished `.jsonl` rows file as committed: past GZIP_LINES lines, as `<name>.gz` (mtime 0 and no
    file name in the header, so the same rows give the same bytes) and the plain file removed; else plain, any
    older `.gz` removed. Returns the file kept. `zcat` reads a `.gz` one."""
    path = Path(path)
    gz = path.with_name(path.name + ".gz")
    data = path.read_bytes()
    if data.count(b"\n") <= GZIP_LINES:
        gz.unlink(missing_ok=True)
        return path
    write_whole(gz, gzip.compress(data, compresslevel=9, mtime=0))
    path.unlink()
    return gz


def store_record(record: Path) -> Path:
    """`store_rows` for an eval's committed record (`<stage>.json`) written before its rows were gzipped: its
    `rows` then names the file kept (scripts/store_records.py runs this over docs/experiments)."""
    data = json.loads(Path(record).read_text())
    kept = store_rows(Path(record).with_suffix(".jsonl"))
    if data.get("rows") != kept.name:
        data["rows"] = kept.name
        write_whole(Path(record), (json.dumps(data, indent=1) + "\n").encode())  # as records.write_record does
    return kept


def behaviour(row: dict[str, Any]) -> dict[str, Any]:
    """What a seed-kind team's results row says of how it answered, as those papers measure it: `frames` seen,
    tool `calls`, and each zoom's [seconds, fps] (`zooms`, when it zoomed). Empty for other teams' rows (no
    `frame_counts`), so their compact rows stay as they were."""
    counts = row.get("frame_counts")
    if not counts:
        return {}
    out = {"frames": row.get("frames_used"), "calls": counts.get("tool_calls")}
    return {**out, "zooms": row["zooms"]} if row.get("zooms") else out


def compact_eval(record: dict[str, Any], folder: Path, questions: list, source: str) -> dict[str, Any]:
    """What the report reads of a finished eval stage in `folder` (`record`, its stage.json; `questions`: the eval
    questions, named `source`): `rows`, one per graded question in the questions' order, {id, family, answer,
    correct, agents: [[first plan ("VR+FB"), strict format 0/1, the agent's own answer right 0/1], ...]} (about
    150 bytes a question for four agents), and for seed-kind teams `behaviour`'s frames, calls and zooms;
    `families` in the questions' order; `formats`, per phase [strict, generations] of its traces (`eval.traces`);
    `agents`, the agents' names."""
    qs = questions
    order = {q.id: i for i, q in enumerate(qs)}
    question = {q.id: q for q in qs}
    family = {q.id: str(q.meta.get("family") or q.task) for q in qs}
    path = Path(record.get("results", {}).get("results") or folder / RESULTS_FILE)
    rows, agents = [], []
    for row in read_results(path):
        if row.get("correct") is None:  # no ground truth: not graded
            continue
        if row["id"] not in family:
            raise ExperimentError(f"{path}: id {row['id']!r} is not in {source}")
        q = question[row["id"]]
        plans = []
        for name, v in (row.get("agents") or {}).items():
            if v.get("plan"):
                plans.append([plan_name(tuple(v["plan"]), "+"), int(bool(v.get("plan_ok"))),
                              int(is_correct(q, v.get("answer")))])
                agents += [name] if name not in agents else []
        rows.append({"id": row["id"], "family": family[row["id"]], "answer": row.get("answer"),
                     "correct": bool(row["correct"]), "agents": plans, **behaviour(row)})
    rows.sort(key=lambda r: order[r["id"]])
    formats: dict[str, list[int]] = {}
    traces = record.get("results", {}).get("traces")
    for p in sorted(Path(traces).glob("*.json")) if traces else []:
        for g in json.loads(p.read_text()).get("generations", []):
            c = formats.setdefault(g["phase"], [0, 0])
            c[0] += bool(g.get("parse_ok", True))
            c[1] += 1
    return {"rows": rows, "families": list(dict.fromkeys(family.values())), "formats": formats, "agents": agents}
