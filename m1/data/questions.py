"""Reading the questions of a run: `--question` asked of every video of a folder, or a JSONL file of questions.

It sits with the benchmark loaders, whose `check_question` (m1/data/records.py) is the one validation of a question,
so `m1 infer`, the experiment runner, the MARL stream, M1-Synth and the lmms-eval bridge read questions through the
data layer, without importing the run. `InputError` is defined here, the lowest module that raises it; the results
file (m1/results.py) raises it too, and the commands catch this one class for every bad input of a run.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

from m1.data.records import TASKS, check_question
from m1.schema import Question
from m1.video import left_out_videos, list_videos
from m1.video.probing import VIDEO_EXTENSIONS


STDIN = "-"  # `--questions -`: the questions come on standard input


class InputError(ValueError):
    """A run's input cannot be used as given (a questions file, a results file, a --shard): the message says why."""


def build_questions(video_dir: Path, question: str | None = None, options: list[str] | None = None,
                    task: str = "", questions_file: Path | None = None, invalid_rows: bool = False
                    ) -> tuple[list[Question], list[str]]:
    """Questions from `--question` (asked of every video in the folder) or a JSONL file.

    Returns the questions and a list of problems (malformed lines) that were skipped. `invalid_rows`: as for
    `read_questions`."""
    video_dir = Path(video_dir)
    if not video_dir.exists():
        raise InputError(f"{video_dir}: no such folder or file")
    if (question is None) == (questions_file is None):
        raise InputError("give exactly one of --question TEXT or --questions FILE.jsonl")
    if task and task not in TASKS:
        raise InputError(f"--task {task!r}: not one of {', '.join(TASKS)}")
    if task and questions_file is not None:  # it would be ignored: each line says its own
        raise InputError("--task goes with --question; in a questions file each line gives its task in its 'task' "
                         "field (without one: mcq when it has options, else open)")
    if question is not None:
        videos = [video_dir] if video_dir.is_file() else list_videos(video_dir)
        left_out = [] if video_dir.is_file() else left_out_videos(video_dir)
        if not videos:
            raise InputError(f"{video_dir}: no video files ({' '.join(VIDEO_EXTENSIONS)}) found"
                             + "".join(f"\n  {line}" for line in left_out))
        task = task or ("mcq" if options else "open")
        ids = video_ids(videos) if video_dir.is_dir() else [video_dir.name]
        checked = [check_question({"id": i, "video": str(v),
                                   "text": question, "options": list(options or []), "task": task})
                   for i, v in zip(ids, videos)]
        if not invalid_rows and checked[0][1]:  # the same question for every video: invalid for all of them
            raise InputError(f"--question: {checked[0][1]}")
        qs = [q for q, _ in checked]
        _check_unique(qs, str(video_dir))
        return qs, left_out  # skipped inputs: counted and named as skipped lines are
    return read_questions(Path(questions_file), video_dir, invalid_rows)


def read_questions(path: Path, video_dir: Path | None = None, invalid_rows: bool = False
                   ) -> tuple[list[Question], list[str]]:
    """Questions of a JSONL file; a line that is not UTF-8, not JSON or has no id is skipped and named (file:line)
    in the returned problems, so one bad line never hides the rest. A line that fails `check_question` (the one
    validation, shared with `m1 eval`) is skipped and named too, or with `invalid_rows` (`m1 infer`) comes back as
    a stand-in that the run (m1/run.py) writes as an error row."""
    path = Path(path)
    if path.is_dir():
        raise InputError(f"{path}: is a folder; --questions needs a JSONL file")
    if str(path) != STDIN and not path.exists():
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


def read_once(path: Path) -> bytes:
    """The bytes of a file, a pipe (`<(...)`, /dev/stdin) or standard input (`-`), read once as a snapshot: a pipe
    cannot be read twice, so nothing after this reads the path again."""
    if str(path) == STDIN:
        return sys.stdin.buffer.read()
    return Path(path).read_bytes()


def text_lines(path: Path, issues: list[str], what: str = "record") -> list[str | None]:
    """The lines of a text file, each decoded as UTF-8 on its own: a line that is not UTF-8 is None, and
    `path:n: not UTF-8 ...` goes to `issues`, so bad bytes on one line skip that line only."""
    out: list[str | None] = []
    for n, raw in enumerate(read_once(path).split(b"\n"), 1):
        if n == 1:
            raw = raw.removeprefix(b"\xef\xbb\xbf")  # a UTF-8 byte-order mark (Notepad, Excel) is not text
        try:
            out.append(raw.decode("utf-8").rstrip("\r"))
        except UnicodeDecodeError as exc:
            issues.append(f"{path}:{n}: malformed {what} (not UTF-8: byte 0x{raw[exc.start]:02x} at column "
                          f"{exc.start + 1})")
            out.append(None)
    if out and out[-1] == "":
        out.pop()
    return out


def video_ids(videos: list[Path]) -> list[str]:
    """A question id per video of a folder: its name without the extension, or with it where two videos share a
    stem (`synth_000.mp4` beside `synth_000.mov`), so every id is distinct and still says which file it asks."""
    stems: dict[str, int] = {}
    for v in videos:
        stems[v.stem] = stems.get(v.stem, 0) + 1
    return [v.stem if stems[v.stem] == 1 else v.name for v in videos]


def _check_unique(qs: list[Question], source: str) -> None:
    seen: dict[str, Question] = {}
    for q in qs:
        if q.id in seen:
            raise InputError(f"{source}: duplicate question id {q.id!r} (videos {seen[q.id].video} and {q.video}); "
                             "give each question its own id")
        seen[q.id] = q
