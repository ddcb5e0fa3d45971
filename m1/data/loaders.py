"""Benchmark loaders: published annotation files -> `m1.schema.Question` records.

Every loader returns `(questions, issues)`. A record that cannot be mapped faithfully (a missing
field, an answer outside the options, a video file that is not there, a duplicate id) becomes a
`LoadIssue` and is skipped, so one bad line never hides the rest of a benchmark. Only problems
with the whole input (a missing annotation path, a file that is not JSON at all) raise.

Conventions shared by all loaders (the field names and encodings are those of each benchmark's published
annotation files):
- `Question.video` is the resolved path of the video file as a string.
- `Question.options` are the option texts without any "A. " / "(A) " prefix; `Question.answer`
  is the option letter for MCQ, `"[s - e]"` in seconds for grounding, and the number as written
  for numeric questions. A test split without ground truth loads with `answer=None`.
- `Question.meta["benchmark"]` names the loader; the other meta keys keep the benchmark's own
  names for its groupings (duration group, task type, question type, ...), which is what
  `m1.data.metrics.score_benchmark` groups by.
"""
from __future__ import annotations

import csv
import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, get_args

from pydantic import ValidationError

from m1.text import format_span as format_answer_span
from m1.schema import LETTERS, MAX_QUESTION_CHARS, Question, Task


@dataclass(frozen=True)
class LoadIssue:
    """One skipped record: which one, in which file, and why."""

    record_id: str
    file: str
    reason: str

    def __str__(self) -> str:
        return f"{self.file}: {self.record_id}: {self.reason}"


class _Bad(Exception):
    """A record-level problem; the driver turns it into a LoadIssue."""


@dataclass
class _Draft:
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


def _field(rec: dict, key: str, kind: type | tuple[type, ...], *, optional: bool = False) -> Any:
    """Read one field with a type check whose error names the field and the bad value."""
    if key not in rec or rec[key] is None:
        if optional:
            return None
        raise _Bad(f"missing field {key!r}")
    value = rec[key]
    kinds = kind if isinstance(kind, tuple) else (kind,)
    # bool is an int subclass; a JSON true is never a valid index or number here
    if isinstance(value, bool) and bool not in kinds or not isinstance(value, kinds):
        names = "/".join(k.__name__ for k in kinds)
        raise _Bad(f"field {key!r} should be {names}, got {type(value).__name__} {value!r:.80}")
    return value


def _text(rec: dict, key: str, *, optional: bool = False) -> str | None:
    value = _field(rec, key, str, optional=optional)
    if value is None:
        return None
    if not value.strip():
        raise _Bad(f"field {key!r} is empty")
    return value.strip()


def _str_list(rec: dict, key: str) -> list[str]:
    value = _field(rec, key, list)
    if not all(isinstance(v, str) for v in value):
        raise _Bad(f"field {key!r} should be a list of strings, got {value!r:.120}")
    return list(value)


_PREFIX = re.compile(r"^\s*\(?([A-Za-z])\s*[.):]\s*")


def _strip_prefixes(options: list[str], key: str) -> list[str]:
    """Drop "A. " / "(A) " / "A:" prefixes, but only when every option carries its own letter."""
    matches = [_PREFIX.match(o) for o in options]
    if all(m and m.group(1).upper() == LETTERS[i] for i, m in enumerate(matches)):
        options = [o[m.end():] for o, m in zip(options, matches)]  # type: ignore[union-attr]
    out = [o.strip() for o in options]
    for i, o in enumerate(out):
        if not o:
            raise _Bad(f"field {key!r}: option {LETTERS[i]} is empty")
    return out


def _letter(value: str, n_options: int, key: str) -> str:
    """Validate an answer letter against the number of options."""
    letter = value.strip().strip("()").rstrip(".").strip().upper()
    if len(letter) != 1 or letter not in LETTERS[:n_options]:
        raise _Bad(f"field {key!r}: answer {value!r} is not one of {', '.join(LETTERS[:n_options])}")
    return letter


def _finite(value: Any, key: str) -> float:
    try:
        x = float(value)
    except (TypeError, ValueError):
        raise _Bad(f"field {key!r}: {value!r:.60} is not a number") from None
    if not math.isfinite(x):
        raise _Bad(f"field {key!r}: {value!r} is not a finite number")
    return x


def format_span(start: float, end: float) -> str:
    """The grounding answer format used across M1: `[s - e]` in seconds."""
    return format_answer_span((start, end))


def _utf8_lines(path: Path, issues: list[LoadIssue]) -> Iterator[tuple[int, str]]:
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


def _records(path: Path, issues: list[LoadIssue], *,
             allow_trailing_commas: bool = False) -> Iterator[tuple[str, dict]]:
    """Yield (location, record) from a .json array, a .jsonl file or a .parquet table.

    The location ("#3" for the fourth array element, "line 4") names the record in an issue when
    its id cannot be read. A JSONL line that is not JSON, or a record that is not an object, is
    reported and skipped.
    """
    suffix = path.suffix.lower()
    if suffix == ".jsonl":
        for n, line in _utf8_lines(path, issues):
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


def _annotation_files(annotations: Path, patterns: Iterable[str]) -> list[Path]:
    """A file is used as is; a directory contributes every file matching the patterns, sorted."""
    if not annotations.exists():
        raise FileNotFoundError(f"annotation path does not exist: {annotations}")
    if annotations.is_file():
        return [annotations]
    files = sorted({p for pat in patterns for p in annotations.glob(pat) if p.is_file()})
    if not files:
        raise FileNotFoundError(f"no annotation files matching {list(patterns)} in {annotations}")
    return files


class _Builder:
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

    def add(self, draft: _Draft, file: Path, where: str) -> None:
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
            self.issue(draft.id, file, f"{where}: {_short_validation(e)}")
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

    def run(self, files: list[Path], convert: Callable[[dict, Path], _Draft], **read_kw: Any) -> None:
        for file in files:
            for where, rec in _records(file, self.issues, **read_kw):
                try:
                    draft = convert(rec, file)
                except _Bad as e:
                    self.issue(_guess_id(rec, where), file, f"{where}: {e}")
                    continue
                self.add(draft, file, where)

    def result(self) -> tuple[list[Question], list[LoadIssue]]:
        return self.questions, self.issues


def _guess_id(rec: dict, where: str) -> str:
    for key in ("id", "question_id", "Question ID", "qid"):
        if isinstance(rec.get(key), (str, int)) and not isinstance(rec.get(key), bool):
            value = str(rec[key])
            if key == "Question ID" and isinstance(rec.get("video ID"), str):
                value = f"{rec['video ID']}_{value}"
            return value
    return where


def _short_validation(e: ValidationError) -> str:
    parts = [f"{'.'.join(str(p) for p in err['loc']) or 'record'}: {err['msg'].removeprefix('Value error, ')}"
             for err in e.errors()]
    return "; ".join(parts)


def _check_task_answer(task: str, options: list[str], answer: str | None) -> str | None:
    """Shared checks that make a Question scoreable: MCQ answers are in-range letters, a grounding
    answer is a valid `[s - e]` span, a numeric answer is a finite non-zero number (MRA divides
    by it)."""
    if task == "mcq":
        if len(options) < 2:
            raise _Bad(f"field 'options': an mcq question needs at least 2 options, got {len(options)}")
        if answer is not None:
            return _letter(answer, len(options), "answer")
    elif task == "grounding" and answer is not None:
        m = re.fullmatch(r"\s*\[\s*([-+0-9.eE]+)\s*-\s*([-+0-9.eE]+)\s*\]\s*", answer)
        if not m:
            raise _Bad(f"grounding answer {answer!r} is not of the form '[s - e]'")
        s, e = _finite(m.group(1), "answer"), _finite(m.group(2), "answer")
        if not 0 <= s < e:
            raise _Bad(f"grounding answer {answer!r} needs 0 <= start < end")
    elif task == "numeric" and answer is not None:
        if _finite(answer, "answer") == 0:
            raise _Bad("numeric answer 0 makes relative accuracy undefined")
    return answer


# ---------------------------------------------------------------------------------------------
# LongVideoBench


def _lvb_convert(rec: dict, file: Path) -> _Draft:
    qid = str(_field(rec, "id", (str, int)))
    video_id = _text(rec, "video_id")
    if "candidates" in rec:
        options = _str_list(rec, "candidates")
    else:  # the HF rows spell the options out as option0..option4, "N/A" when absent
        options = [rec[f"option{i}"] for i in range(5)
                   if isinstance(rec.get(f"option{i}"), str) and rec[f"option{i}"] != "N/A"]
        if not options:
            raise _Bad("missing field 'candidates' (and no option0..option4)")
    options = _strip_prefixes(options, "candidates")
    if not 2 <= len(options) <= 5:
        raise _Bad(f"field 'candidates' should hold 4 or 5 options, got {len(options)}")
    choice = _field(rec, "correct_choice", int, optional=True)  # absent on the test split
    answer = None
    if choice is not None:
        if not 0 <= choice < len(options):
            raise _Bad(f"field 'correct_choice' {choice} is outside 0..{len(options) - 1}")
        answer = LETTERS[choice]
    video_path = _text(rec, "video_path", optional=True) or f"{video_id}.mp4"
    meta_keys = ("video_id", "duration_group", "question_category", "topic_category", "level", "type",
                 "duration", "position", "subtitle_path", "starting_timestamp_for_subtitles",
                 "question_wo_referring_query", "view_count")
    meta = {k: rec[k] for k in meta_keys if k in rec}
    return _Draft(qid, [video_path, f"videos/{video_path}"], _text(rec, "question"), options, "mcq",
                  _check_task_answer("mcq", options, answer), meta)


def load_longvideobench(annotations: Path, videos: Path, *, check_videos: bool = True):
    """`lvb_val.json` / `lvb_test_wo_gt.json` (JSON array), or the same rows as .jsonl/.parquet.

    `correct_choice` is 0-based; the letter is `LETTERS[i]`. Videos: `<videos>/<video_path>`.
    """
    b = _Builder("longvideobench", videos, check_videos)
    b.run(_annotation_files(Path(annotations), ["lvb_*.json", "*.jsonl", "*.parquet"]), _lvb_convert)
    return b.result()


# ---------------------------------------------------------------------------------------------
# Video-MME

_VIDEOMME_VIDEO_KEYS = ("video_id", "duration", "domain", "sub_category", "url", "videoID")


def _videomme_rows(rec: dict) -> list[dict]:
    """Flatten the official per-video layout (questions nested under `questions`) to HF rows."""
    if isinstance(rec.get("questions"), list):
        shared = {k: rec[k] for k in _VIDEOMME_VIDEO_KEYS if k in rec}
        return [{**shared, **q} if isinstance(q, dict) else q for q in rec["questions"]]
    return [rec]


def _videomme_convert(rec: dict, file: Path) -> _Draft:
    qid = str(_field(rec, "question_id", (str, int)))
    youtube_id = _text(rec, "videoID")
    options = _strip_prefixes(_str_list(rec, "options"), "options")
    answer = _text(rec, "answer", optional=True)
    if answer is not None:
        answer = _letter(answer, len(options), "answer")
    duration = _text(rec, "duration")
    if duration not in ("short", "medium", "long"):
        raise _Bad(f"field 'duration' should be short/medium/long, got {duration!r}")
    names = [f"{youtube_id}{ext}" for ext in (".mp4", ".MP4", ".mkv")]
    meta = {k: rec[k] for k in ("video_id", "videoID", "duration", "domain", "sub_category", "task_type", "url")
            if k in rec}
    return _Draft(qid, names + [f"data/{n}" for n in names], _text(rec, "question"), options, "mcq",
                  _check_task_answer("mcq", options, answer), meta)


def load_videomme(annotations: Path, videos: Path, *, check_videos: bool = True):
    """HF `lmms-lab/Video-MME` rows (.parquet/.json/.jsonl) or the official nested template.

    Options arrive prefixed "A. "; the prefix is removed. Videos: `<videos>/<videoID>.mp4`
    (also `.MP4`, `.mkv`, and the same under `data/`). `meta["duration"]` is short/medium/long.
    """
    b = _Builder("videomme", videos, check_videos)
    for file in _annotation_files(Path(annotations), ["*.json", "*.jsonl", "*.parquet"]):
        for where, rec in _records(file, b.issues, allow_trailing_commas=True):
            rows = _videomme_rows(rec)
            for j, row in enumerate(rows):
                at = where if len(rows) == 1 and row is rec else f"{where}.questions[{j}]"
                if not isinstance(row, dict):
                    b.issue(at, file, f"{at}: expected an object, got {type(row).__name__}")
                    continue
                try:
                    draft = _videomme_convert(row, file)
                except _Bad as e:
                    b.issue(_guess_id(row, at), file, f"{at}: {e}")
                    continue
                b.add(draft, file, at)
    return b.result()


# ---------------------------------------------------------------------------------------------
# MLVU

_MLVU_GENERATION = {"subPlot", "summary", "sub_scene", "SSC", "VS"}
_OPTION_LINE = re.compile(r"^\s*\(A\)\s", re.M)


def _mlvu_id(rec: dict, file: Path, where: str) -> str:
    """`question_id` when given (lmms-eval rows), else `<file stem>_<index>` (official files)."""
    qid = rec.get("question_id")
    if isinstance(qid, (str, int)) and not isinstance(qid, bool):
        return str(qid)
    return f"{file.stem}_{where.lstrip('#').replace('line ', 'L')}"


def _mlvu_convert(rec: dict, file: Path, where: str) -> _Draft:
    task_type = _text(rec, "task_type", optional=True) or _text(rec, "question_type")
    video = _text(rec, "video_name", optional=True) or _text(rec, "video")
    question = _text(rec, "question")
    stem = re.sub(r"^\d+_", "", file.stem)
    qid = _mlvu_id(rec, file, where)
    meta: dict[str, Any] = {"task_type": task_type}
    for key in ("question_type", "duration", "scoring_points"):
        if key in rec:
            meta[key] = rec[key]
    videos = [f"{task_type}/{video}", f"{stem}/{video}", video]
    answer = _field(rec, "answer", (str, int), optional=True)
    if "candidates" not in rec or rec["candidates"] in (None, []):
        if task_type not in _MLVU_GENERATION and stem not in _MLVU_GENERATION:
            raise _Bad(f"missing field 'candidates' for multiple-choice task {task_type!r}")
        return _Draft(qid, videos, question, [], "open", None if answer is None else str(answer), meta)
    options = _strip_prefixes(_str_list(rec, "candidates"), "candidates")
    # the lmms-eval copy repeats the options inside `question` as "(A) ..." lines
    m = _OPTION_LINE.search(question)
    if m and m.start() > 0:
        question = question[:m.start()].strip()
    if answer is not None:
        answer = str(answer)
        if answer in options:  # the official files give the option text
            answer = LETTERS[options.index(answer)]
        elif answer.strip() in options:
            answer = LETTERS[options.index(answer.strip())]
        else:
            try:
                answer = _letter(answer, len(options), "answer")
            except _Bad:
                raise _Bad(f"field 'answer' {answer!r:.80} is neither one of the candidates nor a letter") from None
    return _Draft(qid, videos, question, options, "mcq", _check_task_answer("mcq", options, answer), meta)


def load_mlvu(annotations: Path, videos: Path, *, check_videos: bool = True):
    """Official MLVU `json/<k>_<task>.json` files (a file or the folder) or the lmms-eval rows.

    The official answer is an option text, converted to its letter; ids are `<file stem>_<index>`
    unless a `question_id` is given. Videos: `<videos>/<task type>/<video>`, or
    `<videos>/<file stem without the number>/<video>`, else `<videos>/<video>`. Generation tasks
    (subPlot, summary) load as task "open" with the reference text as answer.
    """
    b = _Builder("mlvu", videos, check_videos)
    for file in _annotation_files(Path(annotations), ["*.json", "*.jsonl", "*.parquet"]):
        for where, rec in _records(file, b.issues):
            try:
                draft = _mlvu_convert(rec, file, where)
            except _Bad as e:
                b.issue(_mlvu_id(rec, file, where), file, f"{where}: {e}")
                continue
            b.add(draft, file, where)
    return b.result()


# ---------------------------------------------------------------------------------------------
# Charades-STA

_STA_LINE = re.compile(r"^(\S+) (\S+) (\S+)##(.*)$")


def _charades_lengths(csv_path: Path, b: _Builder) -> dict[str, float]:
    """`length` (seconds) per video id from `Charades_v1_<split>.csv`."""
    lengths: dict[str, float] = {}
    with csv_path.open(encoding="utf-8", newline="") as fh:
        reader = csv.DictReader(fh)
        if not reader.fieldnames or "id" not in reader.fieldnames or "length" not in reader.fieldnames:
            raise ValueError(f"{csv_path}: expected columns 'id' and 'length', got {reader.fieldnames}")
        for row in reader:
            try:
                lengths[row["id"]] = _finite(row["length"], "length")
            except _Bad as e:
                b.issue(row.get("id") or "?", csv_path, str(e))
    return lengths


def _find_charades_csv(annotations: Path, txt: Path) -> Path | None:
    split = re.search(r"(train|test)", txt.name)
    folder = annotations if annotations.is_dir() else txt.parent
    pattern = f"Charades_v1_{split.group(1)}*.csv" if split else "Charades_v1_*.csv"
    found = sorted(folder.glob(pattern), key=lambda p: (len(p.name), p.name))  # exact name first
    return found[0] if found else None


def load_charades_sta(annotations: Path, videos: Path, *, lengths_csv: Path | None = None,
                      check_videos: bool = True):
    """`charades_sta_{train,test}.txt`: one `<vid> <start> <end>##<sentence>` per line.

    `annotations` is the txt file, or a folder holding exactly one `charades_sta_*.txt`. Video
    lengths come from `lengths_csv` or a `Charades_v1_<split>*.csv` beside the txt (optional).
    The ground truth is kept as annotated, even past the video end (`meta["end_past_video"]`);
    lines with start >= end are reported. The question text is the sentence without its final
    period; ids are `<vid>_<line number>`, since one moment often has several sentences.
    """
    annotations = Path(annotations)
    files = _annotation_files(annotations, ["charades_sta_*.txt"])
    if len(files) != 1:
        raise ValueError(f"{annotations}: expected one charades_sta_*.txt, found {[f.name for f in files]}")
    txt = files[0]
    b = _Builder("charades_sta", videos, check_videos)
    csv_path = Path(lengths_csv) if lengths_csv else _find_charades_csv(annotations, txt)
    lengths = _charades_lengths(csv_path, b) if csv_path else {}
    for n, line in _utf8_lines(txt, b.issues):
        line = line.rstrip("\r\n")
        if not line.strip():
            continue
        where = f"line {n}"
        m = _STA_LINE.match(line)
        if not m:
            b.issue(where, txt, f"{where}: expected '<vid> <start> <end>##<sentence>', got {line!r:.80}")
            continue
        vid, s, e, sentence = m.groups()
        qid = f"{vid}_{n}"
        try:
            start, end = _finite(s, "start"), _finite(e, "end")
            if not 0 <= start < end:
                raise _Bad(f"start {start} and end {end} need 0 <= start < end")
            query = sentence.strip().rstrip(".").strip()
            if not query:
                raise _Bad("empty sentence")
        except _Bad as err:
            b.issue(qid, txt, f"{where}: {err}")
            continue
        meta: dict[str, Any] = {"video_id": vid, "start": start, "end": end, "sentence": sentence,
                                "line": n, "duration": lengths.get(vid)}
        if vid in lengths:
            meta["end_past_video"] = end > lengths[vid]
        b.add(_Draft(qid, [f"{vid}.mp4", f"Charades_v1_480/{vid}.mp4"], query, [], "grounding",
                     format_span(start, end), meta), txt, where)
    return b.result()


# ---------------------------------------------------------------------------------------------
# VSI-Bench

VSI_MCA_TYPES = ("object_rel_direction_easy", "object_rel_direction_medium", "object_rel_direction_hard",
                 "object_rel_distance", "route_planning", "obj_appearance_order")
VSI_NA_TYPES = ("object_counting", "object_abs_distance", "object_size_estimation", "room_size_estimation")


def _vsi_convert(rec: dict, file: Path) -> _Draft:
    qid = str(_field(rec, "id", (str, int)))
    dataset = _text(rec, "dataset")
    scene = _text(rec, "scene_name")
    qtype = _text(rec, "question_type")
    gt = _field(rec, "ground_truth", (str, int, float), optional=True)
    raw_options = rec.get("options")
    meta = {"dataset": dataset, "scene_name": scene, "question_type": qtype}
    videos = [f"{dataset}/{scene}.mp4", f"{scene}.mp4"]
    numeric = qtype in VSI_NA_TYPES or (qtype not in VSI_MCA_TYPES and not raw_options)
    if numeric:
        if raw_options:
            raise _Bad(f"numeric question type {qtype!r} should have no options, got {raw_options!r:.80}")
        answer = None if gt is None else str(gt).strip()
        return _Draft(qid, videos, _text(rec, "question"), [], "numeric",
                      _check_task_answer("numeric", [], answer), {**meta, "category": "NA"})
    if raw_options is not None and not isinstance(raw_options, list):
        raw_options = list(raw_options)  # parquet may hand back an array type
    options = _strip_prefixes(_str_list({"options": raw_options}, "options"), "options")
    answer = None
    if gt is not None:
        gt = str(gt).strip()
        answer = LETTERS[options.index(gt)] if gt in options else _letter(gt, len(options), "ground_truth")
    return _Draft(qid, videos, _text(rec, "question"), options, "mcq",
                  _check_task_answer("mcq", options, answer), {**meta, "category": "MCA"})


def load_vsibench(annotations: Path, videos: Path, *, check_videos: bool = True):
    """HF `nyu-visionx/VSI-Bench` rows (.parquet/.json/.jsonl).

    Multiple-choice types load as "mcq" (options without "A. "), the four measurement types as
    "numeric" with the ground truth as written. Videos: `<videos>/<dataset>/<scene_name>.mp4`.
    """
    b = _Builder("vsibench", videos, check_videos)
    b.run(_annotation_files(Path(annotations), ["*.parquet", "*.json", "*.jsonl"]), _vsi_convert)
    return b.result()


# ---------------------------------------------------------------------------------------------
# Video-Holmes


def _holmes_convert(rec: dict, file: Path) -> _Draft:
    video_id = _text(rec, "video ID")
    number = _field(rec, "Question ID", (int, str))
    qid = f"{video_id}_{number}"
    opts = _field(rec, "Options", dict)
    keys = sorted(opts)
    if keys != list(LETTERS[:len(keys)]) or len(keys) < 2:
        raise _Bad(f"field 'Options' keys should be A, B, ... in sequence, got {keys}")
    options = [opts[k] for k in keys]
    if not all(isinstance(o, str) and o.strip() for o in options):
        raise _Bad("field 'Options' holds an empty or non-text option")
    options = [o.strip() for o in options]
    answer = _text(rec, "Answer", optional=True)
    if answer is not None:
        answer = _letter(answer, len(options), "Answer")
    meta = {"video_id": video_id, "question_number": number,
            "question_type": _text(rec, "Question Type")}
    if isinstance(rec.get("Explanation"), str):
        meta["explanation"] = rec["Explanation"]
    return _Draft(qid, [f"{video_id}.mp4", f"videos_cropped/{video_id}.mp4"], _text(rec, "Question"),
                  options, "mcq", _check_task_answer("mcq", options, answer), meta)


def load_video_holmes(annotations: Path, videos: Path, *, check_videos: bool = True):
    """`test_Video-Holmes.json` (or a folder of such JSON files): keys with spaces, options as a
    dict A..F. Ids are `<video ID>_<Question ID>`; videos `<videos>/<video ID>.mp4`."""
    b = _Builder("video_holmes", videos, check_videos)
    b.run(_annotation_files(Path(annotations), ["*.json", "*.jsonl"]), _holmes_convert)
    return b.result()


# ---------------------------------------------------------------------------------------------
# generic JSONL of Question records


def load_jsonl(annotations: Path, videos: Path, *, check_videos: bool = True, invalid_rows: bool = False):
    """One `m1.schema.Question` object per line, `video` relative to the videos dir.

    A line that is not JSON, has no id or fails `check_question` is reported with its line number and skipped;
    with `invalid_rows` (`m1 eval`), one that fails it but has an id is returned as a stand-in that the run writes
    as an error row, as `m1 infer` does for the same line.
    """
    path = Path(annotations)
    if path.is_dir():
        raise ValueError(f"{path}: is a folder; the jsonl benchmark needs its annotation file")
    if not path.is_file():
        raise FileNotFoundError(f"annotation file does not exist: {path}")
    b = _Builder("jsonl", videos, check_videos)
    for where, rec in _records(path, b.issues):
        q, problem = check_question(rec)
        if q is None or (problem and not invalid_rows):
            b.issue(_guess_id(rec, where), path, f"{where}: {problem}")
        elif problem:  # an error row, as `m1 infer` writes for the same line
            b.add_invalid(q, path, where)
        else:
            meta = {k: v for k, v in q.meta.items() if k != "benchmark"}
            b.add(_Draft(q.id, [q.video], q.text, q.options, q.task, q.answer, meta), path, where)
    return b.result()


# ---------------------------------------------------------------------------------------------
# the one validation of a question record (m1 infer, m1 eval -b jsonl; m1 serve can call it too)

TASKS = get_args(Task)
INVALID = "m1_invalid"  # meta key of a stand-in Question: why the record is not a valid question


def _check_limits(q: Question) -> None:
    """What `m1 serve` refuses in a request is refused in a questions line too: an empty question or option, and a
    text (with its options) over MAX_QUESTION_CHARS. The option count is the Question's own check (26 letters)."""
    if not q.text.strip():
        raise _Bad("field 'text': the question is empty")
    empty = [i for i, o in enumerate(q.options) if not o.strip()]
    if empty:
        raise _Bad(f"field 'options': option {LETTERS[empty[0]]} is empty")
    size = len(q.text) + sum(len(o) for o in q.options)
    if size > MAX_QUESTION_CHARS:
        raise _Bad(f"field 'text': the question and its options are {size} characters, at most {MAX_QUESTION_CHARS}")


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
    task = rec.get("task", "mcq")
    if task not in TASKS:
        problem = f"field 'task': {task!r} is not one of {', '.join(TASKS)}"
    else:
        try:
            q = Question.model_validate(rec)
            _check_limits(q)
            q.answer = _check_task_answer(q.task, q.options, q.answer)
            return q, None
        except ValidationError as e:
            problem = _short_validation(e)
        except _Bad as e:
            problem = str(e)
    options = rec.get("options")
    stand_in = Question.model_construct(
        id=qid, video=str(rec.get("video") or ""), text=str(rec.get("text") or ""),
        options=[str(o) for o in options] if isinstance(options, list) else [], task=str(task),
        answer=rec.get("answer") if isinstance(rec.get("answer"), str) else None, meta={INVALID: problem})
    return stand_in, problem


# ---------------------------------------------------------------------------------------------

LOADERS: dict[str, Callable[..., tuple[list[Question], list[LoadIssue]]]] = {
    "longvideobench": load_longvideobench,
    "videomme": load_videomme,
    "mlvu": load_mlvu,
    "charades_sta": load_charades_sta,
    "vsibench": load_vsibench,
    "video_holmes": load_video_holmes,
    "jsonl": load_jsonl,
}


def load_benchmark(name: str, annotations: Path | str, videos: Path | str, **options: Any
                   ) -> tuple[list[Question], list[LoadIssue]]:
    """Load one benchmark by name; `options` go to its loader (`check_videos`, `lengths_csv`)."""
    key = name.lower().replace("-", "_")
    if key not in LOADERS:
        raise ValueError(f"unknown benchmark {name!r}; choose one of {', '.join(LOADERS)}")
    return LOADERS[key](Path(annotations), Path(videos), **options)
