"""One writer at a time for what a run writes: a results file, a training output folder.

Two runs appending to one results file would answer every question twice; two trainers in one
`out_dir` would overwrite each other's checkpoints. So a run takes an OS lock (`fcntl.flock`) on a
lock file beside its target (`results.jsonl.lock`, `<out_dir>/.lock`) and writes into it who holds
it: host, pid, start time and command. A second run is refused at once with an error naming the
holder. The kernel releases a flock when its process dies, however it dies, so a lock file left by
a killed run holds nothing and is simply taken over (with a warning naming the dead run).

API:
    with hold(path, "results file"):        # lock file: <path>.lock
        ...
    with hold_dir(out_dir, "training output folder"):   # lock file: <out_dir>/.lock
        ...
Both raise `LockError` (one line, naming the holder and what to do) when another process holds it.
The lock file is removed on a clean release. flock does not reach across hosts on every network file
system; the lock protects runs on one machine and, on file systems where flock is shared (NFS v4,
Lustre with flock), across machines too.
"""
from __future__ import annotations

import errno
import fcntl
import json
import os
import shlex
import socket
import sys
import time
from contextlib import contextmanager
from datetime import datetime, timezone
from pathlib import Path
from typing import Callable, Iterator

from m1.files import check_place


class LockError(RuntimeError):
    """Another run holds the lock; the message names it and says what to do."""


def lock_path(target: Path) -> Path:
    """The lock file of a file target: `<target>.lock` beside it."""
    target = Path(target)
    return target.with_name(target.name + ".lock")


def _command() -> str:
    argv = list(sys.argv)
    if argv and (Path(argv[0]).name in ("m1", "__main__.py")):
        argv[0] = "m1"
    text = shlex.join(argv)
    return text if len(text) <= 300 else text[:297] + "..."


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        return True
    return True


def _read_info(fd: int) -> dict | None:
    os.lseek(fd, 0, os.SEEK_SET)
    raw = b""
    while chunk := os.read(fd, 65536):
        raw += chunk
    if not raw.strip():
        return None
    try:
        info = json.loads(raw)
    except json.JSONDecodeError:
        return {"unreadable": raw[:200].decode(errors="replace")}
    return info if isinstance(info, dict) else {"unreadable": str(info)[:200]}


def _await_info(fd: int, wait_s: float = 2.0) -> dict | None:
    """The holder's record. A holder that has just taken the lock writes it within moments (until then the file
    is empty, or still names the killed run it took over from), so wait briefly rather than name the wrong one."""
    deadline = time.monotonic() + wait_s
    while True:
        info = _read_info(fd)
        fresh = bool(info) and not (info.get("host") == socket.gethostname() and isinstance(info.get("pid"), int)
                                    and not _pid_alive(info["pid"]))
        if fresh or time.monotonic() >= deadline:
            return info
        time.sleep(0.05)


def describe(info: dict | None) -> str:
    """'pid 1234 on host h since 2026-11-26T07:00:00Z (m1 infer ...)' from a lock file's record."""
    if not info:
        return "another process (it has not written its details yet)"
    if "unreadable" in info:
        return f"another process (lock file reads {info['unreadable']!r})"
    cmd = f" ({info['command']})" if info.get("command") else ""
    return f"pid {info.get('pid', '?')} on host {info.get('host', '?')} since {info.get('started', '?')}{cmd}"


def _warn_stderr(msg: str) -> None:
    print(f"warning: {msg}", file=sys.stderr, flush=True)


@contextmanager
def hold(target: Path, what: str = "file", advice: str = "wait for it to finish, or stop it",
         lock_file: Path | None = None, warn: Callable[[str], None] | None = None) -> Iterator[Path]:
    """Hold the lock of `target` for the body; `what` names the target in messages ("results file").

    Raises LockError at once if another live process holds it. A lock file that no process holds
    (its run was killed) is taken over, with a warning through `warn` (default: stderr) naming that run.
    Yields the lock file's path."""
    target = Path(target)
    check_place(target, what, folder=lock_file is not None and Path(lock_file).parent == target)
    lf = Path(lock_file) if lock_file else lock_path(target)
    lf.parent.mkdir(parents=True, exist_ok=True)
    warn = warn or _warn_stderr
    while True:
        fd = os.open(lf, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            info = _await_info(fd)
            os.close(fd)
            raise LockError(f"{what} {target} is being written by {describe(info)}; {advice}") from None
        except OSError as exc:
            os.close(fd)
            if exc.errno in (errno.ENOLCK, errno.EOPNOTSUPP):
                raise LockError(f"{lf}: this file system does not support locks ({exc.strerror}); "
                                f"put {target} on a local disk") from None
            raise
        # the previous holder may have removed the file between our open and our flock: then we hold a
        # lock on a deleted file that nobody else will see; open the path again.
        try:
            same = os.stat(lf).st_ino == os.fstat(fd).st_ino
        except FileNotFoundError:
            same = False
        if same:
            break
        os.close(fd)
    try:
        old = _read_info(fd)
        if old:
            host, pid = old.get("host"), old.get("pid")
            if host == socket.gethostname() and isinstance(pid, int) and not _pid_alive(pid):
                warn(f"taking over the lock of {what} {target}: it was left by {describe(old)}, "
                     f"and pid {pid} is gone (killed?); its finished work is kept and resumed")
            else:
                warn(f"taking over the lock of {what} {target}: it was left by {describe(old)}, "
                     f"which no longer holds it (killed?); its finished work is kept and resumed")
        record = {"host": socket.gethostname(), "pid": os.getpid(),
                  "started": datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"), "command": _command()}
        os.ftruncate(fd, 0)
        os.lseek(fd, 0, os.SEEK_SET)
        os.write(fd, (json.dumps(record) + "\n").encode())
        yield lf
    finally:
        try:
            os.unlink(lf)  # before unlocking: a waiter that opened the old file sees it is gone and reopens
        except FileNotFoundError:
            pass
        os.close(fd)


def hold_dir(out_dir: Path, what: str = "output folder",
             advice: str = "wait for it to finish, or give this run another output folder",
             warn: Callable[[str], None] | None = None):
    """Hold `out_dir` for one run (lock file `<out_dir>/.lock`); see `hold`. For `m1 train` / `m1 sft`."""
    out_dir = Path(out_dir)
    return hold(out_dir, what, advice, lock_file=out_dir / ".lock", warn=warn)
