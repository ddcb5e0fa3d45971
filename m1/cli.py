"""The `m1` command line. Heavy libraries load only inside the commands that need them."""
from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Optional

import typer

app = typer.Typer(add_completion=False, no_args_is_help=True,
                  help="M1: multi-agent collaborative policy planning for video understanding.")


DEMO_TEAM = "mini_trained"  # the mini team after SFT + MARL on M1-Synth (weights in assets/mini_team)


def _training_errors() -> tuple[type[Exception], ...]:
    """What a user of `m1 train` / `m1 sft` can cause or meet, printed as one `error:` line: a config, a model or
    engine that cannot load or answer, a cluster that cannot hold the plan, a rollout that cannot be trained on."""
    from m1.config import ConfigError
    from m1.marl.cluster import PlanError
    from m1.marl.distributed import DistributedError
    from m1.marl.rollout import RolloutError
    from m1.models.base import ModelError

    return ConfigError, ModelError, DistributedError, PlanError, RolloutError


def _fail(msg: str) -> None:
    typer.secho(f"error: {msg}", fg=typer.colors.RED, err=True)
    raise typer.Exit(2)


@app.command()
def infer(
    video_dir: Path = typer.Argument(..., help="Folder of videos (or one video file)."),
    question: Optional[str] = typer.Option(None, "--question", "-q", help="One question asked of every video."),
    options: Optional[list[str]] = typer.Option(None, "--options", "-o", help="Answer options (repeat) for --question."),
    task: str = typer.Option("", help="mcq | open | grounding | numeric (default: mcq with options, else open)."),
    questions: Optional[Path] = typer.Option(None, "--questions", help="JSONL of questions (id, video, text, options, task)."),
    team: str = typer.Option("tiny", "--team", "-t", help="Team config: a YAML path or a name in configs/team/."),
    out: Path = typer.Option(Path("results.jsonl"), "--out", help="Results JSONL (appended; reruns skip done ids)."),
    trace_dir: Optional[Path] = typer.Option(None, "--trace-dir", help="Write one episode JSON + HTML per question here."),
    overrides: Optional[list[str]] = typer.Option(None, "--set", "-s", help="Config override key.path=value (repeat)."),
    limit: Optional[int] = typer.Option(None, help="Answer at most this many new questions."),
) -> None:
    """Answer questions about a folder of videos with a team of policy agents."""
    from m1.config import ConfigError, load_team
    from m1.models.base import ModelError
    from m1.run import InputError, build_questions, run_questions

    try:
        cfg = load_team(team, overrides or [])
        qs, issues = build_questions(video_dir, question=question, options=options or [], task=task,
                                     questions_file=questions)
    except (ConfigError, InputError) as exc:
        _fail(str(exc))
    for msg in issues:
        typer.secho(f"skipped: {msg}", fg=typer.colors.YELLOW, err=True)
    try:
        summary = run_questions(cfg, qs, out, trace_dir=trace_dir, limit=limit)
    except InputError as exc:  # e.g. `out` holds another team's answers
        _fail(str(exc))
    except ModelError as exc:  # finished questions are already in `out`; a rerun resumes
        _fail(f"{exc}\n(results so far are kept in {out}; rerun to resume)")
    typer.echo(summary.describe())


@app.command("eval")
def eval_(
    benchmark: str = typer.Option(..., "--benchmark", "-b",
                                  help="longvideobench | videomme | mlvu | charades_sta | vsibench | video_holmes | jsonl"),
    annotations: Path = typer.Option(..., "--annotations", help="The benchmark's annotation file (or folder)."),
    videos: Path = typer.Option(..., "--videos", help="Folder holding the benchmark's videos."),
    team: str = typer.Option("tiny", "--team", "-t", help="Team config: a YAML path or a name in configs/team/."),
    out: Path = typer.Option(Path("runs/eval"), "--out", help="Folder for predictions.jsonl, metrics.json, metrics.md."),
    overrides: Optional[list[str]] = typer.Option(None, "--set", "-s", help="Config override key.path=value (repeat)."),
    limit: Optional[int] = typer.Option(None, help="Answer at most this many new questions."),
    trace_dir: Optional[Path] = typer.Option(None, "--trace-dir", help="Write one episode JSON + HTML per question."),
) -> None:
    """Run a team on a benchmark and score it with the benchmark's own metrics (resumable)."""
    from m1.config import ConfigError, load_team
    from m1.data.loaders import load_benchmark
    from m1.data.metrics import format_table, score_benchmark
    from m1.models.base import ModelError
    from m1.run import InputError, ResultsFile, run_questions

    try:
        cfg = load_team(team, overrides or [])
        qs, issues = load_benchmark(benchmark, annotations, videos)
    except (ConfigError, ValueError, FileNotFoundError) as exc:
        _fail(str(exc))
    for issue in issues:
        typer.secho(f"skipped: {issue}", fg=typer.colors.YELLOW, err=True)
    if not qs:
        _fail(f"{annotations}: no usable questions ({len(issues)} skipped)")
    out.mkdir(parents=True, exist_ok=True)
    preds_path = out / "predictions.jsonl"
    try:
        summary = run_questions(cfg, qs, preds_path, trace_dir=trace_dir, limit=limit)
    except InputError as exc:  # e.g. `out` holds another team's predictions
        _fail(str(exc))
    except ModelError as exc:
        _fail(f"{exc}\n(predictions so far are kept in {preds_path}; rerun to resume)")
    typer.echo(summary.describe())
    rows = ResultsFile(preds_path).read()
    preds = {r["id"]: r["answer"] for r in rows if r.get("answer") is not None}
    answered = [q for q in qs if q.id in {r["id"] for r in rows}]
    metrics = score_benchmark(benchmark, preds, answered)
    metrics["n_questions"], metrics["n_skipped_records"] = len(answered), len(issues)
    (out / "metrics.json").write_text(json.dumps(metrics, indent=1))
    table = format_table(metrics, title=f"{benchmark} — team {cfg.name}")
    (out / "metrics.md").write_text(table + "\n")
    typer.echo(table)


@app.command()
def demo(
    out: Path = typer.Option(Path("runs/demo"), "--out", help="Folder for data, results and traces."),
    team: str = typer.Option(DEMO_TEAM, "--team", "-t", help="Team config (default: the trained mini team, offline)."),
    videos: int = typer.Option(3, help="How many M1-Synth videos to generate."),
    seed: int = typer.Option(0, help="World seed."),
    duration: float = typer.Option(120.0, help="Video length in seconds."),
    questions_per_video: int = typer.Option(6, help="Questions per video."),
    overrides: Optional[list[str]] = typer.Option(None, "--set", "-s", help="Config override key.path=value."),
) -> None:
    """Offline demo: generate M1-Synth videos and questions, run a team, print answers and accuracy."""
    from m1.config import ConfigError
    from m1.demo import run_demo

    from m1.models.base import ModelError

    try:
        run_demo(out, team, videos=videos, seed=seed, duration=duration,
                 questions_per_video=questions_per_video, overrides=overrides or [], echo=typer.echo)
    except (ConfigError, ModelError) as exc:
        _fail(str(exc))


def _print_plan(kind: str, config: str, overrides: list[str], gpus: Optional[int], gpu_mem: Optional[float]) -> None:
    """`--plan`: print where every model would go and its memory estimate; exit 2 when it does not fit. Reads
    config files and model shapes only; no model loads."""
    from m1.config import ConfigError
    from m1.marl.cluster import PlanError, make_plan
    from m1.marl.config import load_sft_config, load_train_config

    try:
        cfg = (load_train_config if kind == "marl" else load_sft_config)(config, overrides)
        plan = make_plan(cfg, gpus=gpus, gpu_mem_gb=gpu_mem)
    except (ConfigError, PlanError) as exc:
        _fail(str(exc))
    typer.echo(plan.render())
    if not plan.fits:
        _fail("the plan does not fit:\n" + "\n".join(f"  - {p}" for p in plan.problems))


_PLAN_HELP = "Print the placement plan (GPUs and estimated memory per GPU) and exit; loads no model."
_GPUS_HELP = "Plan for N GPUs (cluster.gpus_per_node per node) instead of asking Ray / this machine."
_MEM_HELP = "Memory of one GPU in GB for the plan (default: cluster.gpu_mem_gb, else the local GPUs)."


@app.command()
def train(
    config: str = typer.Option(..., "--config", "-c", help="MARL config: a YAML path or a name in configs/marl/."),
    overrides: Optional[list[str]] = typer.Option(None, "--set", "-s", help="Config override key.path=value."),
    plan: bool = typer.Option(False, "--plan", help=_PLAN_HELP),
    gpus: Optional[int] = typer.Option(None, "--gpus", min=0, help=_GPUS_HELP),
    gpu_mem: Optional[float] = typer.Option(None, "--gpu-mem", min=0.0, help=_MEM_HELP),
) -> None:
    """Multi-agent GRPO: K rollouts per question over a sampled DAG, per-agent advantages, one
    learner per agent (LoRA or full; DeepSpeed ZeRO-2 when configured). Resumes from its output folder."""
    if plan:
        _print_plan("marl", config, overrides or [], gpus, gpu_mem)
        return
    from m1.marl.launch import train_main

    try:
        train_main(config, overrides or [], progress=typer.echo)
    except _training_errors() as exc:
        _fail(str(exc))


@app.command()
def sft(
    config: str = typer.Option(..., "--config", "-c", help="SFT config: a YAML path or a name in configs/sft/."),
    overrides: Optional[list[str]] = typer.Option(None, "--set", "-s", help="Config override key.path=value."),
    plan: bool = typer.Option(False, "--plan", help=_PLAN_HELP),
    gpus: Optional[int] = typer.Option(None, "--gpus", min=0, help=_GPUS_HELP),
    gpu_mem: Optional[float] = typer.Option(None, "--gpu-mem", min=0.0, help=_MEM_HELP),
) -> None:
    """SFT warm-up: run a team (the teacher or an API team), keep plans by the paper's rule (at
    least one agent right, plan never changed), train on completion tokens only."""
    if plan:
        _print_plan("sft", config, overrides or [], gpus, gpu_mem)
        return
    from m1.marl.sft import sft_main

    try:
        sft_main(config, overrides or [], progress=typer.echo)
    except _training_errors() as exc:
        _fail(str(exc))


@app.command()
def version() -> None:
    """Print the version."""
    from importlib.metadata import version as v

    typer.echo(v("m1"))


def main() -> None:  # pragma: no cover
    app(sys.argv[1:])


def _mount_subapps() -> None:
    """Sub-apps live next to their code (their heavy imports stay inside their commands)."""
    from m1.synth.make import app as synth_app

    app.add_typer(synth_app, name="synth", help="M1-Synth: generate videos and questions.")


_mount_subapps()
