"""`m1 data prepare` (mounted by m1/cli.py): a training set -> M1's SFT / MARL / dev question files, and the teacher's
SFT examples. Heavy imports stay inside the command. This module is the command layer's (docs/layout.md): the teacher
step runs m1/marl, which sits above m1/data, so it lives here rather than in m1/data/prepare.py."""
from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Optional

import typer

from m1.errors import fail
from m1.files import write_whole

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
    from m1.config_files import ConfigError
    from m1.data.prepare import PrepareError, parse_split, prepare as run_prepare

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


def teacher_examples(out: Path, videos: Path, sft_config: str, overrides: list[str],
                     split: str = "sft", progress: Callable[[str], None] = print) -> dict[str, Any]:
    """Run the SFT config's teacher over OUT/<split>.jsonl and keep its generations by the config's keep rule into
    OUT/sft_examples.jsonl (m1/marl/sft.py: the paper's keep rule, with that config's data settings; reused when it
    was built with the same settings); recorded in OUT/prepare.json under `sft_examples`."""
    import json

    from m1.data.prepare import PrepareError
    from m1.marl.config import load_sft_config
    from m1.marl.sft import prepare_examples

    questions = out / f"{split}.jsonl"
    if not questions.is_file():
        raise PrepareError(f"{questions}: no such split file (the --split names the files)")
    cfg = load_sft_config(sft_config, list(overrides) + [
        f"data.questions={questions}", f"data.video_dir={videos}", f"data.examples={out / 'sft_examples.jsonl'}"])
    if cfg.data.teacher is None:
        raise PrepareError(f"{sft_config}: data.teacher is not set; name the team that writes the examples")
    examples, stats = prepare_examples(cfg, progress=progress)
    record = {"sft_config": sft_config, "overrides": list(overrides), "examples": len(examples),
              "file": str(out / "sft_examples.jsonl"), "stats": {k: v for k, v in stats.items() if k != "data"}}
    done = json.loads((out / "prepare.json").read_text()) if (out / "prepare.json").is_file() else {}
    done["sft_examples"] = record
    write_whole(out / "prepare.json", json.dumps(done, indent=1).encode())
    return record
