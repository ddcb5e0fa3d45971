"""`m1 data prepare` (mounted by m1/cli.py): a training set -> M1's SFT / MARL / dev question files, and the teacher's
SFT examples. Heavy imports stay inside the command."""
from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

app = typer.Typer(add_completion=False, no_args_is_help=True,
                  help="Training data: split a dataset into question files; build SFT examples with a teacher.")


@app.command()
def prepare(
    annotations: Path = typer.Option(..., "--annotations", help="The dataset's annotation file (or folder)."),
    videos: Path = typer.Option(..., "--videos", help="Folder holding its videos."),
    out: Path = typer.Option(..., "--out", help="Folder for <split>.jsonl, skipped.txt, prepare.json."),
    fmt: str = typer.Option("jsonl", "--format", "-f",
                            help="longvideobench | videomme | mlvu | charades_sta | vsibench | video_holmes | jsonl "
                                 "(one m1 Question per line)."),
    split: str = typer.Option("sft=0.5,marl=0.4,dev=0.1", "--split",
                              help="Fractions of the questions per split file, dealt over whole videos."),
    seed: int = typer.Option(0, "--seed", help="Seed of the split; the same seed gives the same files."),
    limit: Optional[int] = typer.Option(None, "--limit", min=1, help="Use the first N usable questions only."),
    sft_config: Optional[str] = typer.Option(
        None, "--sft-config", help="Then build SFT examples on the `sft` split with this SFT config's teacher and "
                                   "keep rule (a name in configs/sft or a path), into OUT/sft_examples.jsonl."),
    overrides: Optional[list[str]] = typer.Option(None, "--set", "-s",
                                                  help="Override of the SFT config key.path=value (repeat)."),
    no_check_videos: bool = typer.Option(False, "--no-check-videos",
                                         help="Keep questions whose video file is not there (yet)."),
) -> None:
    """Split a training set into question files over whole videos with a seed (no video on two sides), and
    optionally build the SFT examples from a teacher team (e.g. GPT-4o agents behind an OpenAI-compatible endpoint,
    configs/sft/videochat_m1_lora.yaml) with the paper's keep rule."""
    from m1.config import ConfigError
    from m1.data.prepare import PrepareError, parse_split, prepare as run_prepare, teacher_examples
    from m1.errors import fail

    try:
        fractions = parse_split(split)
        run_prepare(fmt, annotations, videos, out, fractions, seed, limit, not no_check_videos, progress=typer.echo)
        if sft_config is not None:
            if "sft" not in fractions:
                raise PrepareError(f"--sft-config: the teacher answers the `sft` split, and --split {split!r} has none")
            rec = teacher_examples(out, videos, sft_config, overrides or [], progress=typer.echo)
            typer.echo(f"SFT examples: {rec['examples']} -> {rec['file']}")
    except (PrepareError, ConfigError, FileNotFoundError, ValueError) as exc:
        fail(str(exc))
    typer.echo(f"use: data.questions={out}/<split>.jsonl data.video_dir={videos}")
