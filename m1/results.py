"""The results file of a run: one JSON line per question, what a line holds, the team that wrote it, and its shards.

Results are one JSON line per question (`result_row`), written with a single append of the whole line and flushed to
disk (`ResultsFile`); on opening, a torn last line left by a killed run is cut off, and the ids already present are
what a rerun skips. A line records a `fingerprint` of what was asked, so a rerun sees a question edited under its id.
Beside it, `<results>.team.json` records the team that wrote it (`check_team`): resuming with another team would mix
two teams' answers in one file, so it is refused with the fields that differ. `--shard i/n` splits the questions over
workers, each writing its own part, and `merge_parts` joins the parts back into one file in input order.

These live apart from running a team (m1/run.py) because the trace index, the demo, the experiment runner and the
commands read and check results files without running anything.
"""
from __future__ import annotations

import hashlib
import json
import os
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

from m1 import files
from m1.agents.parsers import answer_in_form
from m1.config import TeamConfig
from m1.data.metrics import is_correct
from m1.data.questions import InputError
from m1.data.records import INVALID
from m1.files import WriteError, write_whole
from m1.kinds.zoomer import ZOOM
from m1.locks import hold
from m1.models.tiny import spec_hash
from m1.schema import Episode, Question
from m1.signature import Signature, signature


class ResultsFile:
    """Append-only JSONL that survives being killed mid-write. `done`: the ids it lists; `failed`: those of them whose
    line records an error (a rerun answers them again and `replace`s their line, so each id stays listed once). A
    file that lists an id twice is refused on reading, naming the ids."""

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
        rows, lines = [], {}
        for n, raw in enumerate(self.path.read_bytes().splitlines(), 1):
            try:
                row = json.loads(raw.decode("utf-8"))
            except (json.JSONDecodeError, UnicodeDecodeError) as exc:
                raise InputError(f"{self.path}:{n}: not a JSON line ({exc}); fix or move the file") from None
            if not isinstance(row, dict) or "id" not in row:
                raise InputError(f"{self.path}:{n}: not a results line (no id); fix or move the file")
            rows.append(row)
            lines.setdefault(row["id"], []).append(n)
        twice = {i: ns for i, ns in lines.items() if len(ns) > 1}
        if twice:  # two results files joined: which line is the answer cannot be told, so none is scored or resumed
            named = "; ".join(f"{i!r} (lines {', '.join(map(str, ns))})" for i, ns in list(twice.items())[:5])
            raise InputError(f"{self.path}: {len(twice)} question ids have more than one line: {named}"
                             f"{'; ...' if len(twice) > 5 else ''}; a results file lists each id once (m1 writes it so; "
                             f"`m1 merge` joins shard parts): keep one line per id, or move the file")
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


# ------------------------------------------------------------------ a line

def _plan_of(ep: Episode, agent: str) -> dict:
    """The tools the agent planned first and whether that plan was written in the strict format (what the report's
    plan-choice tables count); empty for agents without a plan (single-agent kinds)."""
    rec = ep.memory.get(agent)
    gen = next((g for g in ep.generations if g.agent == agent and g.phase == "plan"), None)
    if rec is None or gen is None:
        return {}
    return {"plan": list(rec.plan), "plan_ok": gen.parse_ok}


def _zooms(ep: Episode) -> list[list[float]]:
    """[segment seconds, fps] of each executed `video_zoom` call: how long and how densely VideoZoomer looked, what
    its paper reports of its zooms (the span is the one run, its end cut to the video's; failed calls are left out)."""
    out = []
    for rec in ep.memory.values():
        for t in rec.turns:
            if t.tool == ZOOM and t.error is None and t.span is not None:
                try:
                    fps = float(json.loads(t.key_info)["fps"])
                except (ValueError, KeyError, TypeError):  # args not as the zoomer's parser writes them
                    continue
                out.append([round(t.span[1] - t.span[0], 3), round(fps, 3)])
    return out


def result_row(ep: Episode) -> dict:
    """The results line of an episode: its answer and whether it is in the exact form for the task (`answer_ok`),
    each agent's vote, timings and, with a truth, whether it is correct (the trace index shows the same
    answer/truth/correct)."""
    t = ep.timings
    per_q = t.get("batch_wall", 0.0) / max(1.0, t.get("batch_size", 1.0))
    row = {
        "id": ep.id, "video": ep.question.video, "question": ep.question.text, "task": ep.question.task,
        "answer": ep.final_answer, "answer_ok": answer_in_form(ep.final_answer, ep.question),
        "reason": ep.final_reason, "aggregation": ep.aggregation,
        "agents": {a.agent: {"answer": a.answer, "reason": a.reason, "parse_ok": a.parse_ok,
                             **_plan_of(ep, a.agent)} for a in ep.answers},
        "frames_used": ep.frames_used, "seconds": round(per_q, 3),
        "latency": {k: round(v, 4) for k, v in t.items() if k in ("llm", "vision", "tools", "decode", "open_video")},
        "error": ep.error,
    }
    if ep.note:  # an answer that stands on no frame says so
        row["note"] = ep.note
    if ep.frame_counts:  # seed kinds: frames the policy saw / tools read, turns, tool calls
        row["frame_counts"] = dict(ep.frame_counts)
        zooms = _zooms(ep)
        if zooms:
            row["zooms"] = zooms
    trimmed = [g for g in ep.generations if g.trimmed]
    if trimmed:  # prompts whose peers' notes were trimmed to fit limits.max_prompt_tokens (m1/team/budget.py)
        row["prompts_trimmed"] = {"prompts": len(trimmed), "of": len(ep.generations),
                                  "entries_left_out": sum(g.trimmed for g in trimmed)}
    if ep.usage:  # served models: tokens per agent and per tool model (m1/team/cpp.py add_usage)
        row["usage"] = ep.usage
    if ep.question.answer is not None:
        row["truth"] = ep.question.answer
        row["correct"] = is_correct(ep.question, ep.final_answer)
    return row


def invalid_row(q: Question) -> dict:
    """The error row of a question `check_question` rejected: the keys of `result_row`, the problem as `error`."""
    return {"id": q.id, "video": q.video, "question": q.text, "task": q.task, "answer": None, "answer_ok": False,
            "reason": None,
            "aggregation": None, "agents": {}, "frames_used": 0, "seconds": 0.0, "latency": {},
            "error": f"invalid question: {q.meta[INVALID]}"}


FINGERPRINT_PREFIX = "c1:"  # fingerprints over the video's content signature; older lines hold 16 bare hex digits


def _video_identity(video: str, content: bool) -> list:
    """[resolved path, size, mtime] and, with `content`, the hash of the file's blocks (m1/signature.py)."""
    try:
        path = Path(video).resolve()
        if not content:
            st = path.stat()
            return [str(path), st.st_size, st.st_mtime_ns]
        sig = signature(path)
        return [str(path), sig.size, sig.mtime_ns, sig.blocks]
    except (OSError, RuntimeError, ValueError):  # missing, a link loop: the row is an error anyway
        return [video, None, None]


def _hash(identity: list, q: Question) -> str:
    asked = [identity, q.text, q.task, list(q.options), q.answer]
    return hashlib.sha256(json.dumps(asked, ensure_ascii=False).encode()).hexdigest()[:16]


def fingerprint(q: Question, _stat: dict | None = None) -> str:
    """A short hash of what was asked: the video's content signature (resolved path, size, mtime and the hash of a
    few blocks, so a file rewritten with the same size and mtime still counts as changed) and the question's text,
    task, options and ground truth. A results line records it, so a rerun sees a question edited under its id.
    `_stat`: a cache of video path -> identity shared by the calls of one run (many questions per video)."""
    cache = {} if _stat is None else _stat
    if q.video not in cache:
        cache[q.video] = _video_identity(q.video, content=True)
    return FINGERPRINT_PREFIX + _hash(cache[q.video], q)


def changed_since(q: Question, _stat: dict) -> str | None:
    """Why the video of `q` no longer holds the content its `fingerprint` recorded earlier in this run (`_stat`, the
    same cache), or None: rewritten or replaced while it was answered, its answer may stand on two files. A file
    that went away is not counted: its reader held it open and read one content."""
    was, now = _stat.get(q.video), _video_identity(q.video, content=True)
    if was is None or now[1] is None or now == was:
        return None
    return (f"cannot read video {now[0]}: the file changed on disk during the run (was {Signature(*was[1:])}; now "
            f"{Signature(*now[1:])}); rerun to answer it from the new file")


def same_question(recorded: str | None, q: Question, current: str, _stat: dict | None = None) -> bool:
    """Whether a line's recorded fingerprint matches the question as asked now (`current`: its `fingerprint`). A
    line without one, written before fingerprints, matches; one written before content signatures is checked by
    what it recorded (path, size, mtime), so an upgrade re-answers nothing that did not change."""
    if recorded is None or recorded == current:
        return True
    if recorded.startswith(FINGERPRINT_PREFIX):
        return False
    cache = {} if _stat is None else _stat
    key = ("stat", q.video)
    if key not in cache:
        cache[key] = _video_identity(q.video, content=False)
    return recorded == _hash(cache[key], q)


# ------------------------------------------------------------------ the team that wrote it

def weight_stamp(folder: Path) -> list[list]:
    """Each file of a weights folder as [name, size, write time]: changes whenever the weights are written again."""
    return sorted([f.name, f.stat().st_size, f.stat().st_mtime_ns] for f in Path(folder).iterdir() if f.is_file())


def team_signature(cfg: TeamConfig) -> dict:
    """What decides a team's answers: its config as recorded (the settings it changes from their defaults, and the
    config version), the `weight_stamp` of each local weights (and adapter) folder, and the cache key of each tiny
    model built from a spec (it changes with the recipe and the synth tokenizer version)."""
    weights = {key: weight_stamp(Path(spec.path)) for key, spec in sorted(cfg.models.items())
               if spec.path and Path(spec.path).is_dir()}
    adapters = {key: weight_stamp(Path(spec.adapter)) for key, spec in sorted(cfg.models.items())
                if spec.adapter and Path(spec.adapter).is_dir()}
    tiny = {key: spec_hash(spec.tiny) for key, spec in sorted(cfg.models.items()) if spec.tiny is not None}
    return {"config": cfg.recorded(), "weights": weights, "adapters": adapters, "tiny": tiny}


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
    otherwise InputError names the differing fields. Answers without a record are refused the same way (their team
    cannot be told). Then the signature of `cfg` is recorded beside it.
    """
    results = Path(results)
    stamp = results.with_name(results.name + ".team.json")
    sig = team_signature(cfg)
    if results.is_file() and results.stat().st_size:
        problem = None
        if not stamp.is_file():
            problem = (f"{results} holds answers but not the team record beside it ({stamp.name}), so which team "
                       f"wrote them cannot be told and resuming could mix two teams: use another --out, or move the "
                       f"file to answer every question again")
        else:
            try:
                old = json.loads(stamp.read_text())
            except (json.JSONDecodeError, UnicodeDecodeError) as exc:
                raise InputError(f"{stamp}: not the JSON team record M1 writes beside {results.name} ({exc}); "
                                 f"without it the answers cannot be checked against this team: delete it only if "
                                 f"they are") from None
            if old != sig:
                a, b = _flat(old), _flat(sig)
                diff = sorted(k for k in a.keys() | b.keys() if a.get(k) != b.get(k))
                problem = (f"{results} holds answers of another team (differs in {', '.join(diff[:5])}"
                           f"{', ...' if len(diff) > 5 else ''}); resuming would mix two teams: use another --out or "
                           f"move the file")
        if problem and not restart:
            raise InputError(problem)
        if problem:
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


def record_split(out: Path, questions: list[Question], n: int) -> None:
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


def _split_of(out: Path) -> tuple[Path, int, list[str]]:
    """The manifest of the sharded run into `out`: its path, the number of parts and every id in input order."""
    manifest = shards_manifest(out)
    if not manifest.is_file():
        found = sorted(p.name for p in out.parent.glob(f"{out.name}.part-*-of-*.jsonl"))
        raise InputError(f"{manifest}: no record of a sharded run into {out}"
                         + (f" (found {', '.join(found)}, but not the manifest their workers write)" if found else
                            "; run the workers first: m1 infer ... --out " + f"{out} --shard i/n"))
    split = json.loads(manifest.read_text())
    return manifest, int(split["n"]), list(split["ids"])


def _refuse_absent(out: Path, parts: list[Path], ids: list[str]) -> None:
    """InputError naming each missing part, the ids it should hold and the worker that writes it."""
    n = len(parts)
    absent = [i for i, p in enumerate(parts) if not p.is_file()]
    if not absent:
        return

    def share(i: int) -> str:
        mine = ids[i::n]
        more = f", ... ({len(mine)} in all)" if len(mine) > 5 else ""
        return f"{parts[i].name} (ids {', '.join(map(repr, mine[:5]))}{more})"

    raise InputError(f"cannot merge into {out}: {'; '.join(share(i) for i in absent)} missing; run those workers "
                     f"({', '.join(f'--shard {i}/{n}' for i in absent)}) first")


def _part_lines(parts: list[Path], ids: list[str], manifest: Path) -> tuple[dict[str, tuple[str, int]], list[str]]:
    """Each id's line and the index of the part it is in (a worker's torn last line cut first), and what is wrong
    with the parts' lines: an id listed twice, in two parts, outside its part's share, or missing from it."""
    n = len(parts)
    problems: list[str] = []
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
    return lines, problems


def _part_teams(parts: list[Path]) -> tuple[list[dict | None], list[str]]:
    """The team record beside each part (None: none), and a problem for each part written by another team than the
    first part's."""
    stamps = [p.with_name(p.name + ".team.json") for p in parts]
    sigs = [json.loads(t.read_text()) if t.is_file() else None for t in stamps]
    problems: list[str] = []
    for i in range(1, len(parts)):
        if sigs[i] != sigs[0] and sigs[i] is not None and sigs[0] is not None:
            a, b = _flat(sigs[0]), _flat(sigs[i])
            diff = sorted(k for k in a.keys() | b.keys() if a.get(k) != b.get(k))
            problems.append(f"parts disagree: {parts[0].name} and {parts[i].name} were written by different "
                            f"teams (differ in {', '.join(diff[:5])})")
    return sigs, problems


def _write_merged(out: Path, data: bytes, n: int) -> bool:
    """Write the merge whole into `out`; True when `out` already held exactly it. Refused when `out` holds results
    that are not this merge."""
    if not (out.is_file() and out.stat().st_size):
        write_whole(out, data)
        return False
    if out.read_bytes() == data:
        return True
    raise InputError(f"{out} already holds {len(out.read_text().splitlines())} results that are not "
                     f"this merge of {n} parts; move it or merge into another file")


def merge_parts(out: Path, delete_parts: bool = False) -> MergeSummary:
    """Join `<out>.part-i-of-n.jsonl` into `out`: every id of the split exactly once, in input order.

    Refused (InputError naming the parts and ids) if a part is missing, still being written (its lock),
    lacks ids, holds ids that are not its own or that another part also holds, or was written by
    another team. `out` is written whole (temporary file renamed); if it already exists it must hold
    exactly this merge. The parts stay unless `delete_parts`."""
    out = Path(out)
    manifest, n, ids = _split_of(out)
    parts = [part_path(out, i, n) for i in range(n)]
    _refuse_absent(out, parts, ids)
    with ExitStack() as locks:
        for p in parts:
            locks.enter_context(hold(p, "part file", "wait for that worker to finish, then merge"))
        locks.enter_context(hold(out, "results file", "wait for it to finish, or merge into another file"))
        lines, problems = _part_lines(parts, ids, manifest)
        sigs, disagree = _part_teams(parts)
        problems += disagree
        if problems:
            raise InputError(f"cannot merge into {out}:\n" + "\n".join(f"  - {x}" for x in problems))
        summary = MergeSummary(out=out, rows=len(ids), parts=parts)
        summary.already = _write_merged(out, "".join(lines[x][0] + "\n" for x in ids).encode(), n)
        if sigs[0] is not None:
            write_whole(out.with_name(out.name + ".team.json"), json.dumps(sigs[0], indent=1).encode())
        if delete_parts:
            for p in parts:
                p.unlink(missing_ok=True)
                p.with_name(p.name + ".team.json").unlink(missing_ok=True)
            manifest.unlink(missing_ok=True)
            summary.deleted = True
    return summary
