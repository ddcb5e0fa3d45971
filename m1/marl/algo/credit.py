"""Credit strategies: which episodes a step runs and what advantage each generation gets.

A training step's trainer runs and scores the episodes this module's `CreditStrategy` asks for (the focus agents,
the refills, the greedy run), then asks it for the step's `StepCredit`: every function here takes values and
returns values. How the credit is made is the choice of three small registries:

- `CREDITS` (`rollout.credit`) — who is credited with what:
  - `episode` (the paper's): every generation of an agent carries the advantage of that agent's episode reward;
  - `phase`: answers and summaries carry the advantage of the reward's `outcome` part alone, so a plan's judged
    quality or another generation's format does not decide which answer is reinforced;
  - `agent`: question i of the run has one focus agent (trained agent i mod n) sampling while its teammates decode
    greedily; only the focus agent is credited, within its own K episodes.
- `ESTIMATORS` (`grpo.baseline`, m1/marl/algo/advantages.py) — what a reward is compared with: `group` (GRPO's mean
  and std of the agent's K rollouts of the question), `greedy` (one more greedy run of each question, after ReMax),
  `rloo` (the mean of the group's other rollouts), `reinforce_pp` (per token); an estimator that asks for the greedy
  run gets it;
- `rollout.dynamic_sampling` (DAPO): a question whose groups all tie carries no signal; it is dropped and the next
  questions of the data cursor run in its place, for at most `rollout.max_refill` more rounds.

A credit rule states what it cannot be combined with in `check`, an estimator in its `requires` / `refuses` rules
(m1/marl/entries.py); the config's validator reads both, the only place those rules live. A credit rule is a class
registered with `@register_credit`; `rollout.credit` accepts any registered name. Which phases carry the outcome
advantage (`OUTCOME_PHASES`) stays in m1/marl/rollout/episodes.py with `generation_credit`, which tests and the samples
record call without a rule (rollout cannot import this module).
"""
from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any, ClassVar

from m1.marl.algo.advantages import ESTIMATORS, estimate_advantages, token_advantages
from m1.marl.rollout.episodes import RolloutBatch, RolloutError, Sample, build_samples, generation_credit
from m1.registry import add_entry

Rewards = dict[str, list[list[float]]]  # agent -> [question][rollout]


# ------------------------------------------------------------------------------------------------ credit rules
CREDITS: dict[str, type[EpisodeCredit]] = {}


def register_credit(cls: type[EpisodeCredit]) -> type[EpisodeCredit]:
    """Class decorator: make a credit rule (an EpisodeCredit subclass) selectable as `rollout.credit: <name>`."""
    add_entry(CREDITS, cls.name, cls, "credit rule")
    return cls


@register_credit
class EpisodeCredit:
    """Every generation of an agent carries the advantage of its episode's total reward (the paper's rule)."""

    name: ClassVar[str] = "episode"
    outcome: ClassVar[bool] = False  # answers and summaries credited with the outcome part alone

    def focus(self, trained: Sequence[str], first: int, n: int) -> list[str] | None:
        """The one sampling agent of each of the n questions (None: every agent samples)."""
        return None

    def credited(self, rewards: Rewards, focus: Sequence[str] | None) -> Rewards:
        """The rewards each agent is credited with (NaN: no credit there)."""
        return rewards

    @classmethod
    def check(cls, cfg, kind) -> None:
        """Raise ValueError when this rule cannot train `cfg` (a TrainConfig) on a team of `kind`."""


@register_credit
class PhaseCredit(EpisodeCredit):
    """Answers and summaries carry the advantage of their outcome (result and the answer's own format) alone."""

    name = "phase"
    outcome = True

    @classmethod
    def check(cls, cfg, kind) -> None:
        if not kind.per_phase_rewards:
            raise ValueError(f"rollout.credit: {cls.name!r} needs one reward per phase; a {kind.name} episode has "
                             "one reward for all its turns (use credit: episode)")


@register_credit
class AgentCredit(EpisodeCredit):
    """One focus agent per question samples, its teammates decode greedily; only it is credited."""

    name = "agent"

    def focus(self, trained, first, n):
        """Question i of the run focuses trained agent i mod len(trained): a step costs K episodes per question as
        under episode credit, and across steps every trained agent is focused equally often, whatever
        questions_per_step is."""
        if not trained:
            raise RolloutError("credit 'agent' needs at least one trained agent")
        return [trained[(first + i) % len(trained)] for i in range(n)]

    def credited(self, rewards, focus):
        """NaN wherever the agent was not its question's focus: those episodes give it no advantage (a missing
        sample to `group_advantages`), so each agent is credited only within its own focus groups."""
        nan = float("nan")
        return {a: [list(row) if focus[g] == a else [nan] * len(row) for g, row in enumerate(rows)]
                for a, rows in rewards.items()}

    @classmethod
    def check(cls, cfg, kind) -> None:
        if not kind.per_phase_rewards:
            raise ValueError(f"rollout.credit: {cls.name!r} credits one agent among teammates; a {kind.name} team "
                             "has one agent (use credit: episode)")


def check_credit(cfg, kind) -> None:
    """The one place the credit rule of a TrainConfig is checked against the other settings and the team kind (the
    advantage estimator's rules are its entry's, m1/marl/algo/advantages.py)."""
    CREDITS[cfg.rollout.credit].check(cfg, kind)


# ------------------------------------------------------------------------------------------------ dynamic sampling
def _spread(values: Sequence[float]) -> bool:
    finite = [v for v in values if not math.isnan(v)]
    return len(finite) >= 2 and max(finite) > min(finite)


def informative_groups(rewards: dict[str, list[list[float]]],
                       outcomes: dict[str, list[list[float]]] | None = None) -> dict[str, list[bool | None]]:
    """Per agent and question: True when the group carries GRPO signal (two or more finite rewards that differ,
    or, with `outcomes` (credit: phase), outcomes that differ), False when it ties, None when the agent has no
    reward there at all (not its focus question under credit agent, or every episode failed)."""
    out: dict[str, list[bool | None]] = {}
    for agent, rows in rewards.items():
        flags: list[bool | None] = []
        for g, row in enumerate(rows):
            if all(math.isnan(v) for v in row):
                flags.append(None)
                continue
            flags.append(_spread(row) or (outcomes is not None and _spread(outcomes[agent][g])))
        out[agent] = flags
    return out


def merge_batches(parts: Sequence[tuple[RolloutBatch, Sequence[int]]]) -> RolloutBatch:
    """One batch of the kept questions (`(batch, question indices)` per round, in order), with their episodes,
    rewards, outcomes, breakdowns and focus agents; the topology is the step's (every round shares it)."""
    if not parts:
        raise ValueError("merge_batches: no rounds to merge")
    first = parts[0][0]
    questions, episodes, breakdowns = [], [], []
    rewards: Rewards = {a: [] for a in first.rewards}
    outcomes: Rewards = {a: [] for a in first.outcomes}
    focus: list[str] | None = [] if first.focus is not None else None
    for batch, keep in parts:
        k = len(batch.episodes[0]) if batch.episodes else 0
        for g in keep:
            questions.append(batch.questions[g])
            episodes.append(batch.episodes[g])
            breakdowns.extend(batch.breakdowns[g * k:(g + 1) * k])
            for a in rewards:
                rewards[a].append(batch.rewards[a][g])
            for a in outcomes:
                outcomes[a].append(batch.outcomes[a][g])
            if focus is not None and batch.focus is not None:
                focus.append(batch.focus[g])
    return RolloutBatch(questions=questions, episodes=episodes, topology=first.topology, rewards=rewards,
                        outcomes=outcomes, breakdowns=breakdowns, focus=focus)


# ------------------------------------------------------------------------------------------------ one step
@dataclass(frozen=True)
class StepEpisodes:
    """A step's episodes, run and scored: what its credit is computed from."""

    batch: RolloutBatch  # the episodes the step trains on (dynamic sampling: the kept questions of every round)
    rounds: list[RolloutBatch]  # every batch the step ran (one, unless dynamic sampling refilled it)
    live: dict[str, list[bool]] | None  # dynamic sampling: agent -> kept question -> group has signal
    dropped: float  # dynamic sampling: the share of all groups that tied
    greedy: RolloutBatch | None  # grpo.baseline greedy: the greedy run of each question (scored)


@dataclass(frozen=True)
class StepCredit:
    """A step's scored episodes and what each generation is credited with."""

    batch: RolloutBatch  # the episodes the step trains on (dynamic sampling: the kept questions of every round)
    advantages: dict[str, Any]  # agent -> [G, K]
    outcome_advantages: dict[str, Any] | None  # credit phase: what answers and summaries carry instead
    rounds: list[RolloutBatch]  # every batch the step ran (one, unless dynamic sampling refilled it)
    live: dict[str, list[bool]] | None = None  # dynamic sampling: agent -> kept question -> group has signal
    greedy: RolloutBatch | None = None  # grpo.baseline greedy: the greedy run of each question (scored)
    metrics: dict[str, Any] = field(default_factory=dict)  # what the strategy alone knows (groups dropped, greedy)
    # a token-level estimator: agent -> samples in, the same samples with their token advantages out
    tokens: Callable[[dict[str, list[Sample]]], dict[str, list[Sample]]] | None = None

    def generation_credit(self, phases):
        return generation_credit(self.batch, self.advantages, self.outcome_advantages, phases)

    def samples(self, temperatures: dict[str, float], phases,
                phase_temperature: dict[str, float] | None = None) -> dict[str, list[Sample]]:
        """One sample per credited generation; under dynamic sampling a kept question's tied groups drop out."""
        samples = build_samples(self.batch, self.advantages, temperatures, self.outcome_advantages, phases,
                                phase_temperature)
        if self.live is not None:
            samples = {a: [s for s in rows if self.live[a][s.group]] for a, rows in samples.items()}
        return self.tokens(samples) if self.tokens is not None else samples


class CreditStrategy:
    """A step's credit under one credit rule, one baseline and (optionally) dynamic sampling, as functions of
    values: which agent each question focuses on, how many questions a dynamic-sampling round must refill, the
    step's episodes from its scored rounds, and what each generation is credited with. The trainer runs and scores
    the episodes (m1/marl/trainer.py `Trainer.step_episodes`); nothing here calls back into it."""

    def __init__(self, cfg, trained: Sequence[str]):
        self.rule = CREDITS[cfg.rollout.credit]()
        self.estimator, self.grpo = ESTIMATORS[cfg.grpo.baseline], cfg.grpo
        self.k, self.per_step, self.max_refill = (cfg.rollout.num_generations, cfg.rollout.questions_per_step,
                                              cfg.rollout.max_refill)
        self.dynamic = cfg.rollout.dynamic_sampling
        self.trained = list(trained)

    @property
    def greedy_reference(self) -> bool:
        """The baseline needs one greedy run of each of the step's first questions."""
        return self.estimator.greedy_reference

    def focus(self, first: int, n: int) -> list[str] | None:
        """The focus agent of each of n questions starting at the run's question `first` (credit: agent)."""
        return self.rule.focus(self.trained, first, n)

    def kept(self, batch: RolloutBatch) -> tuple[list[int], dict[str, list[bool | None]]]:
        """Dynamic sampling: the questions of a scored round where some trained agent's group has reward spread,
        and every (agent, question) group's flag (True signal, False tied, None no reward there)."""
        live = informative_groups(self.rule.credited(batch.rewards, batch.focus),
                                  batch.outcomes if self.rule.outcome else None)
        return [g for g in range(len(batch.questions)) if any(live[a][g] for a in self.trained)], live

    def refill(self, rounds: Sequence[RolloutBatch]) -> int:
        """How many questions the next dynamic-sampling round runs after these scored rounds: the step's
        questions not yet kept, or 0 when none are missing, `max_refill` rounds have run, or sampling is static."""
        if not self.dynamic or len(rounds) > self.max_refill:
            return 0
        return self.per_step - sum(len(self.kept(batch)[0]) for batch in rounds)

    def step_episodes(self, rounds: Sequence[RolloutBatch], greedy: RolloutBatch | None) -> StepEpisodes:
        """The step's episodes from its scored rounds (one, unless dynamic sampling refilled it) and the scored
        greedy run: under dynamic sampling the kept questions of every round, merged, and the share that tied."""
        if not self.dynamic:
            return StepEpisodes(rounds[0], list(rounds), None, 0.0, greedy)
        parts, flags = [], {a: [] for a in self.trained}
        groups = tied = 0
        for batch in rounds:
            keep, live = self.kept(batch)
            for a in self.trained:
                groups += sum(f is not None for f in live[a])
                tied += sum(f is False for f in live[a])
                flags[a] += [bool(live[a][g]) for g in keep]
            parts.append((batch, keep))
        return StepEpisodes(merge_batches(parts), list(rounds), flags, tied / groups if groups else 0.0, greedy)

    def credit(self, episodes: StepEpisodes) -> StepCredit:
        """What each generation of the step's scored episodes is credited with, and the strategy's metrics."""
        batch, greedy = episodes.batch, episodes.greedy
        base = greedy.rewards if greedy is not None else None
        advantages = self.advantages(self.rule.credited(batch.rewards, batch.focus), base)
        outcome = None
        if self.rule.outcome:
            if not batch.outcomes:
                raise RolloutError(f"rollout.credit {self.rule.name!r} needs rewards with an `outcome` part "
                                   "(RewardBreakdown); this reward function returns plain numbers")
            outcome = self.advantages(batch.outcomes, greedy.outcomes if greedy is not None else None)
        metrics = {}
        if episodes.live is not None:
            metrics = {"groups/dropped_share": episodes.dropped, "groups/refill_rounds": len(episodes.rounds) - 1,
                       "groups/kept": len(batch.questions)}
        if base is not None:  # the greedy team on the step's questions: what evaluation measures
            flat = [r for a in base for g in base[a] for r in g if not math.isnan(r)]
            metrics["greedy/reward"] = sum(flat) / len(flat) if flat else float("nan")
        tokens = partial(token_advantages, self.estimator, grpo=self.grpo) if self.estimator.tokens else None
        return StepCredit(batch, advantages, outcome, episodes.rounds, episodes.live, greedy, metrics, tokens)

    def advantages(self, rewards: Rewards, reference: Rewards | None) -> dict[str, Any]:
        """Agent -> [G, K] advantages of `rewards` under the run's estimator (`reference`: the greedy run's)."""
        return estimate_advantages(self.estimator, rewards, reference, self.grpo)
