"""Asynchronous rollouts: a producer thread samples the next steps while the learners update (rollout.max_staleness).

The schedule is lagged and fixed in advance: step t's episodes are sampled with the weights after update
v(t) = max(0, t - k). So at k = 1 the engines sample step t + 1 with version t while the learners turn step t's
samples into version t + 1, and a step costs about max(rollout, update) instead of their sum. A step's data depends
only on (seed, t, the data cursor, the weights of v(t)), never on thread timing: two runs with the same seed train
on the same samples, and a resumed run repeats the uninterrupted one.

Who does what:
- the producer (this thread) owns the question cursor, the teams and the credit strategy; before step t it waits
  until version v(t) is staged, switches the engines to it (`RolloutEngines.activate`) and runs the step's
  rollouts, rewards and advantages; the finished step goes on a queue;
- the trainer's thread takes steps off the queue in order, updates the learners, and stages the new version on the
  engines (`RolloutEngines.stage`: the learners are only ever read from their own thread).

The engines are separate processes (rollout.engine vllm), so the producer mostly waits on HTTP with the GIL
released while the update computes. An error in the producer is raised in the trainer's thread, naming its step.
"""
from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

from m1.marl.algo.credit import StepCredit
from m1.marl.rollout.episodes import RolloutError

log = logging.getLogger(__name__)


def sampling_version(step: int, k: int) -> int:
    """The weight version (updates done) step `step`'s episodes are sampled with, at max_staleness k."""
    return max(0, step - k)


@dataclass(frozen=True)
class StepItem:
    """One step's rollouts, scored and credited, as the producer hands them to the learners."""

    step: int
    version: int  # the weights that sampled it
    credit: StepCredit
    samples: dict[str, list]
    topology: Any
    cursor: int  # the data cursor after the step's questions (what a checkpoint of this step keeps)
    epoch: float  # the data stream's epoch after the step (fractional)
    seconds: dict[str, float] = field(default_factory=dict)  # activate, rollout, reward, wait_weights, ...


class StepMaker(Protocol):
    """What the producer thread runs: the trainer's rollouts-to-samples part of a step."""

    def produce_step(self, step: int, version: int) -> StepItem:
        """Step `step`'s rollouts, scores, credit and samples, sampled with weight version `version`."""
        ...


@dataclass
class _Failure:
    step: int
    error: BaseException


class Producer:
    """Runs steps `start`..`last - 1` of `trainer` ahead of its updates, at most `k` versions stale."""

    def __init__(self, trainer: StepMaker, k: int, start: int, last: int, poll_s: float = 0.5):
        self.trainer, self.k, self.start, self.last, self.poll_s = trainer, k, start, last, poll_s
        self._items: queue.Queue = queue.Queue()
        self._staged = -1  # the newest version the trainer staged on the engines
        self._ready = threading.Condition()
        self._halt = threading.Event()
        self._thread = threading.Thread(target=self._run, name="m1-rollout-producer", daemon=True)

    def begin(self, staged: int) -> None:
        """Start sampling; `staged`: the newest version already on the engines."""
        self._staged = staged
        self._thread.start()

    def publish(self, version: int) -> None:
        """The trainer staged `version` on every engine."""
        with self._ready:
            self._staged = max(self._staged, version)
            self._ready.notify_all()

    def get(self, step: int) -> StepItem:
        """Step `step`'s item, waiting for it; the producer's error if it failed."""
        while True:
            try:
                item = self._items.get(timeout=self.poll_s)
            except queue.Empty:
                if not self._thread.is_alive() and self._items.empty():
                    raise RolloutError(f"the rollout producer stopped before step {step + 1}") from None
                continue
            if isinstance(item, _Failure):
                raise RolloutError(f"rollouts of step {item.step + 1} failed: {type(item.error).__name__}: "
                                   f"{item.error}") from item.error
            if item.step != step:
                raise RolloutError(f"the rollout producer handed over step {item.step + 1} where step {step + 1} "
                                   "was due")
            return item

    def stop(self, timeout: float = 30.0) -> None:
        """Stop after the request in flight (its results are dropped: a resume regenerates them)."""
        self._halt.set()
        with self._ready:
            self._ready.notify_all()
        if self._thread.is_alive():
            self._thread.join(timeout)
            if self._thread.is_alive():
                log.warning("the rollout producer is still waiting on a request after %.0f s; left to finish "
                            "in the background", timeout)

    @property
    def queued(self) -> int:
        return self._items.qsize()

    # ------------------------------------------------------------------ the thread
    def _run(self) -> None:
        step = self.start
        try:
            while step < self.last and not self._halt.is_set():
                version = sampling_version(step, self.k)
                t0 = time.perf_counter()
                with self._ready:
                    while self._staged < version and not self._halt.is_set():
                        self._ready.wait(self.poll_s)
                if self._halt.is_set():
                    return
                waited, cpu = time.perf_counter() - t0, time.thread_time()
                item = self.trainer.produce_step(step, version)
                # this thread's own CPU seconds (with one torch thread, all of its work): well below its rollout's
                # wall seconds while nothing else needs the cores, it waited for the GIL
                item = replace(item, seconds={**item.seconds, "wait_weights": waited,
                                              "producer_cpu": time.thread_time() - cpu})
                if self._halt.is_set():
                    return
                self._items.put(item)
                step += 1
        except BaseException as exc:  # noqa: BLE001 - handed to the trainer's thread, which raises it
            self._items.put(_Failure(step, exc))
