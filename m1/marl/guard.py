"""How `m1 train`, `m1 sft` and an experiment's training stages end (m1/cli.py, m1/experiment/cli.py): a stop by a
signal prints the stop report and exits with 128 + the signal; what a user can cause or meet is one `error:` line
(m1/errors.py `describe`, status 2); anything else is a bug and keeps its traceback. It lives with the training code
because the errors it names are m1/marl's (and the config's and the models'), all below it; m1/errors.py stays at the
bottom of the package."""
from __future__ import annotations

import sys

import typer

from m1.errors import debug_requested, describe, fail
from m1.locks import LockError
from m1.models.base import ModelError


def training_errors() -> tuple[type[Exception], ...]:
    """What a user of `m1 train` / `m1 sft` can cause or meet, printed as one `error:` line: a config, a model or
    engine that cannot load or answer (a missing folder, a damaged weights file, a dead server), a cluster that cannot
    hold the plan, a rollout that cannot be trained on, a damaged checkpoint, a file that cannot be read or written
    (a full disk), a run already using the output folder, a Ray worker that died. Anything else is a bug: traceback."""
    from safetensors import SafetensorError

    from m1.config_files import ConfigError
    from m1.marl.checkpoint import CheckpointError
    from m1.marl.plan.cluster import PlanError
    from m1.marl.actor.distributed import DistributedError
    from m1.marl.rollout.episodes import RolloutError

    errors: tuple[type[Exception], ...] = (ConfigError, ModelError, DistributedError, PlanError, RolloutError,
                                           CheckpointError, OSError, ValueError, SafetensorError)

    errors += (LockError,)
    if "ray" in sys.modules:  # only a run that started Ray can meet its errors; importing it costs seconds
        from ray.exceptions import RayError

        errors += (RayError,)
    return errors


OUT_DIR_ADVICE = "--set out_dir=ANOTHER_FOLDER"  # how `m1 train`, `m1 sft` and `m1 experiment run` name their output


def train_guarded(run, debug: bool) -> None:
    """Run `m1 train` / `m1 sft` / `m1 experiment run`: a stop by a signal prints the stop report and exits with 128 +
    the signal (143 SIGTERM, 130 SIGINT); what a user can meet is one `error:` line (status 2), a read-only output
    folder advising `--set out_dir=...` (their output is the config's out_dir; none of them has --out)."""
    from m1.marl.checkpoint import StoppedAtOnce, TrainingStopped

    try:
        run()
    except (TrainingStopped, StoppedAtOnce) as exc:
        if isinstance(exc, StoppedAtOnce) and debug_requested(debug):
            import traceback

            traceback.print_exception(type(exc), exc, exc.__traceback__, file=sys.stderr)
        typer.secho(str(exc), fg=typer.colors.YELLOW, err=True)
        raise typer.Exit(exc.exit_status)
    except training_errors() as exc:
        fail(describe(exc, OUT_DIR_ADVICE), exc, debug)
