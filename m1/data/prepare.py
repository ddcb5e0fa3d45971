"""`m1 data prepare`: a training set in any format the loaders read -> M1's question files, split with a seed.

Splits are made over whole videos, so no video has questions on both sides of a split (a MARL question about a video
SFT was taught on, or a dev question about a training video, would flatter the numbers). Videos are shuffled with the
seed and dealt to the splits in turn, each video to the split furthest below its share of the questions so far, so
the split sizes follow the fractions in questions, not in videos. The same input and seed give the same files.

Written into OUT: `<split>.jsonl` (one `m1.schema.Question` per line, `video` relative to the videos folder: pass
`data.video_dir=<videos>` with `data.questions=OUT/<split>.jsonl`), `skipped.txt` (the records the loader refused,
with why), and `prepare.json` (sources, seed, counts) written last. The teacher step that may follow (an SFT config's
teacher answering the `sft` split) belongs to the command, m1/data/cli.py: it runs m1/marl, which sits above this
package.
"""
from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any, Callable

from m1.data.loaders import load_benchmark
from m1.files import write_whole
from m1.schema import Question


class PrepareError(ValueError):
    pass


def parse_split(text: str) -> dict[str, float]:
    """'sft=0.5,marl=0.4,dev=0.1' -> {'sft': 0.5, 'marl': 0.4, 'dev': 0.1} (fractions summing to 1)."""
    out: dict[str, float] = {}
    for part in text.split(","):
        name, sep, value = part.strip().partition("=")
        if not sep or not name:
            raise PrepareError(f"--split {text!r}: write name=fraction pairs, e.g. sft=0.5,marl=0.4,dev=0.1")
        if not name.isidentifier():
            raise PrepareError(f"--split: {name!r} is not a plain name (it becomes the file {name}.jsonl)")
        try:
            frac = float(value)
        except ValueError:
            raise PrepareError(f"--split: {name}={value!r} is not a number") from None
        if not 0 < frac <= 1:
            raise PrepareError(f"--split: {name}={frac} must be in (0, 1]")
        if name in out:
            raise PrepareError(f"--split: {name!r} given twice")
        out[name] = frac
    total = sum(out.values())
    if abs(total - 1.0) > 1e-6:
        raise PrepareError(f"--split {text!r}: the fractions sum to {total:g}, not 1")
    return out


def split_by_video(questions: list[Question], fractions: dict[str, float], seed: int) -> dict[str, list[Question]]:
    """Deal shuffled whole videos to the splits, each to the one furthest below its share of questions."""
    by_video: dict[str, list[Question]] = {}
    for q in questions:
        by_video.setdefault(q.video, []).append(q)
    videos = sorted(by_video)
    random.Random(seed).shuffle(videos)
    out: dict[str, list[Question]] = {name: [] for name in fractions}
    placed = 0
    for v in videos:
        group = by_video[v]
        after = placed + len(group)
        # the split whose count falls shortest of its fraction of the questions placed once this video is in
        name = max(fractions, key=lambda n: (fractions[n] * after - len(out[n]), fractions[n]))
        out[name].extend(group)
        placed = after
    return out


def _relative(q: Question, videos: Path) -> dict[str, Any]:
    row = q.model_dump(mode="json", exclude_none=True)
    try:
        row["video"] = str(Path(q.video).resolve().relative_to(videos.resolve()))
    except ValueError:  # a loader that resolves videos outside the folder: keep the path as given
        pass
    return row


def prepare(fmt: str, annotations: Path, videos: Path, out: Path, split: dict[str, float], seed: int = 0,
            limit: int | None = None, check_videos: bool = True,
            progress: Callable[[str], None] = print) -> dict[str, Any]:
    """Load, split and write the question files; returns the record written to OUT/prepare.json."""
    qs, issues = load_benchmark(fmt, annotations, videos, check_videos=check_videos)
    if limit is not None:
        qs = qs[:limit]
    if not qs:
        raise PrepareError(f"{annotations}: no usable questions ({len(issues)} records skipped"
                           + (f", e.g. {issues[0]}" if issues else "") + ")")
    parts = split_by_video(qs, split, seed)
    out.mkdir(parents=True, exist_ok=True)
    files = {}
    for name, part in parts.items():
        path = out / f"{name}.jsonl"
        write_whole(path, "".join(json.dumps(_relative(q, videos)) + "\n" for q in part).encode())
        files[name] = {"file": str(path), "questions": len(part), "videos": len({q.video for q in part})}
        progress(f"{name}: {len(part)} questions on {files[name]['videos']} videos -> {path}")
    write_whole(out / "skipped.txt", "".join(f"{i}\n" for i in issues).encode())
    if issues:
        progress(f"skipped {len(issues)} records (why: {out / 'skipped.txt'}), e.g. {issues[0]}")
    record = {"format": fmt, "annotations": str(annotations), "videos": str(videos), "seed": seed,
              "split": split, "questions": len(qs), "skipped": len(issues), "files": files}
    write_whole(out / "prepare.json", json.dumps(record, indent=1).encode())
    return record

