"""`m1 synth`: generate M1-Synth videos and questions, and train the world's CLIP (the commands only; the work is
in m1/synth/make.py and m1/synth/clip_train.py)."""
from __future__ import annotations

from pathlib import Path

import typer

from m1.errors import fail
from m1.files import WriteError
from m1.synth.make import OtherSettings, make_dataset

app = typer.Typer(no_args_is_help=True, help="M1-Synth: generate videos and questions.")


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
    """Write OUT/videos/*.mp4, OUT/scripts/*.json and OUT/questions.jsonl (the settings in OUT/synth.json).

    Exit status 2 when OUT holds a set made with other settings (the same settings make the same set again)."""
    try:
        path = make_dataset(out, videos, seed, duration=duration, fps=fps, size=size,
                            questions_per_video=questions_per_video)
    except OtherSettings as exc:  # two sets would mix: said in one line, not as a bad flag
        fail(str(exc), exc)
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from exc
    except WriteError as exc:  # a full disk: nothing torn is left behind
        fail(str(exc), exc)
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
