"""`m1 synth make`: write M1-Synth videos, their scripts and questions.jsonl.

Layout of OUT:
    videos/synth_000.mp4 ...   the rendered videos
    scripts/synth_000.json ... the world scripts (ground truth; never given to models)
    questions.jsonl            one m1.schema.Question per line; `video` is the path of the mp4
                               relative to OUT (e.g. "videos/synth_000.mp4"), so the folder can be
                               moved; resolve it with `OUT / question.video`.
    synth.json                 the settings the set is made with (written first)
Everything is a function of the arguments: the same seed gives byte-identical files. A folder holding a set made
with other settings is refused (its videos beyond the new count would stay beside the new questions); the same
settings into the same folder make the same set again.
"""
from __future__ import annotations

import json
import random
from pathlib import Path

from m1.files import write_whole
from m1.synth.questions import LetterCycle, make_questions
from m1.synth.render import render
from m1.synth.world import Script, make_script

SETTINGS = "synth.json"  # in OUT: the settings its set was made with


class OtherSettings(ValueError):
    """OUT holds an M1-Synth set made with other settings than those asked."""


def video_seed(seed: int, index: int) -> int:
    """Per-video seed: independent streams that do not depend on how many videos are made."""
    return random.Random(f"m1-synth/{seed}/{index}").randrange(2 ** 31)


def _flags(settings: dict, asked: dict) -> str:
    """Settings as the command's flags ('--videos 4 --seed 1'); an unknown seed as '--seed (not N)'."""
    def flag(k, v):
        value = f"(not {asked[k]})" if v is None else f"{v:g}" if isinstance(v, float) else v
        return f"--{k.replace('_', '-')} {value}"

    return " ".join(flag(k, v) for k, v in settings.items())


def made_with(out: Path, asked: dict) -> dict | None:
    """The settings the set in `out` was made with: its SETTINGS record, else (a set made before the record) what its
    scripts tell, with the asked questions_per_video (the questions are written whole) and the seed as the asked one
    when the scripts are its, else None; None when `out` holds no set."""
    if (out / SETTINGS).is_file():
        return json.loads((out / SETTINGS).read_text())
    scripts = {int(p.stem[6:]): p for p in (out / "scripts").glob("synth_*.json") if p.stem[6:].isdigit()}
    if not scripts:
        return None
    read = {i: Script.load(p) for i, p in scripts.items()}
    first, last = read[min(read)], max(read)
    ours = all(s.seed == video_seed(asked["seed"], i) for i, s in read.items())
    return {"videos": asked["videos"] if ours and last < asked["videos"] else last + 1,  # unfinished: as asked
            "seed": asked["seed"] if ours else None, "duration": float(first.duration), "fps": first.fps,
            "size": first.width, "questions_per_video": asked["questions_per_video"]}


def check_folder(out: Path, asked: dict) -> None:
    """Refuse (OtherSettings) a folder whose set was made with other settings than `asked`."""
    made = made_with(out, asked)
    if made is None or made == asked:
        return
    differ = [k for k in asked if made.get(k) != asked[k]]
    raise OtherSettings(f"{out} holds an M1-Synth set made with {_flags({k: made.get(k) for k in differ}, asked)}, "
                        f"not {_flags({k: asked[k] for k in differ}, asked)}: make the new set into another folder, "
                        f"or remove {out} first")


def make_dataset(out: Path, videos: int, seed: int, duration: float = 300.0, fps: int = 4, size: int = 128,
                 questions_per_video: int = 10, progress: bool = True) -> Path:
    """Write `videos` videos with scripts and questions into `out`; returns questions.jsonl. Refused (OtherSettings)
    when `out` holds a set made with other settings."""
    if videos < 1:
        raise ValueError(f"videos must be >= 1, got {videos}")
    if questions_per_video < 1:
        raise ValueError(f"questions_per_video must be >= 1, got {questions_per_video}")
    out = Path(out)
    settings = {"videos": videos, "seed": seed, "duration": float(duration), "fps": fps, "size": size,
                "questions_per_video": questions_per_video}
    make_script(video_seed(seed, 0), duration=duration, fps=fps, width=size, height=size)  # bad settings: no record
    check_folder(out, settings)
    (out / "videos").mkdir(parents=True, exist_ok=True)
    (out / "scripts").mkdir(parents=True, exist_ok=True)
    write_whole(out / SETTINGS, (json.dumps(settings, sort_keys=True) + "\n").encode())
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
