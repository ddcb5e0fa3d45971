"""The `m1` command line. Heavy libraries load only inside the commands that need them."""
from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Optional

import typer

from m1.data.cli import app as data_app
from m1.errors import GuardedGroup, describe, fail, report_startup
from m1.explain import app as config_app
from m1.experiment.cli import app as experiment_app
from m1.files import WriteError, check_place
from m1.locks import LockError
from m1.marl.guard import train_guarded
from m1.models.base import ModelError
from m1.plots import PlotError, plot_run
from m1.serve import serve_command
from m1.signals import Stopped
from m1.synth.cli import app as synth_app

app = typer.Typer(cls=GuardedGroup, add_completion=False, no_args_is_help=True,
                  help="M1: multi-agent collaborative policy planning for video understanding.")


DEMO_TEAM = "mini_trained"  # the mini team after SFT + MARL on M1-Synth (weights in assets/mini_team)


_KEEP_ERRORS_HELP = ("Keep the result lines of questions that ended in an error (default: a rerun answers them again "
                     "and replaces their lines).")
_DEBUG_HELP = "Show the traceback behind an error (also: M1_DEBUG=1)."
_KEEP_STALE_HELP = ("Keep the answers of questions that changed (text, task, options, truth or video) since their "
                    "line was written (default: a rerun answers them again and replaces their lines).")
_ALLOW_ERRORS_HELP = "Exit 0 even when questions ended as error rows (default: exit 1; see docs/cli.md)."

_SHARD_HELP = ("Worker i of n (i = 0..n-1): answer the questions whose index in the input order is i mod n into "
               "OUT.part-i-of-n.jsonl (resumable); join the parts with `m1 merge OUT`.")


def _exit_for_errors(summary, allow_errors: bool) -> None:
    """Exit 1 when this run wrote error rows or skipped input lines (docs/cli.md), so a script sees a run that did
    not answer everything."""
    if (summary.errors or summary.skipped) and not allow_errors:
        what = [f"{len(summary.errors)} questions ended as error rows"] if summary.errors else []
        what += [f"{len(summary.skipped)} input lines were skipped"] if summary.skipped else []
        typer.secho(f"exit 1: {' and '.join(what)} (--allow-errors exits 0)", fg=typer.colors.YELLOW, err=True)
        raise typer.Exit(1)


def _run_guarded(run, out: Path, debug: bool = False, trace_dir: Path | None = None):
    """Run `run()` and turn what a run can meet into one `error:` line (status 2) or, for a stop by
    SIGINT/SIGTERM, the stop report with status 130/143. A read-only or full place is named with the setting
    that moves it (--out, --trace-dir, M1_CACHE, TMPDIR)."""
    from m1.data.questions import InputError

    try:
        return run()
    except (InputError, LockError, WriteError) as exc:  # another team's answers, a busy file, a full disk
        fail(str(exc), exc, debug)
    except (OSError, UnicodeError) as exc:  # a read-only or missing folder, a folder given as a file, ...
        fail(describe(exc, "another --out", {trace_dir: "another --trace-dir"} if trace_dir else None), exc, debug)
    except ModelError as exc:  # finished questions are already in `out` (or its parts); a rerun resumes
        kept = [p for p in (out, *sorted(out.parent.glob(f"{out.name}.part-*-of-*.jsonl")))
                if p.is_file() and p.stat().st_size]
        note = (f"results so far are kept in {', '.join(map(str, kept))}; rerun to resume" if kept else
                f"no results were written to {out}; rerun once the model works")
        fail(f"{exc}\n({note})", exc, debug)
    except Stopped as exc:
        typer.secho(str(exc), fg=typer.colors.YELLOW, err=True)
        raise typer.Exit(exc.exit_status)


def _check_team_models(cfg) -> None:
    """Every model the team loads is built from its config (no weights), then the servers of its API models are
    asked, before anything loads: each problem is one `error:` line (m1/models/preflight.py `startup_problems`)."""
    from m1.models.preflight import PreflightError, startup_problems

    try:
        report_startup(*startup_problems(cfg))
    except PreflightError as exc:
        fail(str(exc))


@app.command()
def infer(
    video_dir: Path = typer.Argument(..., help="Folder of videos (or one video file)."),
    question: Optional[str] = typer.Option(None, "--question", "-q", help="One question asked of every video."),
    options: Optional[list[str]] = typer.Option(None, "--options", "-o", help="Answer options (repeat) for --question."),
    task: str = typer.Option("", help="mcq | open | grounding | numeric (default: mcq with options, else open)."),
    questions: Optional[Path] = typer.Option(None, "--questions", help=(
        "JSONL of questions (id, video, text, options, task); `-` or a pipe is read once, as a snapshot.")),
    team: str = typer.Option("tiny", "--team", "-t", help="Team config: a YAML path or a name in configs/team/."),
    out: Path = typer.Option(Path("results.jsonl"), "--out", help="Results JSONL (appended; reruns skip done ids)."),
    trace_dir: Optional[Path] = typer.Option(None, "--trace-dir", help="Write one episode JSON + HTML per question here."),
    overrides: Optional[list[str]] = typer.Option(None, "--set", "-s", help="Config override key.path=value (repeat)."),
    limit: Optional[int] = typer.Option(None, min=0, help="Answer at most this many new questions (0 or more)."),
    shard: Optional[str] = typer.Option(None, "--shard", help=_SHARD_HELP),
    keep_errors: bool = typer.Option(False, "--keep-errors", help=_KEEP_ERRORS_HELP),
    keep_stale: bool = typer.Option(False, "--keep-stale", help=_KEEP_STALE_HELP),
    allow_errors: bool = typer.Option(False, "--allow-errors", help=_ALLOW_ERRORS_HELP),
    debug: bool = typer.Option(False, "--debug", help=_DEBUG_HELP),
) -> None:
    """Answer questions about a folder of videos with a team of policy agents.

    One run at a time writes OUT (a second is refused, naming the first). SIGINT/SIGTERM stop after the
    line being written, with status 130/143; rerunning the same command continues."""
    from m1.config import load_team
    from m1.config_files import ConfigError
    from m1.data.questions import InputError, build_questions
    from m1.results import parse_shard
    from m1.run import run_questions

    try:
        cfg = load_team(team, overrides or [])
        qs, issues = build_questions(video_dir, question=question, options=options or [], task=task,
                                     questions_file=questions, invalid_rows=True)
        split = parse_shard(shard) if shard else None
    except (ConfigError, InputError) as exc:
        fail(str(exc), exc, debug)
    for msg in issues:
        typer.secho(f"skipped: {msg}", fg=typer.colors.YELLOW, err=True)
    if not qs:
        fail(f"{questions}: no usable questions ({len(issues)} skipped); nothing to answer")
    _check_team_models(cfg)
    summary = _run_guarded(lambda: run_questions(cfg, qs, out, trace_dir=trace_dir, limit=limit, shard=split,
                                                 stop_on_signals=True, keep_errors=keep_errors,
                                                 keep_stale=keep_stale), out, debug, trace_dir)
    summary.skipped = list(issues)
    typer.echo(summary.describe())
    if split:
        typer.echo(f"part {split[0]} of {split[1]} written; when every part is done: m1 merge {out}")
    _exit_for_errors(summary, allow_errors)


def _score_predictions(benchmark: str, qs, n_skipped: int, out: Path, title: str, debug: bool) -> None:
    """Score OUT/predictions.jsonl with the benchmark's own metrics into OUT/metrics.json and metrics.md and print the
    table; with nothing labelled to score, say so instead. An invalid question's error row is not scored."""
    from m1.agents.parsers import answer_in_form
    from m1.data.records import INVALID
    from m1.data.metrics import format_table, score_benchmark
    from m1.data.questions import InputError
    from m1.results import ResultsFile

    preds_path = out / "predictions.jsonl"
    try:
        rows = ResultsFile(preds_path).read()
    except InputError as exc:
        fail(str(exc), exc, debug)
    preds = {r["id"]: r["answer"] for r in rows if r.get("answer") is not None}
    listed = {r["id"] for r in rows}
    answered = [q for q in qs if q.id in listed and INVALID not in q.meta]
    try:
        metrics = score_benchmark(benchmark, preds, answered)
    except ValueError as exc:  # nothing labelled to score (every question invalid, or a split without truths)
        typer.secho(f"not scored: {exc}; the answers are in {preds_path}", fg=typer.colors.YELLOW, err=True)
        return
    metrics["n_questions"], metrics["n_skipped_records"] = len(answered), n_skipped
    metrics["n_invalid"] = sum(INVALID in q.meta for q in qs)
    # answers not in the exact form for their task (null ones among them), judged again here so older files count too
    by_id = {r["id"]: r for r in rows}
    odd = [q for q in answered if not by_id[q.id].get("error") and not answer_in_form(by_id[q.id].get("answer"), q)]
    metrics["n_not_in_form"] = len(odd)
    metrics["n_no_answer"] = sum(by_id[q.id].get("answer") is None for q in odd)
    (out / "metrics.json").write_text(json.dumps(metrics, indent=1))
    table = format_table(metrics, title=title)
    (out / "metrics.md").write_text(table + "\n")
    typer.echo(table)


@app.command("eval")
def eval_(
    benchmark: str = typer.Option(..., "--benchmark", "-b",
                                  help="longvideobench | videomme | mlvu | charades_sta | vsibench | video_holmes | jsonl"),
    annotations: Path = typer.Option(..., "--annotations", help="The benchmark's annotation file (or folder)."),
    videos: Path = typer.Option(..., "--videos", help="Folder holding the benchmark's videos."),
    team: str = typer.Option("tiny", "--team", "-t", help="Team config: a YAML path or a name in configs/team/."),
    out: Path = typer.Option(Path("runs/eval"), "--out", help="Folder for predictions.jsonl, metrics.json, metrics.md."),
    overrides: Optional[list[str]] = typer.Option(None, "--set", "-s", help="Config override key.path=value (repeat)."),
    limit: Optional[int] = typer.Option(None, min=0, help="Answer at most this many new questions (0 or more)."),
    trace_dir: Optional[Path] = typer.Option(None, "--trace-dir", help="Write one episode JSON + HTML per question."),
    shard: Optional[str] = typer.Option(None, "--shard", help=_SHARD_HELP.replace("OUT", "OUT/predictions.jsonl")
                                        + " Then rerun without --shard to score."),
    keep_errors: bool = typer.Option(False, "--keep-errors", help=_KEEP_ERRORS_HELP),
    keep_stale: bool = typer.Option(False, "--keep-stale", help=_KEEP_STALE_HELP),
    allow_errors: bool = typer.Option(False, "--allow-errors", help=_ALLOW_ERRORS_HELP),
    debug: bool = typer.Option(False, "--debug", help=_DEBUG_HELP),
) -> None:
    """Run a team on a benchmark and score it with the benchmark's own metrics (resumable; locking,
    stops and --shard as for `m1 infer`)."""
    from m1.config import load_team
    from m1.config_files import ConfigError
    from m1.data.loaders import load_benchmark
    from m1.results import parse_shard
    from m1.run import run_questions

    try:
        cfg = load_team(team, overrides or [])
        jsonl = benchmark.lower() == "jsonl"  # the format `m1 infer` reads: an invalid line is an error row in both
        qs, issues = load_benchmark(benchmark, annotations, videos, **({"invalid_rows": True} if jsonl else {}))
        split = parse_shard(shard) if shard else None
    except (ConfigError, ValueError, FileNotFoundError) as exc:
        fail(str(exc), exc, debug)
    for issue in issues:
        typer.secho(f"skipped: {issue}", fg=typer.colors.YELLOW, err=True)
    if not qs:
        fail(f"{annotations}: no usable questions ({len(issues)} skipped)")
    _check_team_models(cfg)
    check_place(out, "--out", folder=True)
    out.mkdir(parents=True, exist_ok=True)
    preds_path = out / "predictions.jsonl"
    summary = _run_guarded(lambda: run_questions(cfg, qs, preds_path, trace_dir=trace_dir, limit=limit, shard=split,
                                                 stop_on_signals=True, keep_errors=keep_errors,
                                                 keep_stale=keep_stale), preds_path, debug, trace_dir)
    summary.skipped = [str(issue) for issue in issues]
    typer.echo(summary.describe())
    if split:  # a part is not scored; the merged predictions are
        typer.echo(f"part {split[0]} of {split[1]} written; when every part is done: m1 merge {preds_path}, "
                   f"then rerun this command without --shard to score")
    else:
        _score_predictions(benchmark, qs, len(issues), out, f"{benchmark} — team {cfg.name}", debug)
    _exit_for_errors(summary, allow_errors)


@app.command()
def merge(
    out: Path = typer.Argument(..., help="The results file the workers were given as --out (for m1 eval: "
                                         "OUT/predictions.jsonl)."),
    delete_parts: bool = typer.Option(False, "--delete-parts", help="Remove the part files after a good merge."),
) -> None:
    """Join the part files of `--shard i/n` workers into OUT: every id once, in input order. Refused,
    naming parts and ids, when a part is missing, unfinished, still being written or disagrees."""
    from m1.results import merge_parts

    typer.echo(_run_guarded(lambda: merge_parts(out, delete_parts=delete_parts), out).describe())


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
    from m1.config_files import ConfigError
    from m1.demo import run_demo

    try:
        run_demo(out, team, videos=videos, seed=seed, duration=duration,
                 questions_per_video=questions_per_video, overrides=overrides or [], echo=typer.echo)
    except (ConfigError, ModelError, LockError) as exc:
        fail(str(exc))


def _print_plan(kind: str, config: str, overrides: list[str], gpus: Optional[int], gpu_mem: Optional[float]) -> None:
    """`--plan`: print where every model would go and its memory estimate; exit 2 when it does not fit or a model
    cannot be built. Reads config files, model shapes and each model's config and tokenizer/processor; no weights."""
    from m1.config_files import ConfigError
    from m1.marl.plan.cluster import PlanError
    from m1.marl.plan.planner import make_plan
    from m1.marl.config import load_sft_config, load_train_config

    from m1.marl.preflight import check_run
    from m1.models.preflight import PreflightError, require, summary

    try:
        cfg = (load_train_config if kind == "marl" else load_sft_config)(config, overrides)
        checks = require(check_run(cfg))  # a model that cannot be built is named before the plan
        plan = make_plan(cfg, gpus=gpus, gpu_mem_gb=gpu_mem)
    except (ConfigError, PlanError, PreflightError) as exc:
        fail(str(exc))
    typer.echo(plan.render())
    for line in summary(checks):
        typer.echo(line)
    if not plan.fits:
        fail("the plan does not fit:\n" + "\n".join(f"  - {p}" for p in plan.problems))


def _plan_or_train(kind: str, config: str, overrides: Optional[list[str]], plan: bool, gpus: Optional[int],
                   gpu_mem: Optional[float], resume_from: Optional[str], debug: bool, threads: int = 1) -> None:
    """`m1 train` (kind marl) and `m1 sft`: print the plan with --plan, else train under the guard of exit codes, on
    `threads` torch threads (0: torch's default)."""
    if plan:
        _print_plan(kind, config, overrides or [], gpus, gpu_mem)
        return
    import torch

    if kind == "marl":
        from m1.marl.launch import train_main as main
    else:
        from m1.marl.sft import sft_main as main
    sets = list(overrides or []) + ([f"checkpoint.resume_from={resume_from}"] if resume_from else [])
    before = torch.get_num_threads()
    torch.set_num_threads(threads or before)
    try:
        train_guarded(lambda: main(config, sets, progress=typer.echo), debug)
    finally:
        torch.set_num_threads(before)  # a caller in the same process (tests) keeps its own


_PLAN_HELP = "Print the placement plan (GPUs and estimated memory per GPU) and exit; loads no model."
_GPUS_HELP = "Plan for N GPUs (cluster.gpus_per_node per node) instead of asking Ray / this machine."
_MEM_HELP = "Memory of one GPU in GB for the plan (default: cluster.gpu_mem_gb, else the local GPUs)."
_THREADS_HELP = ("torch CPU threads of this process. 1 (default): what `m1 experiment` gives each seed "
                 "(threads_per_seed), so two runs on a 2-core machine share it instead of oversubscribing it (two "
                 "runs at torch's default took 17-27 s a step instead of 6.6), and a run's float sums do not depend "
                 "on the machine's cores. 0: torch's default (every core).")
_RESUME_HELP = ("latest (default): resume from the newest checkpoint, and stop with an error naming the file when it "
                "is damaged. previous: resume from the newest intact checkpoint, skipping damaged ones.")


def _training_command(name: str, kind: str, what: str, doc: str) -> None:
    """`m1 train` and `m1 sft`: one set of options (config, --set, --plan, --gpus, --gpu-mem, --resume-from,
    --threads, --debug), registered under each name with its own help."""

    def command(
        config: str = typer.Option(..., "--config", "-c", help=f"{what} config: a YAML path or a name in "
                                                                f"configs/{kind}/."),
        overrides: Optional[list[str]] = typer.Option(None, "--set", "-s", help="Config override key.path=value."),
        plan: bool = typer.Option(False, "--plan", help=_PLAN_HELP),
        gpus: Optional[int] = typer.Option(None, "--gpus", min=0, help=_GPUS_HELP),
        gpu_mem: Optional[float] = typer.Option(None, "--gpu-mem", min=0.0, help=_MEM_HELP),
        resume_from: Optional[str] = typer.Option(None, "--resume-from", help=_RESUME_HELP),
        threads: int = typer.Option(1, "--threads", min=0, help=_THREADS_HELP),
        debug: bool = typer.Option(False, "--debug", help=_DEBUG_HELP),
    ) -> None:
        _plan_or_train(kind, config, overrides, plan, gpus, gpu_mem, resume_from, debug, threads)

    command.__doc__ = doc
    app.command(name)(command)


_training_command("train", "marl", "MARL", """Multi-agent GRPO: K rollouts per question over a sampled DAG, per-agent
    advantages, one learner per agent (LoRA or full; DeepSpeed ZeRO-2 when configured). Resumes from its output
    folder.

    Exit status: 0 done; 2 an error (one `error:` line); 143 after SIGTERM, 130 after SIGINT: the step
    under way finished and was checkpointed ("stopped at step N"); rerun the same command to resume. A
    second signal stops at once, losing the steps after the newest checkpoint.""")
_training_command("sft", "sft", "SFT", """SFT warm-up: run a team (the teacher or an API team), keep plans by the
    paper's rule (at least one agent right, plan never changed), train on completion tokens only.

    Exit status as for `m1 train`: 0, 2 (an error), 143 / 130 (stopped by SIGTERM / SIGINT after
    checkpointing the last step; rerun to resume).""")


@app.command()
def pretrain(
    config: str = typer.Option(..., "--config", "-c", help="Pretraining config: a YAML path or a name in "
                                                            "configs/pretrain/."),
    overrides: Optional[list[str]] = typer.Option(None, "--set", "-s", help="Config override key.path=value."),
    debug: bool = typer.Option(False, "--debug", help=_DEBUG_HELP),
) -> None:
    """Train a student from scratch to read the synth world's texts (reading drills and the world's texts), the base
    that SFT starts from; writes OUT_DIR/base with its record.

    Exit status as for `m1 train`: 0, 2 (an error), 143 / 130 (stopped by SIGTERM / SIGINT after checkpointing the
    last step; rerun to resume)."""
    from m1.pretrain.train import pretrain_main

    train_guarded(lambda: pretrain_main(config, list(overrides or []), progress=typer.echo), debug)


@app.command()
def plot(
    run_dir: Path = typer.Argument(..., help="The out_dir of an `m1 train` or `m1 sft` run (holds metrics.jsonl)."),
    out: Optional[Path] = typer.Option(None, "--out", help="Folder for the PNGs (default: RUN_DIR/plots)."),
) -> None:
    """Training curves as PNGs: reward parts, team result, loss, KL, importance ratio, per-agent rewards (the
    figures the run's metrics allow). `m1 train` and `m1 sft` write them when they end."""
    try:
        paths = plot_run(run_dir, out)
    except PlotError as exc:
        fail(str(exc))
    for path in paths:
        typer.echo(str(path))


@app.command()
def view(
    run_dir: Path = typer.Argument(..., help="A run folder holding traces/ (as `m1 demo` writes), a trace folder, "
                                   "or the out_dir of an `m1 train` / `m1 sft` run."),
    port: int = typer.Option(0, "--port", min=0, max=65535, help="Port on 127.0.0.1 (default: a free one)."),
    open_browser: bool = typer.Option(False, "--open", help="Also open the index in a web browser."),
) -> None:
    """Serve a run's trace pages on this machine and print the index's URL; Ctrl-C stops.

    The index (RUN_DIR/traces/index.html or RUN_DIR/index.html) is built first when it is missing or
    older than a trace. A training run gets RUN_DIR/index.html: its plots and the steps whose episodes were kept
    (log.samples_every), each linking to that step's trace pages. Only 127.0.0.1 is served: traces hold questions
    and model output."""
    from m1.marl.view import build_run_index, is_training_run
    from m1.trace import INDEX_NAME
    from m1.trace_index import build_index, find_trace_dir, index_is_stale, serve

    try:
        if is_training_run(run_dir):
            folder = run_dir
            typer.echo(f"built {build_run_index(folder)}")
        else:
            folder = find_trace_dir(run_dir)
            if index_is_stale(folder):
                typer.echo(f"built {build_index(folder)}")
    except (FileNotFoundError, WriteError) as exc:
        fail(str(exc))
    try:
        server = serve(folder, port)
    except OSError as exc:
        fail(f"cannot serve on port {port} ({exc.strerror or exc}); pick another with --port, or leave it out")
    url = f"http://127.0.0.1:{server.server_address[1]}/{INDEX_NAME}"
    typer.echo(f"serving {folder} at {url}  (Ctrl-C stops)")
    if open_browser:
        import webbrowser

        webbrowser.open(url)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        typer.echo("stopped")
    finally:
        server.server_close()


@app.command()
def version() -> None:
    """Print the version."""
    from importlib.metadata import version as v

    typer.echo(v("m1"))


def main() -> None:  # pragma: no cover
    app(sys.argv[1:])


def _mount_subapps() -> None:
    """Sub-apps live next to their code (their heavy imports stay inside their commands)."""
    app.add_typer(synth_app, name="synth", help="M1-Synth: generate videos and questions.")
    app.add_typer(experiment_app, name="experiment", help="Experiments: stages x arms x seeds as one command.")
    app.add_typer(data_app, name="data", help="Training data: question files split by video; teacher SFT examples.")
    app.add_typer(config_app, name="config", help="Config files: what each setting means, its value and its default.")
    app.command("serve")(serve_command)


_mount_subapps()
