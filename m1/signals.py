"""Stopping a run between two results lines on SIGTERM / SIGINT (`StopOnSignals`), and `Stopped`, the stop it raises.

A kill must never tear a results line or a trace, yet a run of thousands of questions must stop promptly: a first
signal outside a write stops at once, one during a write waits for the line to be whole. It is its own module so
that the commands and the experiment runner catch `Stopped` without importing the run (m1/run.py); it needs only the
standard library, so it sits at the bottom layer.
"""
from __future__ import annotations

import os
import signal
import threading
from contextlib import contextmanager


class Stopped(BaseException):
    """A run stopped by SIGTERM/SIGINT between two results lines. A BaseException (like
    KeyboardInterrupt) so that no `except Exception` inside the team records it as an episode's error."""

    def __init__(self, signum: int, message: str = ""):
        self.signum = signum
        self.exit_status = 128 + signum  # the shell's convention: 130 for SIGINT, 143 for SIGTERM
        super().__init__(message or f"stopped by {signal.Signals(signum).name}")


class StopOnSignals:
    """SIGTERM / SIGINT stop a run between two results lines: outside a write, the first signal
    raises Stopped at once (the episodes in flight are dropped; they are redone on resume); during
    a write it waits until the line is whole. A second signal exits at once (status 128 + signal)."""

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self):
        self.signum: int | None = None
        self.writing = False
        self._old: dict[int, object] = {}

    def _handler(self, signum, frame) -> None:
        if self.signum is not None:
            os._exit(128 + signum)
        self.signum = signum
        if not self.writing:
            raise Stopped(signum)

    @contextmanager
    def write(self):
        """A section no first signal interrupts (one results line and its trace)."""
        self.writing = True
        try:
            yield
        finally:
            self.writing = False
        if self.signum is not None:
            raise Stopped(self.signum)

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():  # signals reach the main thread only
            for s in self.SIGNALS:
                self._old[s] = signal.signal(s, self._handler)
        return self

    def __exit__(self, *exc) -> None:
        for s, h in self._old.items():
            signal.signal(s, h)
