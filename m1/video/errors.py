"""How reading a video fails: `VideoError` names the file and the cause; running out of file handles stays the
OSError it is (`out_of_handles`), since no video is at fault. The backends' own exception types, and one readable
line from them, are here so every module wraps them the same way."""
from __future__ import annotations

import errno
import os
import re

from m1.signature import Signature


class VideoError(Exception):
    """A video could not be opened or decoded; `.path` is the file, `.reason` the cause."""

    def __init__(self, path: str | os.PathLike, reason: str):
        self.path = str(path)
        self.reason = reason
        super().__init__(f"cannot read video {self.path}: {reason}")

    def __reduce__(self):  # keep pickling (worker processes) working with the two-arg init
        return (type(self), (self.path, self.reason))


class VideoChanged(VideoError):
    """The file changed on disk after M1 began reading it: frames of two files must never be mixed in one answer, so
    the question is an error row that a rerun answers from the new file."""

    @classmethod
    def of(cls, path: str | os.PathLike, was: Signature, now: Signature | None) -> VideoChanged:
        now_text = f"now {now}" if now is not None else "now unreadable"
        return cls(path, f"the file changed on disk while it was being read (was {was}; {now_text}); "
                         "rerun to answer from the new file")


def out_of_handles(exc: BaseException) -> OSError | None:
    """The OSError to raise when `exc` says the process or system ran out of file handles (EMFILE/ENFILE, as an
    OSError or in FFmpeg's and decord's words), else None. That is no fault of the video, so it must not become a
    VideoError (an error row, a 400 that blames the file): the caller stops, or `m1 serve` answers 503."""
    if isinstance(exc, OSError) and exc.errno in (errno.EMFILE, errno.ENFILE):
        return exc
    text = str(exc)
    if "Too many open files" in text:
        code = errno.ENFILE if "in system" in text else errno.EMFILE
        return OSError(code, os.strerror(code))
    return None


def cause_of(exc: BaseException) -> str:
    """One readable line from a backend exception (decord appends long C++ stack traces)."""
    text = str(exc).split("Stack trace", 1)[0].strip().replace("\n", " ")
    text = re.sub(r"^\[\d\d:\d\d:\d\d\] ", "", text)  # decord's log-time prefix
    if len(text) > 300:
        text = text[:300] + "..."
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def decord_errors() -> tuple[type[BaseException], ...]:
    try:
        from decord import DECORDError
    except ImportError:
        return (RuntimeError,)
    return (RuntimeError, DECORDError)


def av_errors() -> tuple[type[BaseException], ...]:
    import av

    return (av.FFmpegError, OSError, RuntimeError, ValueError, EOFError)
