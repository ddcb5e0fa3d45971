"""Running a team over many questions: inputs, resumable results, traces, progress.

Results are one JSON line per question, written with a single append of the whole line and
flushed to disk; on start, a torn last line left by a killed run is cut off, and ids already
present are skipped. So a run killed at any moment and rerun lists every id exactly once.
Beside it, `<results>.team.json` records the team that wrote it (config and local weight files): resuming
with another team would mix two teams' answers in one file, so it is refused with the fields that differ.
"""
from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

from pydantic import ValidationError

from m1.config import TeamConfig
from m1.models.tiny import spec_hash
from m1.schema import Episode, Question


class InputError(ValueError):
    pass


def build_questions(video_dir: Path, question: str | None = None, options: list[str] | None = None,
                    task: str = "", questions_file: Path | None = None) -> tuple[list[Question], list[str]]:
    """Questions from `--question` (asked of every video in the folder) or a JSONL file.

    Returns the questions and a list of problems (malformed lines) that were skipped."""
    from m1.video import list_videos

    video_dir = Path(video_dir)
    if not video_dir.exists():
        raise InputError(f"{video_dir}: no such folder or file")
    if (question is None) == (questions_file is None):
        raise InputError("give exactly one of --question TEXT or --questions FILE.jsonl")
    if question is not None:
        videos = [video_dir] if video_dir.is_file() else list_videos(video_dir)
        if not videos:
            raise InputError(f"{video_dir}: no video files (.mp4 .mkv .avi .mov .webm .m4v) found")
        task = task or ("mcq" if options else "open")
        qs = [Question(id=v.stem if video_dir.is_dir() else v.name, video=str(v), text=question,
                       options=list(options or []), task=task) for v in videos]
        _check_unique(qs, str(video_dir))
        return qs, []
    return read_questions(Path(questions_file), video_dir)


def read_questions(path: Path, video_dir: Path | None = None) -> tuple[list[Question], list[str]]:
    if not path.is_file():
        raise InputError(f"{path}: questions file not found")
    qs, issues = [], []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            q = Question.model_validate(json.loads(line))
        except (json.JSONDecodeError, ValidationError) as exc:
            first = str(exc).splitlines()[0] if isinstance(exc, json.JSONDecodeError) else "; ".join(
                f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors())
            issues.append(f"{path}:{n}: malformed question ({first})")
            continue
        if video_dir is not None and not Path(q.video).is_absolute():
            base = video_dir if video_dir.is_dir() else video_dir.parent
            q.video = str(base / q.video)
        qs.append(q)
    _check_unique(qs, str(path))
    return qs, issues


def _check_unique(qs: list[Question], source: str) -> None:
    seen = set()
    for q in qs:
        if q.id in seen:
            raise InputError(f"{source}: duplicate question id {q.id!r}")
        seen.add(q.id)


class ResultsFile:
    """Append-only JSONL that survives being killed mid-write."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._repair()
        self.done = {r["id"] for r in self.read()}

    def _repair(self) -> None:
        if not self.path.exists():
            return
        data = self.path.read_bytes()
        if data and not data.endswith(b"\n"):  # a torn line from a killed run
            with open(self.path, "r+b") as f:
                f.truncate(data.rfind(b"\n") + 1)

    def read(self) -> list[dict]:
        if not self.path.exists():
            return []
        rows = []
        for n, line in enumerate(self.path.read_text().splitlines(), 1):
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as exc:
                raise InputError(f"{self.path}:{n}: not a JSON line ({exc}); fix or move the file") from None
        return rows

    def append(self, row: dict) -> None:
        data = (json.dumps(row, ensure_ascii=False) + "\n").encode()
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, data)  # one write call: the line lands whole or not at all
            os.fsync(fd)
        finally:
            os.close(fd)
        self.done.add(row["id"])


def result_row(ep: Episode) -> dict:
    from m1.data.metrics import is_correct

    t = ep.timings
    per_q = t.get("batch_wall", 0.0) / max(1.0, t.get("batch_size", 1.0))
    row = {
        "id": ep.id, "video": ep.question.video, "question": ep.question.text, "task": ep.question.task,
        "answer": ep.final_answer, "reason": ep.final_reason, "aggregation": ep.aggregation,
        "agents": {a.agent: {"answer": a.answer, "reason": a.reason, "parse_ok": a.parse_ok} for a in ep.answers},
        "frames_used": ep.frames_used, "seconds": round(per_q, 3),
        "latency": {k: round(v, 4) for k, v in t.items() if k in ("llm", "vision", "tools", "decode", "open_video")},
        "error": ep.error,
    }
    if ep.question.answer is not None:
        row["truth"] = ep.question.answer
        row["correct"] = is_correct(ep.question, ep.final_answer)
    return row


def write_trace(trace_dir: Path, ep: Episode) -> Path:
    from m1.trace import render_html

    trace_dir.mkdir(parents=True, exist_ok=True)
    safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in ep.id)
    for suffix, text in ((".json", ep.model_dump_json(indent=1)), (".html", render_html(ep))):
        tmp = trace_dir / f".{safe}{suffix}.tmp"
        tmp.write_text(text)
        tmp.replace(trace_dir / f"{safe}{suffix}")
    return trace_dir / f"{safe}.json"


@dataclass
class RunSummary:
    out: Path
    answered: int = 0
    skipped_done: int = 0
    errors: list[str] = field(default_factory=list)
    correct: int = 0
    graded: int = 0
    seconds: float = 0.0

    def describe(self) -> str:
        lines = [f"{self.answered} answered, {self.skipped_done} already done, {len(self.errors)} errors "
                 f"in {self.seconds:.1f}s -> {self.out}"]
        if self.graded:
            lines.append(f"accuracy {self.correct}/{self.graded} = {self.correct / self.graded:.1%}")
        lines += [f"  error: {e}" for e in self.errors]
        return "\n".join(lines)


def weight_stamp(folder: Path) -> list[list]:
    """Each file of a weights folder as [name, size, write time]: changes whenever the weights are written again."""
    return sorted([f.name, f.stat().st_size, f.stat().st_mtime_ns] for f in Path(folder).iterdir() if f.is_file())


def team_signature(cfg: TeamConfig) -> dict:
    """What decides a team's answers: its config, the `weight_stamp` of each local weights (and adapter) folder, and
    the cache key of each tiny model built from a spec (it changes with the recipe and the synth tokenizer version)."""
    weights = {key: weight_stamp(Path(spec.path)) for key, spec in sorted(cfg.models.items())
               if spec.path and Path(spec.path).is_dir()}
    adapters = {key: weight_stamp(Path(spec.adapter)) for key, spec in sorted(cfg.models.items())
                if spec.adapter and Path(spec.adapter).is_dir()}
    out = {"config": cfg.model_dump(mode="json"), "weights": weights}
    if adapters:  # absent without adapters, so earlier signatures stay valid
        out["adapters"] = adapters
    tiny = {key: spec_hash(spec.tiny) for key, spec in sorted(cfg.models.items()) if spec.tiny is not None}
    if tiny:  # absent without tiny specs, so the signatures of teams of weight folders are unchanged
        out["tiny"] = tiny
    return out


def _flat(d, prefix: str = "") -> dict[str, object]:
    if isinstance(d, dict):
        out: dict[str, object] = {}
        for k, v in d.items():
            out.update(_flat(v, f"{prefix}{k}."))
        return out
    return {prefix.rstrip("."): d}


def check_team(results: Path, cfg: TeamConfig, restart: bool = False) -> None:
    """Make sure `results` holds (or will hold) only answers of team `cfg`.

    If it has answers from a team with another signature: with `restart` they are deleted (the demo starts over),
    otherwise InputError names the differing fields. Then the signature of `cfg` is recorded beside it.
    """
    results = Path(results)
    stamp = results.with_name(results.name + ".team.json")
    sig = team_signature(cfg)
    if stamp.is_file() and results.is_file() and results.stat().st_size:
        old = json.loads(stamp.read_text())
        if old != sig:
            a, b = _flat(old), _flat(sig)
            diff = sorted(k for k in a.keys() | b.keys() if a.get(k) != b.get(k))
            if not restart:
                raise InputError(
                    f"{results} holds answers of another team (differs in {', '.join(diff[:5])}"
                    f"{', ...' if len(diff) > 5 else ''}); resuming would mix two teams: use another --out or "
                    f"move the file")
            results.unlink()
    results.parent.mkdir(parents=True, exist_ok=True)
    stamp.write_text(json.dumps(sig, indent=1))


def run_questions(cfg: TeamConfig, questions: list[Question], out: Path, trace_dir: Path | None = None,
                  limit: int | None = None, team=None, progress: bool = True) -> RunSummary:
    from tqdm import tqdm

    from m1.team.cpp import Team

    check_team(Path(out), cfg)
    results = ResultsFile(out)
    todo = [q for q in questions if q.id not in results.done]
    summary = RunSummary(out=Path(out), skipped_done=len(questions) - len(todo))
    if limit is not None:
        todo = todo[:limit]
    if not todo:
        return summary
    team = team or Team(cfg)
    t0 = time.perf_counter()
    bar = tqdm(total=len(todo), desc=f"team {cfg.name}", unit="q", disable=not progress)

    def done(ep: Episode) -> None:
        row = result_row(ep)
        if trace_dir is not None:
            write_trace(Path(trace_dir), ep)
        results.append(row)
        bar.update(1)
        if ep.error:
            summary.errors.append(f"{ep.id}: {ep.error}")
        else:
            summary.answered += 1
        if "correct" in row and not ep.error:
            summary.graded += 1
            summary.correct += int(row["correct"])

    try:
        team.run(todo, on_episode=done)
    finally:
        bar.close()
    summary.seconds = time.perf_counter() - t0
    return summary
