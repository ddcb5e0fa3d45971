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

import typer

from m1.synth.questions import LetterCycle, make_questions
from m1.synth.render import render
from m1.synth.world import make_script

app = typer.Typer(no_args_is_help=True, help="M1-Synth: generate videos and questions.")


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
    path.write_text("".join(line + "\n" for line in lines))
    return path


@app.callback()
def _group() -> None:
    """M1-Synth: generate videos and questions."""  # keeps `make` a subcommand even when alone


@app.command()
def make(out: Path = typer.Argument(..., help="Output folder (created if missing)."),
         videos: int = typer.Option(8, "--videos", help="How many videos."),
         seed: int = typer.Option(0, "--seed", help="World seed; the same seed gives identical files."),
         duration: float = typer.Option(300.0, "--duration", help="Video length in seconds (30-1200)."),
         fps: int = typer.Option(4, "--fps", help="Frames per second (>= 2)."),
         size: int = typer.Option(128, "--size", help="Frame width and height in pixels (>= 128, even)."),
         questions_per_video: int = typer.Option(10, "--questions-per-video",
                                                 help="At most this many questions per video.")) -> None:
    """Write OUT/videos/*.mp4, OUT/scripts/*.json and OUT/questions.jsonl."""
    try:
        path = make_dataset(out, videos, seed, duration=duration, fps=fps, size=size,
                            questions_per_video=questions_per_video)
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from exc
    n = sum(1 for _ in path.open())
    typer.echo(f"wrote {videos} videos and {n} questions to {out} (questions: {path})")


@app.command("train-clip")
def train_clip_cmd(out: Path = typer.Option(..., "--out", help="Folder for the trained CLIP (created if missing)."),
                   seed: int = typer.Option(0, "--seed", help="Training seed (worlds, batches, init)."),
                   steps: int | None = typer.Option(None, "--steps", help="Optimizer steps (default: the recipe's)."),
                   videos: int | None = typer.Option(None, "--videos",
                                                        help="Training worlds, 5 min each (default: the recipe's)."),
                   eval_videos: int = typer.Option(4, "--eval-videos", help="Held-out videos for evaluation."),
                   eval_seed: int = typer.Option(1000, "--eval-seed", help="Seed of the held-out videos.")) -> None:
    """Train the tiny M1-Synth CLIP into OUT, evaluate retrieval (trained vs random init), print it."""
    import json as _json

    from m1.synth.clip_train import METRICS, evaluate_clip, format_table, model_files, train_clip

    given = {k: v for k, v in (("steps", steps), ("videos", videos)) if v is not None}
    try:
        folder = train_clip(out, seed=seed, **given)
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from exc
    metrics = _json.loads((folder / METRICS).read_text())
    typer.echo(f"trained {metrics['params']['steps']} steps in {metrics['train_seconds']:.0f} s "
               f"(+{metrics['data_seconds']:.0f} s data); loss {metrics['first_loss']:.3f} -> "
               f"{metrics['last_loss_mean20']:.3f}")
    result = evaluate_clip(folder, videos=eval_videos, seed=eval_seed, progress=True)
    metrics["eval"] = {k: v for k, v in result.items() if k != "rows"}
    (folder / METRICS).write_text(_json.dumps(metrics, indent=1) + "\n")
    typer.echo(format_table(result))
    cfg, ckpt = model_files(folder)
    typer.echo(f"ModelSpec: kind=clip backend=open_clip clip_name={cfg} pretrained={ckpt}")
