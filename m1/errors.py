"""How the commands end when a user meets a problem: one `error:` line naming the thing and what to do (exit 2), and
the traceback only with --debug or M1_DEBUG=1. Shared by m1/cli.py and the sub-commands (m1/experiment/cli.py, ...).
It sits at the bottom of the package, naming no error class above m1/files.py and m1/locks.py; how training ends (a
stop by a signal reported with 128 + the signal, the errors of m1/marl) is m1/marl/guard.py's."""
from __future__ import annotations

import os
import sys
from typing import NoReturn

import typer
from typer.core import TyperGroup

from m1.files import PlaceError, WriteError
from m1.locks import LockError


def report_startup(warnings: list[str], errors: list[str]) -> None:
    """Print a command's start-up check (m1/models/preflight.py `startup_problems`): each warning as a `warning:`
    line, then, if any, each error as an `error:` line and stop (exit 2), before any question runs."""
    for line in warnings:
        typer.secho(f"warning: {line}", fg=typer.colors.YELLOW, err=True)
    for line in errors[:-1]:
        typer.secho(f"error: {line}", fg=typer.colors.RED, err=True)
    if errors:
        fail(errors[-1])


def debug_requested(flag: bool = False) -> bool:
    """--debug, or M1_DEBUG=1 in the environment: show the traceback behind an `error:` line."""
    return flag or os.environ.get("M1_DEBUG", "").strip().lower() in ("1", "true", "yes", "on")


def cache_home() -> str:
    """The cache of built tiny models and synth CLIPs: $M1_CACHE, else ~/.cache/m1."""
    return os.environ.get("M1_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "m1")


def _within(path: str, folder: str) -> bool:
    return path == folder or path.startswith(folder.rstrip(os.sep) + os.sep)


def _in_cache(name: str) -> bool:
    """`name` is the model cache, inside it, or a folder made on the way to it below the home folder (creating
    ~/.cache/m1 on a read-only HOME fails on ~/.cache first)."""
    root = os.path.abspath(cache_home())
    path = os.path.abspath(name)
    home = os.path.abspath(os.path.expanduser("~"))
    return _within(path, root) or (_within(root, path) and path != home and _within(path, home))


def _place(name: str, out: str | None, places: dict | None) -> str:
    """The setting that moves the place `name` is in: the cache's M1_CACHE, a folder given in `places`
    ({folder: "another --trace-dir"}), else `out` ("another --out"); '' when none is known."""
    path = os.path.abspath(name)
    if _in_cache(name):
        return env_advice("M1_CACHE")
    for folder, how in (places or {}).items():
        if folder is not None and _within(path, os.path.abspath(folder)):
            return how
    return out or ""


def env_advice(var: str) -> str:
    """The advice for a place an environment variable moves (M1_CACHE, TMPDIR)."""
    return f"point the {var} environment variable at a folder on a disk that is writable and has room"


def describe(exc: BaseException, out: str | None = None, places: dict | None = None) -> str:
    """One line for an error a user met: what failed, on which file, and what to do. `out`: the flag or setting
    that names the command's output (e.g. "another --out"), named as the way out of a read-only or full disk;
    `places`: other folders the command writes and their settings ({trace_dir: "another --trace-dir"}). The model
    cache names M1_CACHE, the temp folder TMPDIR."""
    import errno

    if isinstance(exc, PlaceError):  # already says which place, what is there and what to do
        return str(exc)
    if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT):
        name = exc.filename or "the output"
        how = _place(str(exc.filename), None, places) if exc.filename else ""
        how = f"free space (or {how})" if how.startswith("point") else f"free space{f' ({how})' if how else ''}"
        return (f"disk full while writing {name}: {how} and rerun the same command (it resumes from the last "
                f"checkpoint)")
    if isinstance(exc, OSError) and exc.filename:
        name, code = exc.filename, exc.errno
        if code in (errno.EROFS, errno.EACCES, errno.EPERM):
            how = _place(str(name), out, places)
            if code != errno.EROFS:
                return (f"{name}: permission denied; give this user access to it (or choose another path"
                        f"{f': {how}' if how else ''}), then rerun")
            if how.startswith("point"):
                return f"{name}: read-only file system; {how}, then rerun"
            return (f"{name}: read-only file system; write to a folder on a writable disk{f' ({how})' if how else ''}"
                    f", then rerun")
        if code == errno.EISDIR:
            return f"{name}: is a folder where a file is needed; give a file path, then rerun"
        if code == errno.ENOTDIR:
            return f"{name}: a part of this path is a file where a folder is needed; check the path, then rerun"
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
        from m1.plugins import PluginError, load_plugins

        debug = "--debug" in (*ctx._protected_args, *ctx.args)
        try:
            load_plugins()  # what installed packages register is there before any config is read
        except PluginError as exc:
            fail(str(exc), exc, debug)
        try:
            return super().invoke(ctx)
        except (WriteError, LockError) as exc:  # their messages already name the file and what to do
            fail(str(exc), exc, debug)
        except (OSError, UnicodeError) as exc:
            fail(describe(exc), exc, debug)
