"""Writing files whole: a results line, a trace, an index or a shard record is on disk complete or not at all.

A full disk (or quota) mid-write must never leave half a line or half a page where a reader, or a resumed run,
would find it: lines are appended with one unbuffered write and cut back on failure (m1/results.py), whole files go
through a temporary file renamed over the target. Every such write opens its file through `open_for_write`, the
one place tests put a full disk.
"""
from __future__ import annotations

import errno
import os
import stat
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator


class WriteError(RuntimeError):
    """A results line or trace could not be written whole (disk full, ...). The file was cut back to
    what it held before, so nothing is torn; the run stops and the same command resumes it."""

    def __init__(self, path: Path, exc: OSError, question: str | None = None, safe: int | None = None,
                 results: Path | None = None):
        self.path, self.exc, self.question, self.safe, self.results = Path(path), exc, question, safe, results
        self.disk_full = exc.errno in (errno.ENOSPC, errno.EDQUOT)
        where = f"{path}" + (f" (question {question})" if question else "")
        head = (f"disk full while writing {where}: free space and rerun the same command" if self.disk_full else
                f"could not write {where} ({exc.strerror or exc}): fix that and rerun the same command")
        tail = f"; {safe} answers are safely written in {results}" if safe is not None else ""
        super().__init__(head + tail)


class PlaceError(OSError):
    """An output place that cannot be what the command writes there (a FIFO or a device where a results file goes, a
    file where a folder goes). An OSError, so every command's error path prints it as its one `error:` line."""

    def __str__(self) -> str:
        return str(self.args[0])


_KINDS = ((stat.S_ISFIFO, "a FIFO (named pipe)"), (stat.S_ISCHR, "a character device"),
          (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"))


def _kind(mode: int) -> str:
    return next((name for test, name in _KINDS if test(mode)), "not a regular file")


def check_place(path: Path, what: str, folder: bool = False) -> None:
    """Refuse, before anything is opened, an output place that is not a regular file (or a folder, with `folder`)
    where one exists, or whose path runs through a file: opening a FIFO blocks until a reader comes (a run that hangs
    holding its lock), a device swallows what is written, and results and checkpoints are read back to resume, which
    neither can do. `what` names the place in the message (`--out`, `--trace-dir`, `out_dir`)."""
    path = Path(path)
    for parent in reversed(path.parents):
        try:
            mode = os.stat(parent).st_mode
        except FileNotFoundError:
            break  # made on the way
        except OSError:
            return  # permission and the like: the open that follows names them
        if not stat.S_ISDIR(mode):
            raise PlaceError(f"{what} {path}: {parent} is a file where a folder is needed (part of the path); "
                             f"give a path through folders, or move {parent}")
    try:
        mode = os.stat(path).st_mode
    except OSError:
        return  # absent (made by the command) or unreadable (named by the open that follows)
    if folder and not stat.S_ISDIR(mode):
        what_is = "a file" if stat.S_ISREG(mode) else _kind(mode)
        raise PlaceError(f"{what} {path}: a folder is expected here and {what_is} is in the way; give another "
                         f"folder, or move it")
    if not folder and not stat.S_ISREG(mode) and not stat.S_ISDIR(mode):  # a folder is named by its own message
        raise PlaceError(f"{what} {path}: is {_kind(mode)}, not a regular file; the run writes a file here that it "
                         f"locks and reads back to resume: give a file path (to follow it as it grows: tail -f)")


def open_for_write(path: Path, mode: str):
    """The one place results lines and traces are opened for writing (unbuffered: each `write` is
    one system call). Tests put a full disk here."""
    return open(path, mode, buffering=0)


def write_all(f, data: bytes) -> None:
    view, done = memoryview(data), 0
    while done < len(data):
        n = f.write(view[done:])
        if not n:  # a regular file takes no more bytes: the disk is full
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        done += n


def write_whole(path: Path, data: bytes) -> None:
    """Write `path` through a temporary file renamed over it: readers see the old file or the new
    one, never half of one. On failure (disk full) the temporary file is removed and WriteError raised."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open_for_write(tmp, "wb") as f:
            write_all(f, data)
            os.fsync(f.fileno())
        tmp.replace(path)
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        raise WriteError(path, exc) from None


# what libraries that write through their own code (safetensors, tokenizers: Rust) say for a full or read-only disk
_FOREIGN_OS_ERRORS = ((errno.ENOSPC, ("No space left on device", "os error 28")),
                      (errno.EDQUOT, ("Disk quota exceeded", "os error 122")),
                      (errno.EROFS, ("Read-only file system", "os error 30")))


@contextmanager
def disk_errors(path: Path) -> Iterator[None]:
    """Inside, a library's own exception for a full or read-only disk (safetensors' SafetensorError, a tokenizers
    Exception) is raised again as the OSError it is, naming `path`, so the command's one error line says which place
    is full and which setting moves it (M1_CACHE for the model cache) instead of a traceback."""
    try:
        yield
    except OSError:
        raise
    except Exception as exc:
        text = str(exc)
        for code, marks in _FOREIGN_OS_ERRORS:
            if any(m in text for m in marks):
                raise OSError(code, os.strerror(code), str(path)) from exc
        raise
