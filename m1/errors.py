"""How the commands end when a user meets a problem: one `error:` line naming the thing and what to do (exit 2), a
stop by a signal reported with 128 + the signal, and the traceback only with --debug or M1_DEBUG=1. Shared by
m1/cli.py and the sub-commands (m1/experiment/cli.py)."""
from __future__ import annotations

import os
import sys
from typing import NoReturn

import typer
from typer.core import TyperGroup


def training_errors() -> tuple[type[Exception], ...]:
    """What a user of `m1 train` / `m1 sft` can cause or meet, printed as one `error:` line: a config, a model or
    engine that cannot load or answer (a missing folder, a damaged weights file, a dead server), a cluster that cannot
    hold the plan, a rollout that cannot be trained on, a damaged checkpoint, a file that cannot be read or written
    (a full disk), a run already using the output folder, a Ray worker that died. Anything else is a bug: traceback."""
    from safetensors import SafetensorError

    from m1.config import ConfigError
    from m1.marl.checkpoint import CheckpointError
    from m1.marl.cluster import PlanError
    from m1.marl.distributed import DistributedError
    from m1.marl.rollout import RolloutError
    from m1.models.base import ModelError

    errors: tuple[type[Exception], ...] = (ConfigError, ModelError, DistributedError, PlanError, RolloutError,
                                           CheckpointError, OSError, ValueError, SafetensorError)
    from m1.locks import LockError

    errors += (LockError,)
    if "ray" in sys.modules:  # only a run that started Ray can meet its errors; importing it costs seconds
        from ray.exceptions import RayError

        errors += (RayError,)
    return errors


def debug_requested(flag: bool = False) -> bool:
    """--debug, or M1_DEBUG=1 in the environment: show the traceback behind an `error:` line."""
    return flag or os.environ.get("M1_DEBUG", "").strip().lower() in ("1", "true", "yes", "on")


def describe(exc: BaseException) -> str:
    """One line for an error a user met: what failed, on which file, and what to do."""
    import errno

    if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return (f"disk full while writing {exc.filename or 'the output'}: free space and rerun the same command "
                f"(it resumes from the last checkpoint)")
    if isinstance(exc, OSError) and exc.filename:
        name, code = exc.filename, exc.errno
        if code == errno.EROFS:
            return f"{name}: read-only file system; write to a folder on a writable disk (another --out), then rerun"
        if code == errno.EISDIR:
            return f"{name}: is a folder where a file is needed; give a file path, then rerun"
        if code == errno.ENOTDIR:
            return f"{name}: a part of this path is a file where a folder is needed; check the path, then rerun"
        if code in (errno.EACCES, errno.EPERM):
            return (f"{name}: permission denied; give this user access to it (or choose another path), "
                    f"then rerun")
        if code == errno.ENOENT:
            return f"{name}: no such file or folder; check the path, then rerun"
        return f"{name}: {exc.strerror or exc}; check the path and its permissions, then rerun"
    if isinstance(exc, OSError):  # no file named: say what the system said
        return f"{exc.strerror or exc} while reading or writing a file; rerun with --debug to see which"
    if isinstance(exc, UnicodeDecodeError):
        return (f"a file is not UTF-8 text ({exc.reason} at byte {exc.start}); save it as UTF-8, then rerun "
                f"(--debug shows which file)")
    if type(exc).__name__ == "SafetensorError":
        return f"a weights file does not read ({exc}): damaged or truncated? rerun with --debug to see which"
    if type(exc).__module__.startswith("ray"):
        first = (str(exc).strip().splitlines() or [""])[0]
        return (f"a Ray worker failed ({type(exc).__name__}: {first}); see the Ray logs, then rerun the same "
                f"command to resume from the last checkpoint")
    return str(exc) or type(exc).__name__


def fail(msg: str, exc: BaseException | None = None, debug: bool = False) -> NoReturn:
    """Print `error: msg` and exit with status 2; with --debug / M1_DEBUG=1, `exc`'s traceback first."""
    if exc is not None and debug_requested(debug):
        import traceback

        traceback.print_exception(type(exc), exc, exc.__traceback__, file=sys.stderr)
    typer.secho(f"error: {msg}", fg=typer.colors.RED, err=True)
    raise typer.Exit(2)


class GuardedGroup(TyperGroup):
    """The one error path of every `m1` command: an OSError (read-only, a folder where a file belongs, permission,
    a full disk), a decoding error, a whole-file write or a lock that no command turned into its own message still
    ends as one `error:` line naming the file (status 2), not a traceback; `--debug` on the command line or
    M1_DEBUG=1 keeps the traceback."""

    def invoke(self, ctx):
        from m1.files import WriteError
        from m1.locks import LockError

        debug = "--debug" in (*ctx._protected_args, *ctx.args)
        try:
            return super().invoke(ctx)
        except (WriteError, LockError) as exc:  # their messages already name the file and what to do
            fail(str(exc), exc, debug)
        except (OSError, UnicodeError) as exc:
            fail(describe(exc), exc, debug)


def train_guarded(run, debug: bool) -> None:
    """Run `m1 train` / `m1 sft`: a stop by a signal prints the stop report and exits with 128 + the signal (143
    SIGTERM, 130 SIGINT); what a user can meet is one `error:` line (status 2)."""
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
        fail(describe(exc), exc, debug)
