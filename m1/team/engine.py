"""What the two team engines share: the CPP Team (m1/team/cpp.py) and the seed kinds' SingleAgentTeam
(m1/team/single.py) both answer a question list in `limits.batch_episodes` chunks, seed their sampling the same way,
keep their frames in a VideoPool and their CLIP rows in one index. `TeamEngine` holds that once; an engine brings
how it runs one chunk (`run_batch`), how it draws a topology and what an episode of a failed chunk records.
"""
from __future__ import annotations

import random
from abc import ABC, abstractmethod
from typing import Callable

from m1.config import TeamConfig
from m1.models.base import ServerUnavailable
from m1.models.hub import ModelHub
from m1.schema import Episode, Question, Topology
from m1.tools.clip_index import ClipIndex, team_clip_index
from m1.video import VideoPool


class TeamEngine(ABC):
    """The chunked run loop, the sampling seed and the video and CLIP caches of a team engine (a Team as
    m1/contracts.py describes it)."""

    order: list[str]  # the team's agent names, in config order (set by the engine)

    def __init__(self, cfg: TeamConfig, hub: ModelHub | None = None, pool: VideoPool | None = None):
        self.cfg = cfg
        self.hub = hub if hub is not None else ModelHub(cfg.models)
        self.pool = pool if pool is not None else VideoPool(max_bytes=cfg.limits.frame_cache_mb << 20,
                                                            max_open=cfg.limits.max_open_videos)
        self._clip_index: ClipIndex | None = None
        self._calls = 0
        self._seed = cfg.sampling.seed
        # answering (m1 infer / eval / serve) rather than training: a question whose prompt does not fit ends its own
        # episode with a "prompt too long:" error (an error row, a 400), whatever limits.over_budget says
        self.over_budget_rows = False
        # m1 infer / eval: a served model that stops answering (ServerUnavailable) ends the questions of the batch in
        # flight as error rows and the run goes on; a second batch in a row failing so stops the run (the server is
        # down: a rerun answers the error rows and the rest). Training always stops on it.
        self.server_error_rows = False

    def reseed(self, seed: int) -> None:
        """Restart the sampling seed sequence (exact resume of training rollouts)."""
        self._seed, self._calls = seed, 0

    def run(self, questions: list[Question], topologies: list[Topology] | None = None,
            rng: random.Random | None = None, on_episode: Callable[[Episode], None] | None = None,
            temperatures: list[dict[str, float]] | None = None) -> list[Episode]:
        """Run every question; episodes are produced in `limits.batch_episodes` chunks and handed to `on_episode` as
        soon as their chunk ends. `temperatures`: one {agent: temperature} per question that overrides those agents'
        temperatures in its episode (an agent left out keeps its own)."""
        if temperatures is not None:
            self._check_temperatures(temperatures, len(questions))
        rng = rng or random.Random(self.cfg.topology.seed)
        out: list[Episode] = []
        n = self.cfg.limits.batch_episodes
        failed_before = False
        for start in range(0, len(questions), n):
            chunk = questions[start:start + n]
            tops = topologies[start:start + n] if topologies else [self._draw_topology(rng) for _ in chunk]
            try:
                eps = self.run_batch(chunk, tops, temperatures[start:start + n] if temperatures else None)
                failed_before = False
            except ServerUnavailable as exc:
                if not self.server_error_rows or failed_before:
                    raise
                failed_before = True
                eps = [self._failed_episode(q, t, str(exc)) for q, t in zip(chunk, tops)]
            for ep in eps:
                out.append(ep)
                if on_episode:
                    on_episode(ep)
        return out

    def _check_temperatures(self, temperatures: list[dict[str, float]], questions: int) -> None:
        if len(temperatures) != questions:
            raise ValueError(f"temperatures: {len(temperatures)} entries for {questions} questions")
        unknown = sorted({a for temps in temperatures for a in temps} - set(self.order))
        if unknown:
            raise ValueError(f"temperatures: no agents {unknown} in team {self.cfg.name!r} (agents: {self.order})")

    @abstractmethod
    def run_batch(self, questions: list[Question], topologies: list[Topology],
                  temperatures: list[dict[str, float]] | None = None) -> list[Episode]:
        """One chunk of questions, every episode in flight together."""

    @abstractmethod
    def _draw_topology(self, rng: random.Random) -> Topology:
        """The communication graph of an episode `run` was given none for."""

    @abstractmethod
    def _failed_episode(self, question: Question, topology: Topology, error: str) -> Episode:
        """The error row of a question whose chunk a served model stopped answering."""

    def forget_video(self, path: str) -> None:
        """Drop what the team keeps of a video that is gone for good (its reader, frames and CLIP rows)."""
        self.pool.forget(path)
        if self._clip_index is not None:
            self._clip_index.forget(path)

    def _clip(self) -> ClipIndex | None:
        """The team's CLIP index, built (and its model loaded) when a tool first retrieves; None without a CLIP."""
        if self._clip_index is None:
            self._clip_index = team_clip_index(self.cfg, self.hub)
        return self._clip_index
