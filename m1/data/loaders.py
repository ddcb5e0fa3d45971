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
import re
from pathlib import Path
from typing import Any, Callable

from m1.data.records import (BadRecord, Builder, Draft, LoadIssue, annotation_files, check_question,
                             check_task_answer, field_value, finite_number, guess_id, option_letter, read_records,
                             str_list_field, strip_prefixes, text_field, utf8_lines)
from m1.schema import LETTERS, Question
from m1.text import format_span as format_answer_span


def format_span(start: float, end: float) -> str:
    """The grounding answer format used across M1: `[s - e]` in seconds."""
    return format_answer_span((start, end))


# ---------------------------------------------------------------------------------------------
# LongVideoBench


def _lvb_convert(rec: dict, file: Path) -> Draft:
    qid = str(field_value(rec, "id", (str, int)))
    video_id = text_field(rec, "video_id")
    if "candidates" in rec:
        options = str_list_field(rec, "candidates")
    else:  # the HF rows spell the options out as option0..option4, "N/A" when absent
        options = [rec[f"option{i}"] for i in range(5)
                   if isinstance(rec.get(f"option{i}"), str) and rec[f"option{i}"] != "N/A"]
        if not options:
            raise BadRecord("missing field 'candidates' (and no option0..option4)")
    options = strip_prefixes(options, "candidates")
    if not 2 <= len(options) <= 5:
        raise BadRecord(f"field 'candidates' should hold 4 or 5 options, got {len(options)}")
    choice = field_value(rec, "correct_choice", int, optional=True)  # absent on the test split
    answer = None
    if choice is not None:
        if not 0 <= choice < len(options):
            raise BadRecord(f"field 'correct_choice' {choice} is outside 0..{len(options) - 1}")
        answer = LETTERS[choice]
    video_path = text_field(rec, "video_path", optional=True) or f"{video_id}.mp4"
    meta_keys = ("video_id", "duration_group", "question_category", "topic_category", "level", "type",
                 "duration", "position", "subtitle_path", "starting_timestamp_for_subtitles",
                 "question_wo_referring_query", "view_count")
    meta = {k: rec[k] for k in meta_keys if k in rec}
    return Draft(qid, [video_path, f"videos/{video_path}"], text_field(rec, "question"), options, "mcq",
                 check_task_answer("mcq", options, answer), meta)


def load_longvideobench(annotations: Path, videos: Path, *, check_videos: bool = True):
    """`lvb_val.json` / `lvb_test_wo_gt.json` (JSON array), or the same rows as .jsonl/.parquet.

    `correct_choice` is 0-based; the letter is `LETTERS[i]`. Videos: `<videos>/<video_path>`.
    """
    b = Builder("longvideobench", videos, check_videos)
    b.run(annotation_files(Path(annotations), ["lvb_*.json", "*.jsonl", "*.parquet"]), _lvb_convert)
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


def _videomme_convert(rec: dict, file: Path) -> Draft:
    qid = str(field_value(rec, "question_id", (str, int)))
    youtube_id = text_field(rec, "videoID")
    options = strip_prefixes(str_list_field(rec, "options"), "options")
    answer = text_field(rec, "answer", optional=True)
    if answer is not None:
        answer = option_letter(answer, len(options), "answer")
    duration = text_field(rec, "duration")
    if duration not in ("short", "medium", "long"):
        raise BadRecord(f"field 'duration' should be short/medium/long, got {duration!r}")
    names = [f"{youtube_id}{ext}" for ext in (".mp4", ".MP4", ".mkv")]
    meta = {k: rec[k] for k in ("video_id", "videoID", "duration", "domain", "sub_category", "task_type", "url")
            if k in rec}
    return Draft(qid, names + [f"data/{n}" for n in names], text_field(rec, "question"), options, "mcq",
                 check_task_answer("mcq", options, answer), meta)


def load_videomme(annotations: Path, videos: Path, *, check_videos: bool = True):
    """HF `lmms-lab/Video-MME` rows (.parquet/.json/.jsonl) or the official nested template.

    Options arrive prefixed "A. "; the prefix is removed. Videos: `<videos>/<videoID>.mp4`
    (also `.MP4`, `.mkv`, and the same under `data/`). `meta["duration"]` is short/medium/long.
    """
    b = Builder("videomme", videos, check_videos)
    for file in annotation_files(Path(annotations), ["*.json", "*.jsonl", "*.parquet"]):
        for where, rec in read_records(file, b.issues, allow_trailing_commas=True):
            rows = _videomme_rows(rec)
            for j, row in enumerate(rows):
                at = where if len(rows) == 1 and row is rec else f"{where}.questions[{j}]"
                if not isinstance(row, dict):
                    b.issue(at, file, f"{at}: expected an object, got {type(row).__name__}")
                    continue
                try:
                    draft = _videomme_convert(row, file)
                except BadRecord as e:
                    b.issue(guess_id(row, at), file, f"{at}: {e}")
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


def _mlvu_convert(rec: dict, file: Path, where: str) -> Draft:
    task_type = text_field(rec, "task_type", optional=True) or text_field(rec, "question_type")
    video = text_field(rec, "video_name", optional=True) or text_field(rec, "video")
    question = text_field(rec, "question")
    stem = re.sub(r"^\d+_", "", file.stem)
    qid = _mlvu_id(rec, file, where)
    meta: dict[str, Any] = {"task_type": task_type}
    for key in ("question_type", "duration", "scoring_points"):
        if key in rec:
            meta[key] = rec[key]
    videos = [f"{task_type}/{video}", f"{stem}/{video}", video]
    answer = field_value(rec, "answer", (str, int), optional=True)
    if "candidates" not in rec or rec["candidates"] in (None, []):
        if task_type not in _MLVU_GENERATION and stem not in _MLVU_GENERATION:
            raise BadRecord(f"missing field 'candidates' for multiple-choice task {task_type!r}")
        return Draft(qid, videos, question, [], "open", None if answer is None else str(answer), meta)
    options = strip_prefixes(str_list_field(rec, "candidates"), "candidates")
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
                answer = option_letter(answer, len(options), "answer")
            except BadRecord:
                raise BadRecord(f"field 'answer' {answer!r:.80} is neither one of the candidates nor a letter") from None
    return Draft(qid, videos, question, options, "mcq", check_task_answer("mcq", options, answer), meta)


def load_mlvu(annotations: Path, videos: Path, *, check_videos: bool = True):
    """Official MLVU `json/<k>_<task>.json` files (a file or the folder) or the lmms-eval rows.

    The official answer is an option text, converted to its letter; ids are `<file stem>_<index>`
    unless a `question_id` is given. Videos: `<videos>/<task type>/<video>`, or
    `<videos>/<file stem without the number>/<video>`, else `<videos>/<video>`. Generation tasks
    (subPlot, summary) load as task "open" with the reference text as answer.
    """
    b = Builder("mlvu", videos, check_videos)
    for file in annotation_files(Path(annotations), ["*.json", "*.jsonl", "*.parquet"]):
        for where, rec in read_records(file, b.issues):
            try:
                draft = _mlvu_convert(rec, file, where)
            except BadRecord as e:
                b.issue(_mlvu_id(rec, file, where), file, f"{where}: {e}")
                continue
            b.add(draft, file, where)
    return b.result()


# ---------------------------------------------------------------------------------------------
# Charades-STA

_STA_LINE = re.compile(r"^(\S+) (\S+) (\S+)##(.*)$")


def _charades_lengths(csv_path: Path, b: Builder) -> dict[str, float]:
    """`length` (seconds) per video id from `Charades_v1_<split>.csv`."""
    lengths: dict[str, float] = {}
    with csv_path.open(encoding="utf-8", newline="") as fh:
        reader = csv.DictReader(fh)
        if not reader.fieldnames or "id" not in reader.fieldnames or "length" not in reader.fieldnames:
            raise ValueError(f"{csv_path}: expected columns 'id' and 'length', got {reader.fieldnames}")
        for row in reader:
            try:
                lengths[row["id"]] = finite_number(row["length"], "length")
            except BadRecord as e:
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
    files = annotation_files(annotations, ["charades_sta_*.txt"])
    if len(files) != 1:
        raise ValueError(f"{annotations}: expected one charades_sta_*.txt, found {[f.name for f in files]}")
    txt = files[0]
    b = Builder("charades_sta", videos, check_videos)
    csv_path = Path(lengths_csv) if lengths_csv else _find_charades_csv(annotations, txt)
    lengths = _charades_lengths(csv_path, b) if csv_path else {}
    for n, line in utf8_lines(txt, b.issues):
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
            start, end = finite_number(s, "start"), finite_number(e, "end")
            if not 0 <= start < end:
                raise BadRecord(f"start {start} and end {end} need 0 <= start < end")
            query = sentence.strip().rstrip(".").strip()
            if not query:
                raise BadRecord("empty sentence")
        except BadRecord as err:
            b.issue(qid, txt, f"{where}: {err}")
            continue
        meta: dict[str, Any] = {"video_id": vid, "start": start, "end": end, "sentence": sentence,
                                "line": n, "duration": lengths.get(vid)}
        if vid in lengths:
            meta["end_past_video"] = end > lengths[vid]
        b.add(Draft(qid, [f"{vid}.mp4", f"Charades_v1_480/{vid}.mp4"], query, [], "grounding",
                    format_span(start, end), meta), txt, where)
    return b.result()


# ---------------------------------------------------------------------------------------------
# VSI-Bench

VSI_MCA_TYPES = ("object_rel_direction_easy", "object_rel_direction_medium", "object_rel_direction_hard",
                 "object_rel_distance", "route_planning", "obj_appearance_order")
VSI_NA_TYPES = ("object_counting", "object_abs_distance", "object_size_estimation", "room_size_estimation")


def _vsi_convert(rec: dict, file: Path) -> Draft:
    qid = str(field_value(rec, "id", (str, int)))
    dataset = text_field(rec, "dataset")
    scene = text_field(rec, "scene_name")
    qtype = text_field(rec, "question_type")
    gt = field_value(rec, "ground_truth", (str, int, float), optional=True)
    raw_options = rec.get("options")
    meta = {"dataset": dataset, "scene_name": scene, "question_type": qtype}
    videos = [f"{dataset}/{scene}.mp4", f"{scene}.mp4"]
    numeric = qtype in VSI_NA_TYPES or (qtype not in VSI_MCA_TYPES and not raw_options)
    if numeric:
        if raw_options:
            raise BadRecord(f"numeric question type {qtype!r} should have no options, got {raw_options!r:.80}")
        answer = None if gt is None else str(gt).strip()
        return Draft(qid, videos, text_field(rec, "question"), [], "numeric",
                     check_task_answer("numeric", [], answer), {**meta, "category": "NA"})
    if raw_options is not None and not isinstance(raw_options, list):
        raw_options = list(raw_options)  # parquet may hand back an array type
    options = strip_prefixes(str_list_field({"options": raw_options}, "options"), "options")
    answer = None
    if gt is not None:
        gt = str(gt).strip()
        answer = LETTERS[options.index(gt)] if gt in options else option_letter(gt, len(options), "ground_truth")
    return Draft(qid, videos, text_field(rec, "question"), options, "mcq",
                 check_task_answer("mcq", options, answer), {**meta, "category": "MCA"})


def load_vsibench(annotations: Path, videos: Path, *, check_videos: bool = True):
    """HF `nyu-visionx/VSI-Bench` rows (.parquet/.json/.jsonl).

    Multiple-choice types load as "mcq" (options without "A. "), the four measurement types as
    "numeric" with the ground truth as written. Videos: `<videos>/<dataset>/<scene_name>.mp4`.
    """
    b = Builder("vsibench", videos, check_videos)
    b.run(annotation_files(Path(annotations), ["*.parquet", "*.json", "*.jsonl"]), _vsi_convert)
    return b.result()


# ---------------------------------------------------------------------------------------------
# Video-Holmes


def _holmes_convert(rec: dict, file: Path) -> Draft:
    video_id = text_field(rec, "video ID")
    number = field_value(rec, "Question ID", (int, str))
    qid = f"{video_id}_{number}"
    opts = field_value(rec, "Options", dict)
    keys = sorted(opts)
    if keys != list(LETTERS[:len(keys)]) or len(keys) < 2:
        raise BadRecord(f"field 'Options' keys should be A, B, ... in sequence, got {keys}")
    options = [opts[k] for k in keys]
    if not all(isinstance(o, str) and o.strip() for o in options):
        raise BadRecord("field 'Options' holds an empty or non-text option")
    options = [o.strip() for o in options]
    answer = text_field(rec, "Answer", optional=True)
    if answer is not None:
        answer = option_letter(answer, len(options), "Answer")
    meta = {"video_id": video_id, "question_number": number,
            "question_type": text_field(rec, "Question Type")}
    if isinstance(rec.get("Explanation"), str):
        meta["explanation"] = rec["Explanation"]
    return Draft(qid, [f"{video_id}.mp4", f"videos_cropped/{video_id}.mp4"], text_field(rec, "Question"),
                 options, "mcq", check_task_answer("mcq", options, answer), meta)


def load_video_holmes(annotations: Path, videos: Path, *, check_videos: bool = True):
    """`test_Video-Holmes.json` (or a folder of such JSON files): keys with spaces, options as a
    dict A..F. Ids are `<video ID>_<Question ID>`; videos `<videos>/<video ID>.mp4`."""
    b = Builder("video_holmes", videos, check_videos)
    b.run(annotation_files(Path(annotations), ["*.json", "*.jsonl"]), _holmes_convert)
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
    b = Builder("jsonl", videos, check_videos)
    for where, rec in read_records(path, b.issues):
        q, problem = check_question(rec)
        if q is None or (problem and not invalid_rows):
            b.issue(guess_id(rec, where), path, f"{where}: {problem}")
        elif problem:  # an error row, as `m1 infer` writes for the same line
            b.add_invalid(q, path, where)
        else:
            meta = {k: v for k, v in q.meta.items() if k != "benchmark"}
            b.add(Draft(q.id, [q.video], q.text, q.options, q.task, q.answer, meta), path, where)
    return b.result()


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
