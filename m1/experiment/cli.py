"""`m1 experiment run|report|export EXPERIMENT.yaml` (mounted by m1/cli.py). Heavy imports stay inside the commands."""
from __future__ import annotations

from typing import Optional

import typer

from m1.errors import describe, fail
from m1.files import WriteError
from m1.locks import LockError
from m1.marl.guard import train_guarded
from m1.models.base import ModelError
from m1.signals import Stopped

app = typer.Typer(add_completion=False, no_args_is_help=True,
                  help="Experiments: stages (sft -> marl -> eval) x arms x seeds, resumable, then a report.")

_EXP_HELP = "Experiment YAML: a path or a name in configs/experiments/."


_SET_HELP = "Experiment override key.path=value (repeat), e.g. eval.questions=BENCH.jsonl."


def _load(experiment: str, overrides: Optional[list[str]]):
    from m1.config_files import ConfigError
    from m1.experiment.config import load_experiment

    try:
        return load_experiment(experiment, overrides or [])
    except ConfigError as exc:
        fail(str(exc))


@app.command()
def run(
    experiment: str = typer.Argument(..., help=_EXP_HELP),
    overrides: Optional[list[str]] = typer.Option(None, "--set", "-s", help=_SET_HELP),
    plan: bool = typer.Option(False, "--plan", help="Print the stages x arms x seeds and each training stage's "
                                                   "placement plan, then exit; runs and loads no model."),
    gpus: Optional[int] = typer.Option(None, "--gpus", min=0, help="Plan for N GPUs (with --plan)."),
    gpu_mem: Optional[float] = typer.Option(None, "--gpu-mem", min=0.0, help="Memory of one GPU in GB (with --plan)."),
    jobs: int = typer.Option(1, "--jobs", "-j", min=1, help="Run this many seeds at once, each in its own process "
                                                          "with its share of the CPU threads (logs in OUT/logs)."),
    debug: bool = typer.Option(False, "--debug", help="Show the traceback behind an error (also: M1_DEBUG=1)."),
) -> None:
    """Run every unfinished stage of every arm and seed, each in <out_dir>/<arm>/seed<k>/<stage>.

    A stage is finished once its folder holds stage.json; rerunning skips finished stages and resumes the one
    that was under way. Each finished stage is also recorded under rows_dir (docs/experiments/<name>; commit it):
    a run without out_dir skips what those records hold. Exit status as for `m1 train` (2: an error; 130/143:
    stopped by a signal, rerun to resume)."""
    exp = _load(experiment, overrides)
    if plan:
        from m1.config_files import ConfigError
        from m1.marl.plan.cluster import PlanError
        from m1.experiment.plan import plan_text

        try:
            text, fits = plan_text(exp, gpus, gpu_mem)
        except (ConfigError, PlanError) as exc:
            fail(str(exc))
        typer.echo(text)
        if not fits:
            fail("a training stage's plan does not fit or one of its models cannot be built (see `fits: NO` and "
                 "`model refused:` above)")
        return
    from m1.experiment.runner import run_experiment
    from m1.data.questions import InputError

    def go() -> None:
        try:
            run_experiment(exp, progress=typer.echo, jobs=jobs)
        except (InputError, LockError, WriteError) as exc:
            fail(describe(exc), exc, debug)
        except Stopped as exc:
            typer.secho(str(exc), fg=typer.colors.YELLOW, err=True)
            raise typer.Exit(exc.exit_status)

    train_guarded(go, debug)
    typer.echo(f"experiment {exp.name} done; report: m1 experiment report {experiment}")


@app.command()
def report(experiment: str = typer.Argument(..., help=_EXP_HELP),
           overrides: Optional[list[str]] = typer.Option(None, "--set", "-s", help=_SET_HELP)) -> None:
    """Accuracy per arm (mean ± sd over seeds, overall and per family), paired differences to the baseline arm with
    95% t intervals and the answers each arm fixed and broke against it, and training curves: report.md, report.csv
    and plots/<arm>.png in the experiment's out_dir. Built from the eval rows, which the committed records under
    rows_dir hold where the run folders are absent."""
    from m1.experiment.report import write_report
    from m1.experiment.config import ExperimentError
    from m1.data.questions import InputError

    exp = _load(experiment, overrides)
    try:
        out = write_report(exp)
    except (ExperimentError, InputError, OSError) as exc:
        fail(str(exc))
    typer.echo(out["text"])
    typer.echo(f"wrote {out['markdown']}, {out['csv']}" + "".join(f", {p}" for p in out["plots"]))


@app.command()
def export(experiment: str = typer.Argument(..., help=_EXP_HELP),
           dest: str = typer.Argument(..., help="Folder for DEST/<agent> (each agent folder replaced whole)."),
           arm: str = typer.Option(..., "--arm", help="The arm whose trained agents are written."),
           seed: Optional[int] = typer.Option(None, "--seed", help="Which seed's agents (default: the first seed)."),
           overrides: Optional[list[str]] = typer.Option(None, "--set", "-s", help=_SET_HELP),
           debug: bool = typer.Option(False, "--debug", help="Show the traceback behind an error (also: M1_DEBUG=1).")
           ) -> None:
    """Write an arm's trained agents, as its eval seats them, to DEST/<agent>: full model folders with their
    tokenizer (a LoRA adapter merged into its base), no optimizer state, and DEST/SOURCE.md naming their origin.
    A team config can then point `path` at them (configs/team/mini_trained.yaml reads assets/mini_team)."""
    from m1.config_files import ConfigError
    from m1.experiment.export import export_agents
    from m1.experiment.config import ExperimentError

    exp = _load(experiment, overrides)
    try:
        written = export_agents(exp, arm, exp.seeds[0] if seed is None else seed, dest, progress=typer.echo)
    except (ExperimentError, ConfigError, ModelError, OSError) as exc:
        fail(describe(exc), exc, debug)
    typer.echo(f"wrote {len(written)} agents to {dest}: {', '.join(written)}")
