"""What every benchmark loader shares, and the one validation of a question record.

A loader reads an annotation file record by record (`read_records`: JSON arrays, JSONL, parquet), turns each record
into a `Draft` with the typed field reads here (each problem a `BadRecord` naming the field and its value), and hands
it to a `Builder`, which resolves the video, refuses a duplicate id and keeps every skipped record as a `LoadIssue`.
`check_question` is how a line of M1's own question format is validated, by `m1 infer`, `m1 eval -b jsonl` and
`m1 serve` alike.
"""
from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, get_args

from pydantic import ValidationError

from m1.schema import LETTERS, MAX_QUESTION_CHARS, Question, Task


@dataclass(frozen=True)
class LoadIssue:
    """One skipped record: which one, in which file, and why."""

    record_id: str
    file: str
    reason: str

    def __str__(self) -> str:
        return f"{self.file}: {self.record_id}: {self.reason}"


class BadRecord(Exception):
    """A record-level problem; the driver turns it into a LoadIssue."""


@dataclass
class Draft:
    """What a converter extracts from one record before the video is resolved."""

    id: str
    videos: list[str]  # candidate paths relative to the videos dir, first is the canonical one
    text: str
    options: list[str]
    task: str
    answer: str | None
    meta: dict[str, Any]


# ---------------------------------------------------------------------------------------------
# shared helpers


def field_value(rec: dict, key: str, kind: type | tuple[type, ...], *, optional: bool = False) -> Any:
    """Read one field with a type check whose error names the field and the bad value."""
    if key not in rec or rec[key] is None:
        if optional:
            return None
        raise BadRecord(f"missing field {key!r}")
    value = rec[key]
    kinds = kind if isinstance(kind, tuple) else (kind,)
    # bool is an int subclass; a JSON true is never a valid index or number here
    if isinstance(value, bool) and bool not in kinds or not isinstance(value, kinds):
        names = "/".join(k.__name__ for k in kinds)
        raise BadRecord(f"field {key!r} should be {names}, got {type(value).__name__} {value!r:.80}")
    return value


def text_field(rec: dict, key: str, *, optional: bool = False) -> str | None:
    value = field_value(rec, key, str, optional=optional)
    if value is None:
        return None
    if not value.strip():
        raise BadRecord(f"field {key!r} is empty")
    return value.strip()


def str_list_field(rec: dict, key: str) -> list[str]:
    value = field_value(rec, key, list)
    if not all(isinstance(v, str) for v in value):
        raise BadRecord(f"field {key!r} should be a list of strings, got {value!r:.120}")
    return list(value)


_PREFIX = re.compile(r"^\s*\(?([A-Za-z])\s*[.):]\s*")


def strip_prefixes(options: list[str], key: str) -> list[str]:
    """Drop "A. " / "(A) " / "A:" prefixes, but only when every option carries its own letter."""
    matches = [_PREFIX.match(o) for o in options]
    if all(m and m.group(1).upper() == LETTERS[i] for i, m in enumerate(matches)):
        options = [o[m.end():] for o, m in zip(options, matches)]  # type: ignore[union-attr]
    out = [o.strip() for o in options]
    for i, o in enumerate(out):
        if not o:
            raise BadRecord(f"field {key!r}: option {LETTERS[i]} is empty")
    return out


def option_letter(value: str, n_options: int, key: str) -> str:
    """Validate an answer letter against the number of options."""
    letter = value.strip().strip("()").rstrip(".").strip().upper()
    if len(letter) != 1 or letter not in LETTERS[:n_options]:
        raise BadRecord(f"field {key!r}: answer {value!r} is not one of {', '.join(LETTERS[:n_options])}")
    return letter


def finite_number(value: Any, key: str) -> float:
    try:
        x = float(value)
    except (TypeError, ValueError):
        raise BadRecord(f"field {key!r}: {value!r:.60} is not a number") from None
    if not math.isfinite(x):
        raise BadRecord(f"field {key!r}: {value!r} is not a finite number")
    return x


def utf8_lines(path: Path, issues: list[LoadIssue]) -> Iterator[tuple[int, str]]:
    """(line number, text) of each line of a text file, each decoded on its own: a line that is not UTF-8 is
    reported by file and line and skipped, like a malformed one."""
    with path.open("rb") as fh:
        for n, raw in enumerate(fh, start=1):
            try:
                text = raw.decode("utf-8")
                yield n, text.removeprefix("\ufeff") if n == 1 else text  # a byte-order mark, as Notepad writes
            except UnicodeDecodeError as e:
                issues.append(LoadIssue(f"line {n}", str(path), f"line {n}: not UTF-8 text (byte "
                                                                 f"0x{raw[e.start]:02x} at column {e.start + 1})"))


def _read_json(path: Path, *, allow_trailing_commas: bool = False) -> Any:
    try:
        text = path.read_text(encoding="utf-8-sig")  # a leading byte-order mark is not part of the JSON
    except UnicodeDecodeError as e:
        line = path.read_bytes()[: e.start].count(b"\n") + 1
        raise ValueError(f"{path}: not UTF-8 text (line {line}: {e.reason}); save it as UTF-8") from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as first:
        if allow_trailing_commas:
            # Video-MME's official template has commas before closing brackets
            try:
                return json.loads(re.sub(r",(\s*[\]}])", r"\1", text))
            except json.JSONDecodeError:
                pass
        raise ValueError(f"{path}: not valid JSON ({first})") from None


def read_records(path: Path, issues: list[LoadIssue], *,
                 allow_trailing_commas: bool = False) -> Iterator[tuple[str, dict]]:
    """Yield (location, record) from a .json array, a .jsonl file or a .parquet table.

    The location ("#3" for the fourth array element, "line 4") names the record in an issue when
    its id cannot be read. A JSONL line that is not JSON, or a record that is not an object, is
    reported and skipped.
    """
    suffix = path.suffix.lower()
    if suffix == ".jsonl":
        for n, line in utf8_lines(path, issues):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as e:
                issues.append(LoadIssue(f"line {n}", str(path), f"line {n}: invalid JSON ({e})"))
                continue
            if not isinstance(rec, dict):
                issues.append(LoadIssue(f"line {n}", str(path),
                                        f"line {n}: expected a JSON object, got {type(rec).__name__}"))
                continue
            yield f"line {n}", rec
        return
    if suffix == ".parquet":
        try:
            import pyarrow.parquet as pq
        except ImportError:
            raise ValueError(f"{path}: reading parquet needs the 'pyarrow' package") from None
        rows: list = pq.read_table(path).to_pylist()
    elif suffix == ".json":
        rows = _read_json(path, allow_trailing_commas=allow_trailing_commas)
        if not isinstance(rows, list):
            raise ValueError(f"{path}: expected a JSON array of records, got {type(rows).__name__}")
    else:
        raise ValueError(f"{path}: unsupported annotation file type {suffix!r} (use .json, .jsonl or .parquet)")
    for i, rec in enumerate(rows):
        if not isinstance(rec, dict):
            issues.append(LoadIssue(f"#{i}", str(path), f"record #{i}: expected an object, got {type(rec).__name__}"))
            continue
        yield f"#{i}", rec


def annotation_files(annotations: Path, patterns: Iterable[str]) -> list[Path]:
    """A file is used as is; a directory contributes every file matching the patterns, sorted."""
    if not annotations.exists():
        raise FileNotFoundError(f"annotation path does not exist: {annotations}")
    if annotations.is_file():
        return [annotations]
    files = sorted({p for pat in patterns for p in annotations.glob(pat) if p.is_file()})
    if not files:
        raise FileNotFoundError(f"no annotation files matching {list(patterns)} in {annotations}")
    return files


class Builder:
    """Collects questions and issues; resolves videos and rejects duplicate ids."""

    def __init__(self, benchmark: str, videos: Path, check_videos: bool):
        self.benchmark = benchmark
        self.videos = Path(videos)
        self.check_videos = check_videos
        self.questions: list[Question] = []
        self.issues: list[LoadIssue] = []
        self._seen: dict[str, str] = {}
        if check_videos and not self.videos.is_dir():
            raise FileNotFoundError(f"videos directory does not exist: {self.videos}")

    def issue(self, record_id: str, file: Path | str, reason: str) -> None:
        self.issues.append(LoadIssue(record_id, str(file), reason))

    def add(self, draft: Draft, file: Path, where: str) -> None:
        if draft.id in self._seen:
            self.issue(draft.id, file, f"{where}: duplicate id (first seen at {self._seen[draft.id]})")
            return
        video = self._resolve(draft.videos)
        if video is None:
            tried = ", ".join(str(self.videos / v) for v in draft.videos)
            self.issue(draft.id, file, f"{where}: video file not found (tried {tried})")
            return
        try:
            q = Question(id=draft.id, video=str(video), text=draft.text, options=draft.options,
                         task=draft.task, answer=draft.answer,
                         meta={"benchmark": self.benchmark, **draft.meta})
        except ValidationError as e:
            self.issue(draft.id, file, f"{where}: {short_validation(e)}")
            return
        self._seen[draft.id] = f"{file.name} {where}"
        self.questions.append(q)

    def add_invalid(self, q: Question, file: Path, where: str) -> None:
        """A stand-in of an invalid record (`check_question`): kept, with its video resolved when it can be."""
        if q.id in self._seen:
            self.issue(q.id, file, f"{where}: duplicate id (first seen at {self._seen[q.id]})")
            return
        if q.video:
            q.video = str(self._resolve([q.video]) or self.videos / q.video)
        self._seen[q.id] = f"{file.name} {where}"
        self.questions.append(q)

    def _resolve(self, candidates: list[str]) -> Path | None:
        for rel in candidates:
            path = self.videos / rel
            if path.is_file():
                return path
        if not self.check_videos and candidates:
            return self.videos / candidates[0]
        return None

    def run(self, files: list[Path], convert: Callable[[dict, Path], Draft], **read_kw: Any) -> None:
        for file in files:
            for where, rec in read_records(file, self.issues, **read_kw):
                try:
                    draft = convert(rec, file)
                except BadRecord as e:
                    self.issue(guess_id(rec, where), file, f"{where}: {e}")
                    continue
                self.add(draft, file, where)

    def result(self) -> tuple[list[Question], list[LoadIssue]]:
        return self.questions, self.issues


def guess_id(rec: dict, where: str) -> str:
    for key in ("id", "question_id", "Question ID", "qid"):
        if isinstance(rec.get(key), (str, int)) and not isinstance(rec.get(key), bool):
            value = str(rec[key])
            if key == "Question ID" and isinstance(rec.get("video ID"), str):
                value = f"{rec['video ID']}_{value}"
            return value
    return where


def short_validation(e: ValidationError) -> str:
    parts = [f"{'.'.join(str(p) for p in err['loc']) or 'record'}: {err['msg'].removeprefix('Value error, ')}"
             for err in e.errors()]
    return "; ".join(parts)


def check_task_answer(task: str, options: list[str], answer: str | None) -> str | None:
    """Shared checks that make a Question scoreable: MCQ answers are in-range letters, a grounding
    answer is a valid `[s - e]` span, a numeric answer is a finite non-zero number (MRA divides
    by it)."""
    if task == "mcq":
        if len(options) < 2:
            raise BadRecord(f"field 'options': an mcq question needs at least 2 options, got {len(options)}")
        if answer is not None:
            return option_letter(answer, len(options), "answer")
    elif task == "grounding" and answer is not None:
        m = re.fullmatch(r"\s*\[\s*([-+0-9.eE]+)\s*-\s*([-+0-9.eE]+)\s*\]\s*", answer)
        if not m:
            raise BadRecord(f"grounding answer {answer!r} is not of the form '[s - e]'")
        s, e = finite_number(m.group(1), "answer"), finite_number(m.group(2), "answer")
        if not 0 <= s < e:
            raise BadRecord(f"grounding answer {answer!r} needs 0 <= start < end")
    elif task == "numeric" and answer is not None:
        if finite_number(answer, "answer") == 0:
            raise BadRecord("numeric answer 0 makes relative accuracy undefined")
    return answer



# ---------------------------------------------------------------------------------------------
# the one validation of a question record (m1 infer, m1 eval -b jsonl; m1 serve can call it too)

TASKS = get_args(Task)
INVALID = "m1_invalid"  # meta key of a stand-in Question: why the record is not a valid question


def _check_limits(q: Question) -> None:
    """What `m1 serve` refuses in a request is refused in a questions line too: an empty question or option, and a
    text (with its options) over MAX_QUESTION_CHARS. The option count is the Question's own check (26 letters)."""
    if not q.text.strip():
        raise BadRecord("field 'text': the question is empty")
    empty = [i for i, o in enumerate(q.options) if not o.strip()]
    if empty:
        raise BadRecord(f"field 'options': option {LETTERS[empty[0]]} is empty")
    size = len(q.text) + sum(len(o) for o in q.options)
    if size > MAX_QUESTION_CHARS:
        raise BadRecord(f"field 'text': the question and its options are {size} characters, at most {MAX_QUESTION_CHARS}")


_URL = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*://")


def local_video(value: Any) -> tuple[Any, str | None]:
    """A question's `video` as a local path: a `file://` URL is read as the path it names (as `m1 serve` reads one),
    any other URL is a problem naming the field, since videos are never fetched; other values pass unchanged."""
    if not isinstance(value, str) or not _URL.match(value):
        return value, None
    from urllib.parse import unquote, urlparse

    url = urlparse(value)
    if url.scheme.lower() != "file":
        return value, (f"field 'video': {value[:80]!r} is a {url.scheme} URL; videos are not fetched: give a local "
                       f"path or a file:///abs/path URL")
    if url.netloc not in ("", "localhost"):
        return value, f"field 'video': {value[:80]!r} names host {url.netloc!r}; only local files (file:///abs/path)"
    return unquote(url.path), None


def check_question(rec: Any) -> tuple[Question | None, str | None]:
    """Validate one question record. Returns (question, None) when it is valid; (stand-in, problem) when it is not
    but has an id, the stand-in being an unvalidated Question with `meta[INVALID] = problem` that a run writes as an
    error row, so `m1 infer` and `m1 eval` agree on the line; (None, problem) when it has no usable id (skipped by
    line). The problem names the field and its value."""
    if not isinstance(rec, dict):
        return None, f"not a JSON object ({type(rec).__name__})"
    qid = rec.get("id")
    if not isinstance(qid, str) or not qid.strip():
        return None, f"field 'id': {qid!r} is missing or empty"
    problem = None
    if "task" not in rec:  # what `--question` does: options make a choice question, none an open one
        rec = {**rec, "task": "mcq" if rec.get("options") else "open"}
    task = rec["task"]
    video, video_problem = local_video(rec.get("video"))
    if video_problem:
        problem = video_problem
    elif task not in TASKS:
        problem = f"field 'task': {task!r} is not one of {', '.join(TASKS)}"
    else:
        rec = {**rec, "video": video} if video is not None else rec
        try:
            q = Question.model_validate(rec)
            _check_limits(q)
            q.answer = check_task_answer(q.task, q.options, q.answer)
            return q, None
        except ValidationError as e:
            problem = short_validation(e)
        except BadRecord as e:
            problem = str(e)
    options = rec.get("options")
    stand_in = Question.model_construct(
        id=qid, video=str(rec.get("video") or ""), text=str(rec.get("text") or ""),
        options=[str(o) for o in options] if isinstance(options, list) else [], task=str(task),
        answer=rec.get("answer") if isinstance(rec.get("answer"), str) else None, meta={INVALID: problem})
    return stand_in, problem
