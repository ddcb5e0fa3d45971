"""`m1 synth make`: write M1-Synth videos, their scripts and questions.jsonl.

Layout of OUT:
    videos/synth_000.mp4 ...   the rendered videos
    scripts/synth_000.json ... the world scripts (ground truth; never given to models)
    questions.jsonl            one m1.schema.Question per line; `video` is the path of the mp4
                               relative to OUT (e.g. "videos/synth_000.mp4"), so the folder can be
                               moved; resolve it with `OUT / question.video`.
Everything is a function of the arguments: the same seed gives byte-identical files.
"""
from __future__ import annotations

import json
import random
from pathlib import Path

from m1.files import write_whole
from m1.synth.questions import LetterCycle, make_questions
from m1.synth.render import render
from m1.synth.world import make_script



def video_seed(seed: int, index: int) -> int:
    """Per-video seed: independent streams that do not depend on how many videos are made."""
    return random.Random(f"m1-synth/{seed}/{index}").randrange(2 ** 31)


def make_dataset(out: Path, videos: int, seed: int, duration: float = 300.0, fps: int = 4, size: int = 128,
                 questions_per_video: int = 10, progress: bool = True) -> Path:
    """Write `videos` videos with scripts and questions into `out`; returns questions.jsonl."""
    if videos < 1:
        raise ValueError(f"videos must be >= 1, got {videos}")
    if questions_per_video < 1:
        raise ValueError(f"questions_per_video must be >= 1, got {questions_per_video}")
    out = Path(out)
    (out / "videos").mkdir(parents=True, exist_ok=True)
    (out / "scripts").mkdir(parents=True, exist_ok=True)
    qrng = random.Random(f"m1-synth/questions/{seed}")
    letters = LetterCycle(qrng)  # shared so answer letters stay balanced over the whole set
    lines = []
    from tqdm import tqdm

    for i in tqdm(range(videos), desc="synth videos", unit="video", disable=not progress):
        stem = f"synth_{i:03d}"
        script = make_script(video_seed(seed, i), duration=duration, fps=fps, width=size, height=size)
        (out / "scripts" / f"{stem}.json").write_text(script.to_json() + "\n")
        render(script, out / "videos" / f"{stem}.mp4")
        qs = make_questions(script, f"videos/{stem}.mp4", qrng, limit=questions_per_video, letters=letters,
                            id_prefix=f"s{seed}-{stem}")
        lines += [json.dumps(q.model_dump(mode="json"), sort_keys=True) for q in qs]
    path = out / "questions.jsonl"
    write_whole(path, "".join(line + "\n" for line in lines).encode())  # whole or not at all: it marks a world done
    return path
