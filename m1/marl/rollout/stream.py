"""What flows through a run besides the models: the questions handed out in a seeded order, and the metrics log."""
from __future__ import annotations

import json
import logging
import math
from pathlib import Path
from typing import Any

from m1.data.questions import read_questions

log = logging.getLogger(__name__)


# ================================================================================================ metrics
class MetricsLog:
    """metrics.jsonl (one line per step), the trackers `log.backends` names (m1/marl/trackers.py), and a tqdm bar."""

    def __init__(self, out_dir: Path, total: int, start: int, progress: bool, trackers=None):
        self.path = out_dir / "metrics.jsonl"
        out_dir.mkdir(parents=True, exist_ok=True)
        if self.path.exists():  # keep only steps up to the checkpoint we resume from (drop a killed run's tail)
            kept = []
            for i, line in enumerate(self.path.read_text().splitlines(), 1):
                if not line.strip():
                    continue
                try:
                    step = json.loads(line).get("step", 0)
                except json.JSONDecodeError:
                    log.warning("%s:%d: dropping a torn line left by a killed run", self.path, i)
                    continue
                if step <= start:
                    kept.append(line)
            self.path.write_text("".join(line + "\n" for line in kept))
        self.trackers = trackers
        self.bar = None
        if progress:
            from tqdm.auto import tqdm

            self.bar = tqdm(total=total, initial=start, desc="train", unit="step", dynamic_ncols=True)

    def write(self, row: dict[str, Any] | None) -> None:
        """One step done: its row to the file and the trackers (None: a step that logs nothing, as m1 pretrain's
        between its evaluations) and the bar one step on."""
        if row is not None:
            clean = {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in row.items()}
            with self.path.open("a") as f:
                f.write(json.dumps(clean) + "\n")
            if self.trackers is not None:
                self.trackers.log(row)
        if self.bar is not None:
            self.bar.update(1)
            if row is not None:
                self.bar.set_postfix({k: f"{row[k]:.4f}" for k in ("loss", "reward/mean") if k in row})

    def close(self, failed: bool = False) -> None:
        if self.trackers is not None:
            self.trackers.close(failed)
        if self.bar is not None:
            self.bar.close()


# ================================================================================================ data
class QuestionStream:
    """Items (questions; SFT examples) in a fresh seeded order every epoch; `cursor` counts items handed out."""

    def __init__(self, questions: list, seed: int, shuffle: bool = True):
        if not questions:
            raise ValueError("no training questions")
        self.questions, self.seed, self.shuffle = list(questions), seed, shuffle
        self.cursor = 0
        self._order: tuple[int, list[int]] | None = None

    def _epoch_order(self, epoch: int) -> list[int]:
        import numpy as np

        if self._order is None or self._order[0] != epoch:
            n = len(self.questions)
            order = (np.random.default_rng([self.seed, epoch]).permutation(n).tolist() if self.shuffle
                     else list(range(n)))
            self._order = (epoch, order)
        return self._order[1]

    def take(self, n: int) -> list:
        out = []
        for _ in range(n):
            epoch, i = divmod(self.cursor, len(self.questions))
            out.append(self.questions[self._epoch_order(epoch)[i]])
            self.cursor += 1
        return out

    @property
    def epoch(self) -> float:
        return self.cursor / len(self.questions)


def load_questions(path: str | None, video_dir: str | None) -> list:
    if not path:
        raise ValueError("data.questions: no questions file given")
    qs, issues = read_questions(Path(path), Path(video_dir) if video_dir else None)
    for msg in issues:
        log.warning("skipped question: %s", msg)
    if not qs:
        raise ValueError(f"{path}: no usable questions ({len(issues)} skipped)")
    return qs
