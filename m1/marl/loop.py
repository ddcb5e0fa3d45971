"""The step loop the SFT and MARL trainers share: steps, metrics, trackers, checkpoints, stopping on a signal.

A trainer brings its own step (`train_step`, which advances `trainer.step` and returns the step's metrics row, or
None for a step that logs nothing); this loop does the rest the same way for SFT, MARL and `m1 pretrain`: every row to metrics.jsonl and the trackers, a checkpoint every
`checkpoint.every` steps and at the last, one more of the current step when a signal stopped the run, and a lost
Ray rank named with the step it broke (and where a rerun resumes).
"""
from __future__ import annotations

from typing import Any, Callable

from m1.contracts import StepTrainer
from m1.gc_pauses import fewer_gc_pauses
from m1.marl.checkpoint import StopFlag, naming_full_disk
from m1.marl.actor.groups import stop_on_lost_ranks
from m1.marl.rollout.stream import MetricsLog
from m1.marl.trackers import open_trackers


def run_steps(trainer: StepTrainer, total: int, step: Callable[[], dict[str, Any] | None], what: str,
              stop_after: int | None = None,
              stop: StopFlag | None = None) -> list[dict[str, Any]]:
    """Run `step()` until `trainer.step` reaches `total` (or `stop_after` more steps, e.g. to simulate a killed run,
    or until `stop` is set); `what` names a step in errors ("step", "SFT step"). Returns the trainer's history."""
    cfg = trainer.cfg
    last = total if stop_after is None else min(total, trainer.step + stop_after)
    if stop is not None:
        stop.reclaim()  # a Ray started while the models loaded took SIGTERM over
    with naming_full_disk(trainer.out / "metrics.jsonl"):  # it drops the lines after the resumed step
        logger = MetricsLog(trainer.out, total, trainer.step, cfg.log.progress)
    failed = True
    try:
        trainer.trackers = logger.trackers = open_trackers(cfg, trainer.placement, trainer.tracker_ids)
        trainer.tracker_ids = trainer.trackers.run_ids()
        with fewer_gc_pauses():
            while trainer.step < last and not stop:
                try:
                    row = step()
                except Exception as exc:
                    stop_on_lost_ranks(trainer.learners, exc, f"{what} {trainer.step + 1} of {total}",
                                       trainer.checkpointed)
                    raise
                with naming_full_disk(logger.path):
                    logger.write(row)
                if row is not None:
                    trainer.history.append(row)
                if trainer.step % cfg.checkpoint.every == 0 or trainer.step == total:
                    try:
                        trainer.save_checkpoint()
                    except Exception as exc:
                        stop_on_lost_ranks(trainer.learners, exc, f"the checkpoint of {what} {trainer.step}",
                                           trainer.checkpointed)
                        raise
        if stop and trainer.step != trainer.checkpointed:
            trainer.save_checkpoint(interim=True)
        failed = False
    finally:
        trainer.trackers = None
        logger.close(failed)
    return trainer.history
