"""The interfaces the parts meet, written down once so a type checker holds both sides to them (tests/test_types.py).

Each is a `typing.Protocol`: a class satisfies one by having its members, with no base class to inherit, so a test
double or a new engine fits without importing its siblings.

- `Team`: what `m1 infer` / `eval` (m1/run.py), `m1 serve` (m1/serve/batcher.py) and training rollouts call on a
  team: the CPP Team (m1/team/cpp.py) and the seed kinds' SingleAgentTeam (m1/team/single.py);
- `LearnerGroup`: the trained agents' learners, in this process (LocalLearners) or on Ray (RayLearners);
- `RolloutEngine`: the samplers of trained agents, vLLM servers (RolloutEngines) or hf copies (HFSamplers);
- `TeamKind`: what the trainer asks of the team's kind, CPP or a seed kind (m1/marl/team_training.py);
- `StepTrainer`: what the step loop (m1/marl/loop.py `run_steps`) reads and sets on the MARL and SFT trainers.

This module sits low (next to m1/models) so every layer can name these; types of the layers above it (a
TrainConfig, a RolloutBatch, a training Sample) are Any here.
"""
from __future__ import annotations

import random
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

from m1.config import TeamConfig
from m1.models.base import ChatModel
from m1.schema import Episode, Question, Topology
from m1.video import VideoPool


class Team(Protocol):
    """Answers questions as episodes, a batch at a time."""

    # answering (m1 infer / eval / serve): a prompt over budget ends only its question's episode, as an error row
    over_budget_rows: bool
    # m1 infer / eval: a served model that stops answering ends the batch in flight as error rows, not the run
    server_error_rows: bool

    @property
    def cfg(self) -> TeamConfig: ...

    @property
    def pool(self) -> VideoPool | None:
        """The frames decoded so far (trace thumbnails reuse them); None: a team that decodes none."""

    def run(self, questions: list[Question], topologies: list[Topology] | None = None,
            rng: random.Random | None = None, on_episode: Callable[[Episode], None] | None = None,
            temperatures: list[dict[str, float]] | None = None) -> list[Episode]:
        """`temperatures`: one {agent: temperature} per question overriding those agents' own in its episode (agent
        credit holds every agent but the credited one greedy)."""

    def reseed(self, seed: int) -> None:
        """Restart the sampling seed sequence (a resumed training run repeats its rollouts)."""

    def forget_video(self, path: str) -> None:
        """Drop what the team keeps of a video that is gone for good (an upload served and deleted)."""


class LearnerGroup(Protocol):
    """One learner per trained agent: the trainer, SFT, checkpoints and the rollout engines call these."""

    def chat_models(self) -> Mapping[str, ChatModel]: ...

    def update(self, samples: dict[str, list[Any]], lr: float, family: str = "grpo") -> dict[str, dict[str, float]]:
        """One optimizer step per agent on its samples under a loss family (m1/marl/actor/losses.py: grpo, sft, or a
        registered one); each agent's stats."""

    def sft_samples(self, agent: str, examples: list) -> list[Any]: ...

    def save(self, folder: Path) -> None: ...

    def load(self, folder: Path) -> None: ...

    def export_weights(self, agent: str, folder: Path) -> None: ...

    def probe_logprobs(self, agent: str, probe: tuple[list[int], list[int]]) -> tuple[list[float], float]: ...

    def parameters(self, agent: str) -> dict[str, Any]: ...

    def shutdown(self) -> None: ...


class RolloutEngine(Protocol):
    """The trained agents' samplers and their weight versions: `stage` a version (the trainer's thread), `activate`
    it (between requests), `prune` older ones; `sync` does all three for a synchronous step."""

    @property
    def version(self) -> int | None:
        """The weight version the samplers generate with (None: none activated yet)."""

    def chat_models(self) -> Mapping[str, ChatModel]: ...

    def sync(self, version: int) -> dict[str, float]: ...

    def stage(self, version: int) -> dict[str, float]: ...

    def stage_from(self, version: int, folders: dict[str, Path]) -> dict[str, float]: ...

    def activate(self, version: int) -> dict[str, float]: ...

    def prune(self, below: int) -> None: ...

    def staged_folder(self, agent: str, version: int) -> Path: ...

    def newest_staged(self) -> int: ...

    def check_versions(self, samples: dict[str, list[Any]], version: int) -> None: ...

    def close(self) -> None: ...


class TeamKind(Protocol):
    """What differs in training between the CPP team and a seed kind: its phases, DAG, reward, summaries and the
    teacher generations SFT learns from."""

    @property
    def name(self) -> str: ...

    @property
    def phases(self) -> tuple[str, ...]:
        """The generations an episode has."""

    @property
    def per_phase_rewards(self) -> bool:
        """Rewards differ per agent and phase (phase and agent credit apply)."""

    @property
    def needs_judge(self) -> bool:
        """The reward has a judged part (R_col)."""

    def train_phases(self, phases: Sequence[str]) -> list[str] | None:
        """The phases a run trains on (None: every generation)."""

    def topology(self, agents: list[str], rollout: Any, seed: int, step: int) -> Topology: ...

    def reward_fn(self, cfg: Any, team: TeamConfig, judge: Any) -> Callable[[list[Episode]], list[dict[str, Any]]]:
        ...

    def summary(self, breakdowns: list[dict[str, Any]]) -> dict[str, float]: ...

    def greedy_summary(self, breakdowns: list[dict[str, Any]]) -> dict[str, float]: ...

    def step_metrics(self, rounds: Sequence[Any], trained: Sequence[str], tools: Sequence[str]) -> dict[str, float]:
        ...

    def check(self, cfg: Any, team: TeamConfig, trained: list[str]) -> None:
        """Refuse a TrainConfig this kind cannot train."""

    def sft_examples(self, episodes: list[Episode], rewards: Any, judge: Any, phases: Sequence[str],
                     keep_revised_plans: bool, plan_filter: str) -> tuple[list[Any], dict[str, int]]:
        """The generations of a teacher's episodes SFT learns from (SFTExamples), and counts of what was kept and
        why the rest was not: the kind's own rule (`rewards`, `judge` and the plan options are the CPP rule's)."""


class StepTrainer(Protocol):
    """A trainer the step loop drives: it brings its own step; the loop logs, checkpoints and stops it."""

    trackers: Any  # the open trackers while the loop runs (m1/marl/trackers.py), else None
    tracker_ids: dict[str, str]  # the tracker runs this run logs to (kept in its checkpoints)

    @property
    def cfg(self) -> Any: ...

    @property
    def out(self) -> Path: ...

    @property
    def step(self) -> int:
        """Steps done; the trainer's step function advances it."""

    @property
    def checkpointed(self) -> int:
        """The step of the newest checkpoint on disk."""

    @property
    def history(self) -> list[dict[str, Any]]: ...

    @property
    def learners(self) -> LearnerGroup | None: ...

    @property
    def placement(self) -> Any:
        """The GPUs reserved on Ray (None: placement local)."""

    def save_checkpoint(self, interim: bool = False) -> Path: ...
