"""Running a team over many questions: inputs, resumable results, traces, progress.

Results are one JSON line per question, written with a single append of the whole line and
flushed to disk; on start, a torn last line left by a killed run is cut off, and ids already
present are skipped. So a run killed at any moment and rerun lists every id exactly once. A line (or
trace) that cannot be written whole — disk full — is cut back to the previous size and the run stops
with a `WriteError`; one run at a time writes a results file (`m1.locks`); SIGTERM/SIGINT stop it
between two lines (`Stopped`). `--shard i/n` splits the questions over workers, `merge_parts` joins them.
Beside it, `<results>.team.json` records the team that wrote it (config and local weight files): resuming
with another team would mix two teams' answers in one file, so it is refused with the fields that differ.
"""
from __future__ import annotations

import hashlib
import json
import os
import signal
import threading
import time
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from m1 import files
from m1.config import TeamConfig
from m1.data.loaders import INVALID, check_question
from m1.files import WriteError, write_whole
from m1.locks import hold
from m1.models.tiny import spec_hash
from m1.schema import Episode, Question
from m1.trace import result_row


class InputError(ValueError):
    pass


class Stopped(BaseException):
    """A run stopped by SIGTERM/SIGINT between two results lines. A BaseException (like
    KeyboardInterrupt) so that no `except Exception` inside the team records it as an episode's error."""

    def __init__(self, signum: int, message: str = ""):
        self.signum = signum
        self.exit_status = 128 + signum  # the shell's convention: 130 for SIGINT, 143 for SIGTERM
        super().__init__(message or f"stopped by {signal.Signals(signum).name}")


def build_questions(video_dir: Path, question: str | None = None, options: list[str] | None = None,
                    task: str = "", questions_file: Path | None = None, invalid_rows: bool = False
                    ) -> tuple[list[Question], list[str]]:
    """Questions from `--question` (asked of every video in the folder) or a JSONL file.

    Returns the questions and a list of problems (malformed lines) that were skipped. `invalid_rows`: as for
    `read_questions`."""
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
        checked = [check_question({"id": v.stem if video_dir.is_dir() else v.name, "video": str(v),
                                   "text": question, "options": list(options or []), "task": task}) for v in videos]
        if not invalid_rows and checked[0][1]:  # the same question for every video: invalid for all of them
            raise InputError(f"--question: {checked[0][1]}")
        qs = [q for q, _ in checked]
        _check_unique(qs, str(video_dir))
        return qs, []
    return read_questions(Path(questions_file), video_dir, invalid_rows)


def read_questions(path: Path, video_dir: Path | None = None, invalid_rows: bool = False
                   ) -> tuple[list[Question], list[str]]:
    """Questions of a JSONL file; a line that is not UTF-8, not JSON or has no id is skipped and named (file:line)
    in the returned problems, so one bad line never hides the rest. A line that fails `check_question` (the one
    validation, shared with `m1 eval`) is skipped and named too, or with `invalid_rows` (`m1 infer`) comes back as
    a stand-in that `_run` writes as an error row."""
    path = Path(path)
    if path.is_dir():
        raise InputError(f"{path}: is a folder; --questions needs a JSONL file")
    if not path.is_file():
        raise InputError(f"{path}: questions file not found")
    qs, issues = [], []
    for n, line in enumerate(text_lines(path, issues, "question"), 1):
        if line is None or not line.strip():
            continue
        try:
            q, problem = check_question(json.loads(line))
        except json.JSONDecodeError as exc:
            q, problem = None, str(exc).splitlines()[0]
        if q is None or (problem and not invalid_rows):  # with no id, no error row can be written under it
            issues.append(f"{path}:{n}: malformed question ({problem})")
            continue
        if video_dir is not None and not Path(q.video).is_absolute():
            base = video_dir if video_dir.is_dir() else video_dir.parent
            q.video = str(base / q.video)
        qs.append(q)
    _check_unique(qs, str(path))
    return qs, issues


def text_lines(path: Path, issues: list[str], what: str = "record") -> list[str | None]:
    """The lines of a text file, each decoded as UTF-8 on its own: a line that is not UTF-8 is None, and
    `path:n: not UTF-8 ...` goes to `issues`, so bad bytes on one line skip that line only."""
    out: list[str | None] = []
    for n, raw in enumerate(Path(path).read_bytes().split(b"\n"), 1):
        try:
            out.append(raw.decode("utf-8").rstrip("\r"))
        except UnicodeDecodeError as exc:
            issues.append(f"{path}:{n}: malformed {what} (not UTF-8: byte 0x{raw[exc.start]:02x} at column "
                          f"{exc.start + 1})")
            out.append(None)
    if out and out[-1] == "":
        out.pop()
    return out


def _check_unique(qs: list[Question], source: str) -> None:
    seen = set()
    for q in qs:
        if q.id in seen:
            raise InputError(f"{source}: duplicate question id {q.id!r}")
        seen.add(q.id)


class ResultsFile:
    """Append-only JSONL that survives being killed mid-write. `done`: the ids it lists; `failed`: those of them whose
    line records an error (a rerun answers them again and `replace`s their line, so each id stays listed once)."""

    def __init__(self, path: Path):
        self.path = Path(path)
        if self.path.is_dir():
            raise InputError(f"{self.path}: is a folder; the results need a file path (e.g. {self.path}/results.jsonl)")
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._repair()
        rows = self.read()
        self.done = {r["id"] for r in rows}
        self.failed = {r["id"] for r in rows if r.get("error")}
        self.fps = {r["id"]: r.get("fp") for r in rows}  # None: a line written before fingerprints

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
        for n, raw in enumerate(self.path.read_bytes().splitlines(), 1):
            try:
                row = json.loads(raw.decode("utf-8"))
            except (json.JSONDecodeError, UnicodeDecodeError) as exc:
                raise InputError(f"{self.path}:{n}: not a JSON line ({exc}); fix or move the file") from None
            if not isinstance(row, dict) or "id" not in row:
                raise InputError(f"{self.path}:{n}: not a results line (no id); fix or move the file")
            rows.append(row)
        return rows

    def replace(self, row: dict) -> None:
        """Put `row` in place of the line of the same id (an earlier error being retried), writing the file whole
        through a temporary file (`write_whole`): a reader or a killed run sees the old file or the new one."""
        data = (json.dumps(row, ensure_ascii=False) + "\n").encode()
        lines = self.path.read_bytes().splitlines(keepends=True)
        at = [i for i, line in enumerate(lines) if json.loads(line).get("id") == row["id"]]
        if len(at) != 1:
            raise InputError(f"{self.path}: expected one line of id {row['id']!r} to replace, found {len(at)}")
        lines[at[0]] = data
        try:
            write_whole(self.path, b"".join(lines))
        except WriteError as exc:
            raise WriteError(self.path, exc.exc, question=row["id"], safe=len(self.done), results=self.path) from None
        if not row.get("error"):
            self.failed.discard(row["id"])

    def append(self, row: dict) -> None:
        """Append one whole line and fsync it; if that fails (disk full), cut the file back to its
        previous size and raise WriteError: the line is in the file whole or not at all."""
        data = (json.dumps(row, ensure_ascii=False) + "\n").encode()
        try:
            f = files.open_for_write(self.path, "ab")
        except OSError as exc:
            raise WriteError(self.path, exc, question=row["id"], safe=len(self.done), results=self.path) from None
        with f:
            size = os.fstat(f.fileno()).st_size
            try:
                files.write_all(f, data)
                os.fsync(f.fileno())
            except OSError as exc:
                os.ftruncate(f.fileno(), size)
                raise WriteError(self.path, exc, question=row["id"], safe=len(self.done), results=self.path) from None
        self.done.add(row["id"])
        if row.get("error"):
            self.failed.add(row["id"])


@dataclass
class RunSummary:
    out: Path
    answered: int = 0
    skipped_done: int = 0
    errors: list[str] = field(default_factory=list)
    correct: int = 0
    graded: int = 0
    seconds: float = 0.0
    retried: int = 0  # earlier error lines answered again (their lines replaced)
    retried_failed: int = 0  # of those, how many ended in an error again
    kept_errors: int = 0  # earlier error lines left as they are (--keep-errors)
    changed: int = 0  # done questions asked differently since their line was written, answered again
    kept_stale: int = 0  # of those, left as they are (--keep-stale)

    def describe(self) -> str:
        lines = [f"{self.answered} answered, {self.skipped_done} already done, {len(self.errors)} errors "
                 f"in {self.seconds:.1f}s -> {self.out}"]
        if self.retried:
            lines.append(f"retried {self.retried} earlier errors: {self.retried - self.retried_failed} now answered, "
                         f"{self.retried_failed} still errors")
        if self.kept_errors:
            lines.append(f"{self.kept_errors} earlier errors kept as they are (--keep-errors); rerun without it to "
                         f"retry them")
        if self.changed:
            lines.append(f"re-answered {self.changed} questions that changed since their line was written "
                         f"(--keep-stale keeps the old answers)")
        if self.kept_stale:
            lines.append(f"{self.kept_stale} questions changed since their line was written; their old answers kept "
                         f"(--keep-stale); rerun without it to answer them again")
        if self.graded:
            lines.append(f"accuracy {self.correct}/{self.graded} = {self.correct / self.graded:.1%}")
        lines += [f"  error: {e}" for e in self.errors]
        return "\n".join(lines)


def fingerprint(q: Question, _stat: dict | None = None) -> str:
    """A short hash of what was asked: the video's identity (resolved path, size, mtime) and the question's text,
    task, options and ground truth. A results line records it, so a rerun sees a question edited under its id.
    `_stat`: a cache of video path -> identity shared by the calls of one run (many questions per video)."""
    cache = {} if _stat is None else _stat
    if q.video not in cache:
        try:
            path = Path(q.video).resolve()
            st = path.stat()
            cache[q.video] = [str(path), st.st_size, st.st_mtime_ns]
        except (OSError, RuntimeError, ValueError):  # missing, a link loop: the row is an error anyway
            cache[q.video] = [q.video, None, None]
    asked = [cache[q.video], q.text, q.task, list(q.options), q.answer]
    return hashlib.sha256(json.dumps(asked, ensure_ascii=False).encode()).hexdigest()[:16]


def invalid_row(q: Question) -> dict:
    """The error row of a question `check_question` rejected: the keys of `result_row`, the problem as `error`."""
    return {"id": q.id, "video": q.video, "question": q.text, "task": q.task, "answer": None, "reason": None,
            "aggregation": None, "agents": {}, "frames_used": 0, "seconds": 0.0, "latency": {},
            "error": f"invalid question: {q.meta[INVALID]}"}


def write_trace(trace_dir: Path, ep: Episode, pool=None, index=None) -> Path:
    """Write the episode's JSON and its HTML page (`m1.trace`). `pool`: the run's VideoPool, whose cache
    holds the frames the tools read, so thumbnails cost no decoding; `index`: a `TraceIndex` to tell."""
    from m1.trace import render_html, trace_name

    trace_dir = Path(trace_dir)
    trace_dir.mkdir(parents=True, exist_ok=True)
    safe = trace_name(ep.id)
    for suffix, text in ((".json", ep.model_dump_json(indent=1)), (".html", render_html(ep, pool=pool))):
        write_whole(trace_dir / f"{safe}{suffix}", text.encode())
    if index is not None:
        index.add(ep, trace_dir / f"{safe}.json")
    return trace_dir / f"{safe}.json"


INDEX_EVERY_S = 5.0  # while a run goes on, the trace index is rewritten at most this often (and at its end)



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
        try:
            old = json.loads(stamp.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise InputError(f"{stamp}: not the JSON team record M1 writes beside {results.name} ({exc}); without "
                             f"it the answers cannot be checked against this team: delete it only if they are") from None
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
    write_whole(stamp, json.dumps(sig, indent=1).encode())  # a full disk is a WriteError naming it, not half a stamp


# ------------------------------------------------------------------ sharding

def parse_shard(text: str) -> tuple[int, int]:
    """'1/4' -> (1, 4): worker 1 of 4 (workers count from 0)."""
    try:
        i, n = (int(x) for x in text.split("/"))
    except ValueError:
        raise InputError(f"--shard {text!r}: expected i/n, e.g. 0/4 (worker 0 of 4)") from None
    if n < 1 or not 0 <= i < n:
        raise InputError(f"--shard {text!r}: need 0 <= i < n (workers are numbered 0 .. n-1)")
    return i, n


def part_path(out: Path, i: int, n: int) -> Path:
    """Worker i of n writes `<out>.part-i-of-n.jsonl`."""
    out = Path(out)
    return out.with_name(f"{out.name}.part-{i}-of-{n}.jsonl")


def shards_manifest(out: Path) -> Path:
    """`<out>.shards.json`: every question id in input order and the number of parts, for `merge_parts`."""
    out = Path(out)
    return out.with_name(out.name + ".shards.json")


def shard_of(questions: list[Question], i: int, n: int) -> list[Question]:
    """Worker i's questions: those whose index in the input order is i mod n. Every worker must be
    given the same input (checked against the manifest), so the parts cover each question once."""
    return questions[i::n]


def _record_split(out: Path, questions: list[Question], n: int) -> None:
    """Write the manifest of the split, or check that this worker's input matches the recorded one."""
    path = shards_manifest(out)
    ids = [q.id for q in questions]
    if path.is_file():
        old = json.loads(path.read_text())
        if old.get("n") != n or old.get("ids") != ids:
            if old.get("n") != n:
                what = f"splits into {old.get('n')} parts, this run into {n}"
            else:
                a, b = old.get("ids", []), ids
                k = next((k for k, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
                what = (f"lists {len(a)} questions, this run {len(b)}; first difference at position {k}: "
                        f"{a[k] if k < len(a) else 'end'!r} vs {b[k] if k < len(b) else 'end'!r}")
            raise InputError(f"{path} records another split of {out} ({what}): give every worker the same input "
                             f"and the same n, or move {out.name}.part-* and {path.name} away to start over")
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    write_whole(path, json.dumps({"rule": "index in input order mod n", "n": n, "ids": ids}).encode())


@dataclass
class MergeSummary:
    out: Path
    rows: int
    parts: list[Path]
    already: bool = False
    deleted: bool = False

    def describe(self) -> str:
        if self.already:
            return f"{self.out} already holds the merge of {len(self.parts)} parts ({self.rows} results); nothing to do"
        tail = "; parts deleted" if self.deleted else "; parts kept (--delete-parts removes them)"
        return f"merged {len(self.parts)} parts: {self.rows} results in input order -> {self.out}{tail}"


def merge_parts(out: Path, delete_parts: bool = False) -> MergeSummary:
    """Join `<out>.part-i-of-n.jsonl` into `out`: every id of the split exactly once, in input order.

    Refused (InputError naming the parts and ids) if a part is missing, still being written (its lock),
    lacks ids, holds ids that are not its own or that another part also holds, or was written by
    another team. `out` is written whole (temporary file renamed); if it already exists it must hold
    exactly this merge. The parts stay unless `delete_parts`."""
    out = Path(out)
    manifest = shards_manifest(out)
    if not manifest.is_file():
        found = sorted(p.name for p in out.parent.glob(f"{out.name}.part-*-of-*.jsonl"))
        raise InputError(f"{manifest}: no record of a sharded run into {out}"
                         + (f" (found {', '.join(found)}, but not the manifest their workers write)" if found else
                            "; run the workers first: m1 infer ... --out " + f"{out} --shard i/n"))
    split = json.loads(manifest.read_text())
    n, ids = int(split["n"]), list(split["ids"])
    parts = [part_path(out, i, n) for i in range(n)]
    absent = [i for i, p in enumerate(parts) if not p.is_file()]
    if absent:
        def share(i: int) -> str:
            mine = ids[i::n]
            more = f", ... ({len(mine)} in all)" if len(mine) > 5 else ""
            return f"{parts[i].name} (ids {', '.join(map(repr, mine[:5]))}{more})"

        raise InputError(f"cannot merge into {out}: {'; '.join(share(i) for i in absent)} missing; run those workers "
                         f"({', '.join(f'--shard {i}/{n}' for i in absent)}) first")
    problems: list[str] = []
    with ExitStack() as locks:
        for p in parts:
            locks.enter_context(hold(p, "part file", "wait for that worker to finish, then merge"))
        locks.enter_context(hold(out, "results file", "wait for it to finish, or merge into another file"))
        lines: dict[str, tuple[str, int]] = {}  # id -> (line, part index)
        for i, p in enumerate(parts):
            ResultsFile(p)  # cuts a torn last line of a killed worker
            own = set(ids[i::n])
            seen_here: set[str] = set()
            for line in p.read_text().splitlines():
                rid = json.loads(line)["id"]
                if rid in seen_here:
                    problems.append(f"{p.name} lists {rid!r} twice")
                    continue
                seen_here.add(rid)
                if rid in lines:
                    problems.append(f"parts disagree: {rid!r} is in both {parts[lines[rid][1]].name} and {p.name}")
                    continue
                if rid not in own:
                    problems.append(f"{p.name} holds {rid!r}, which is not in its share of the split "
                                    f"(recorded in {manifest.name})")
                lines[rid] = (line, i)
            missing = [x for x in ids[i::n] if x not in seen_here]
            if missing:
                more = f", ... ({len(missing)} in all)" if len(missing) > 5 else ""
                problems.append(f"{p.name} misses {', '.join(map(repr, missing[:5]))}{more}: rerun that worker "
                                f"(--shard {i}/{n}) to finish it")
        stamps = [p.with_name(p.name + ".team.json") for p in parts]
        sigs = [json.loads(t.read_text()) if t.is_file() else None for t in stamps]
        for i in range(1, n):
            if sigs[i] != sigs[0] and sigs[i] is not None and sigs[0] is not None:
                a, b = _flat(sigs[0]), _flat(sigs[i])
                diff = sorted(k for k in a.keys() | b.keys() if a.get(k) != b.get(k))
                problems.append(f"parts disagree: {parts[0].name} and {parts[i].name} were written by different "
                                f"teams (differ in {', '.join(diff[:5])})")
        if problems:
            raise InputError(f"cannot merge into {out}:\n" + "\n".join(f"  - {x}" for x in problems))
        data = "".join(lines[x][0] + "\n" for x in ids).encode()
        summary = MergeSummary(out=out, rows=len(ids), parts=parts)
        if out.is_file() and out.stat().st_size:
            if out.read_bytes() == data:
                summary.already = True
            else:
                raise InputError(f"{out} already holds {len(out.read_text().splitlines())} results that are not "
                                 f"this merge of {n} parts; move it or merge into another file")
        else:
            write_whole(out, data)
        if sigs[0] is not None:
            write_whole(out.with_name(out.name + ".team.json"), json.dumps(sigs[0], indent=1).encode())
        if delete_parts:
            for p in parts:
                p.unlink(missing_ok=True)
                p.with_name(p.name + ".team.json").unlink(missing_ok=True)
            manifest.unlink(missing_ok=True)
            summary.deleted = True
    return summary


# ------------------------------------------------------------------ graceful stop

class _StopOnSignals:
    """SIGTERM / SIGINT stop a run between two results lines: outside a write, the first signal
    raises Stopped at once (the episodes in flight are dropped; they are redone on resume); during
    a write it waits until the line is whole. A second signal exits at once (status 128 + signal)."""

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self):
        self.signum: int | None = None
        self.writing = False
        self._old: dict[int, object] = {}

    def _handler(self, signum, frame) -> None:
        if self.signum is not None:
            os._exit(128 + signum)
        self.signum = signum
        if not self.writing:
            raise Stopped(signum)

    @contextmanager
    def write(self):
        """A section no first signal interrupts (one results line and its trace)."""
        self.writing = True
        try:
            yield
        finally:
            self.writing = False
        if self.signum is not None:
            raise Stopped(self.signum)

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():  # signals reach the main thread only
            for s in self.SIGNALS:
                self._old[s] = signal.signal(s, self._handler)
        return self

    def __exit__(self, *exc) -> None:
        for s, h in self._old.items():
            signal.signal(s, h)


def run_questions(cfg: TeamConfig, questions: list[Question], out: Path, trace_dir: Path | None = None,
                  limit: int | None = None, team=None, progress: bool = True,
                  shard: tuple[int, int] | None = None, stop_on_signals: bool = False,
                  keep_errors: bool = False, keep_stale: bool = False) -> RunSummary:
    """Answer `questions` into the results file `out`, resuming it; see the module docstring.

    A question whose line records an error (a video that was missing, a model that failed) is answered again and
    its line replaced, unless `keep_errors`; so is one whose fingerprint (`fingerprint`) changed, unless
    `keep_stale`. A question `check_question` rejected is written as an error row without being asked; one whose
    prompt does not fit a model's context or the team's limits.max_prompt_tokens is an error row ("prompt too long:").
    `shard=(i, n)`: answer only worker i's share (`shard_of`) into `part_path(out, i, n)`.
    `stop_on_signals`: SIGTERM/SIGINT raise Stopped (with counts) after the line being written.
    Raises LockError when another run writes the same file, WriteError when a line cannot be written."""
    out = Path(out)
    if shard is not None:
        i, n = shard
        _record_split(out, questions, n)
        questions, out = shard_of(questions, i, n), part_path(out, i, n)
    advice = ("wait for it, or use --shard i/n to split one evaluation across workers" if shard is None else
              "wait for it; every worker needs its own --shard i/n")
    with hold(out, "results file", advice), _StopOnSignals() as stop:
        try:
            return _run(cfg, questions, out, trace_dir, limit, team, progress, stop, keep_errors, keep_stale)
        except Stopped as exc:
            done = len({q.id for q in questions} & ResultsFile(out).done)
            raise Stopped(exc.signum, f"stopped by {signal.Signals(exc.signum).name}: {done} of {len(questions)} "
                                      f"questions answered in {out}; rerun the same command to continue") from None


def _run(cfg, questions, out, trace_dir, limit, team, progress, stop: _StopOnSignals,
         keep_errors: bool = False, keep_stale: bool = False) -> RunSummary:
    from tqdm import tqdm

    from m1.team.cpp import make_team

    check_team(Path(out), cfg)
    results = ResultsFile(out)
    stat: dict = {}
    fps = {q.id: fingerprint(q, stat) for q in questions}
    failed = results.failed & {q.id for q in questions}
    # a line without a fingerprint (written before they existed) counts as matching: an upgrade re-answers nothing
    stale = {q.id for q in questions if q.id in results.done and q.id not in failed
             and results.fps.get(q.id) not in (None, fps[q.id])}
    retry = (set() if keep_errors else failed) | (set() if keep_stale else stale)
    todo = [q for q in questions if q.id not in results.done or q.id in retry]
    summary = RunSummary(out=Path(out), skipped_done=len(questions) - len(todo),
                         kept_errors=len(failed) if keep_errors else 0, kept_stale=len(stale) if keep_stale else 0)
    if limit is not None:
        todo = todo[:limit]
    retry &= {q.id for q in todo}
    invalid = [q for q in todo if INVALID in q.meta]
    todo = [q for q in todo if INVALID not in q.meta]
    index = None
    if trace_dir is not None:
        from m1.trace import TraceIndex

        index = TraceIndex(Path(trace_dir))
    def write(row: dict) -> None:  # inside stop.write()
        if row["id"] in retry:  # an earlier error or a changed question: its line is replaced, the id listed once
            results.replace(row)
            if row["id"] in stale:
                summary.changed += 1
            else:
                summary.retried += 1
                summary.retried_failed += int(bool(row.get("error")))
        else:
            results.append(row)

    for q in invalid:  # never asked: an error row naming the field, the rest of the run goes on
        row = {**invalid_row(q), "fp": fps[q.id]}
        with stop.write():
            write(row)
        summary.errors.append(f"{q.id}: {row['error']}")
    if not todo:
        if index is not None:  # a rerun of a finished (or killed after its last line) run: index what is there
            with stop.write():
                index.write()
        return summary
    team = team or make_team(cfg)
    if hasattr(team, "over_budget_rows"):  # a question too long for a model is its own error row, not a stop
        team.over_budget_rows = True
    t0 = time.perf_counter()
    bar = tqdm(total=len(todo), desc=f"team {cfg.name}", unit="q", disable=not progress)
    last_index = [time.monotonic()]  # when the index was last written (first: INDEX_EVERY_S into the run)

    def done(ep: Episode) -> None:
        row = {**result_row(ep), "fp": fps[ep.id]}
        with stop.write():
            if trace_dir is not None:
                try:
                    write_trace(Path(trace_dir), ep, pool=getattr(team, "pool", None), index=index)
                except WriteError as exc:
                    raise WriteError(exc.path, exc.exc, question=ep.id, safe=len(results.done),
                                     results=Path(out)) from None
            write(row)
            if index is not None and time.monotonic() - last_index[0] >= INDEX_EVERY_S:
                last_index[0] = time.monotonic()
                try:
                    index.write()
                except WriteError:
                    pass  # derived from the traces; the next trace or the end of the run reports a full disk
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
    except BaseException:
        if index is not None:  # a stopped or failed run still leaves an index of what it wrote
            try:
                index.write()
            except WriteError:
                pass  # the error in flight says what went wrong
        raise
    finally:
        bar.close()
    if index is not None:
        with stop.write():
            index.write()
    summary.seconds = time.perf_counter() - t0
    return summary
