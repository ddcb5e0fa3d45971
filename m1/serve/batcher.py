"""The worker that owns the team. A team answers fastest in batches (one call per model per phase), so requests
wait in a queue for a short gather window and then run together as one batch of episodes, on the path `m1 infer`
takes (`Team.run`), in a single thread (the models are not thread-safe)."""

import logging
import shutil
import threading
import time
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path

from m1.contracts import Team
from m1.schema import Episode, Question
from m1.serve.limits import Limits
from m1.serve.protocol import ApiError
from m1.video import out_of_handles

log = logging.getLogger("m1.serve")  # one logger for the whole server: operators filter on it
GATHER_ROUNDS = 20  # a batch waits at most this many gather windows for a burst to arrive


@dataclass
class _Job:
    question: Question
    future: Future
    tmp: Path | None
    cancelled: bool = False


_left: set[Path] = set()  # temporary folders that could not be removed yet: tried again at every cleanup
_reported: set[Path] = set()
_left_lock = threading.Lock()


def cleanup(tmp: Path | None) -> None:
    """Remove a request's temporary folder (its uploaded video or encoded frames), if it has one. One that cannot
    be removed now (out of file handles, say) is logged once and tried again at each later cleanup, so none is left
    behind once the cause has passed."""
    with _left_lock:
        todo = [*_left, *([Path(tmp)] if tmp is not None else [])]
        _left.clear()
    for folder in todo:
        try:
            shutil.rmtree(folder)
        except FileNotFoundError:
            pass
        except OSError as exc:
            with _left_lock:
                _left.add(folder)
                first = folder not in _reported
                _reported.add(folder)
            if first:
                log.warning("cannot remove the temporary folder %s yet (%s); trying again with the next request",
                            folder, exc.strerror or exc)
        else:
            with _left_lock:
                _reported.discard(folder)


class Batcher:
    """One thread that owns the team: it waits for a first request, gathers what else arrives within
    `gather_s` (up to the team's `limits.batch_episodes`), runs them as one batch through `team.run` and resolves
    each request's future with its episode. `submit` refuses (429) when `max_queue` requests wait or run."""

    def __init__(self, team: Team, limits: Limits):
        self.team, self.limits = team, limits
        self.batch = max(1, int(team.cfg.limits.batch_episodes))
        team.over_budget_rows = True  # a question too long for a model fails alone (400), not its batch
        self._queue: list[_Job] = []
        self._cv = threading.Condition()
        self._busy = 0
        self._stop = False
        self.batches: deque[int] = deque(maxlen=1000)  # sizes of the last batches run (tests, the benchmark)
        self._thread = threading.Thread(target=self._loop, name="m1-serve-team", daemon=True)
        self._thread.start()

    def submit(self, q: Question, tmp: Path | None) -> _Job:
        with self._cv:
            if self._stop:
                raise ApiError(503, "the server is shutting down", kind="server_shutting_down")
            if len(self._queue) + self._busy >= self.limits.max_queue:
                wait = max(1, round(self.limits.gather_s + 2))
                raise ApiError(429, f"{self.limits.max_queue} requests are already queued (--max-queue); retry later",
                               kind="rate_limit_error", headers={"Retry-After": str(wait)})
            job = _Job(q, Future(), tmp)
            self._queue.append(job)
            self._cv.notify()
            return job

    def cancel(self, job: _Job) -> bool:
        """A request nobody waits for (timed out, or its client gone): dropped if it has not started (True); else
        its episode finishes and is discarded (False)."""
        with self._cv:
            job.cancelled = True
            if job in self._queue:
                self._queue.remove(job)
                cleanup(job.tmp)
                return True
            return False

    def _loop(self) -> None:
        while True:
            with self._cv:
                while not self._queue and not self._stop:
                    self._cv.wait()
                if not self._queue and self._stop:
                    return
            self._gather()
            with self._cv:
                jobs, self._queue = self._queue[:self.batch], self._queue[self.batch:]
                self._busy = len(jobs)
            if not jobs:
                continue
            self.batches.append(len(jobs))
            self._run_batch(jobs)

    def _run_batch(self, jobs: list[_Job]) -> None:
        """Run one batch and resolve its requests. Its places in the queue are freed before the replies go out: a
        client that sends its next request the moment it has its answer is not refused (429) for its own
        finished batch."""
        episodes: list[Episode] = []
        error: Exception | None = None
        try:
            try:
                episodes = self.team.run([j.question for j in jobs])
            except Exception as exc:  # a model that failed: every request of the batch gets a 500, the server stays
                error = exc
                if out_of_handles(exc) is None:  # out of file handles: the app logs it once per request, as a 503
                    log.error("batch of %d failed: %s: %s", len(jobs), type(exc).__name__, exc)
            with self._cv:
                self._busy = 0
                self._cv.notify_all()
            for i, j in enumerate(jobs):
                if j.future.done():  # a timed-out request's future was cancelled
                    continue
                if error is None:
                    j.future.set_result(episodes[i])
                else:
                    j.future.set_exception(error)
        finally:
            for j in jobs:
                uploaded = j.tmp is not None and Path(j.tmp) in Path(j.question.video).parents
                if uploaded:  # its reader, frames, CLIP rows: dropped
                    self.team.forget_video(j.question.video)
                cleanup(j.tmp)
            with self._cv:
                self._busy = 0
                self._cv.notify_all()

    def _gather(self) -> None:
        """Let requests that arrive together join one batch: wait `gather_s`, and again while more keep arriving
        (clients of a burst are parsed one after another, so on a busy machine a burst spreads out), at most
        GATHER_ROUNDS times and never once the batch is full."""
        seen = -1
        for _ in range(GATHER_ROUNDS):
            with self._cv:
                n = len(self._queue)
            if n >= self.batch or n == seen:
                return
            seen = n
            time.sleep(self.limits.gather_s)

    def drain(self, timeout: float | None = None) -> None:
        """Refuse new requests, finish those queued and running, then stop the thread."""
        with self._cv:
            self._stop = True
            self._cv.notify_all()
        self._thread.join(timeout)
        cleanup(None)  # folders a full file table kept from being removed

    @property
    def pending(self) -> int:
        with self._cv:
            return len(self._queue) + self._busy
