"""Team kinds as the trainer sees them: what a kind's episodes are made of, how they are rewarded and summarised.

The trainer runs one loop for every team; what differs between the CPP team (several agents writing plans, notes,
answers and a summary over a DAG) and a seed kind (Weaver, VideoZoomer, SAGE: one policy in a multi-turn tool
loop, m1/team/single.py) lives behind one interface (`TeamKind`, m1/contracts.py), chosen once from the team
config by `team_kind` through the team kinds' registry (m1/team/engines_registry.py: the engine that runs the kind picks
its trainer kind here):

- `phases` / `train_phases`: the generations an episode has, and those a run trains on;
- `topology`: the step's communication DAG (a team of one always runs on the complete graph);
- `reward_fn`: the kind's own reward (the paper's R_res + R_format + R_col with a judge; each seed system's);
- `summary`: the reward parts logged per step; `step_metrics`: what else the kind measures (plan entropy, revision
  rate);
- `check`: what a TrainConfig must satisfy to train this kind;
- `sft_examples`: which generations of a teacher of this kind SFT learns from (m1/marl/sft_examples.py).
"""
from __future__ import annotations

import math
from collections import Counter, defaultdict
from collections.abc import Callable, Sequence

from m1.agents.parsers import parse_decision, parse_plan
from m1.config import TeamConfig
from m1.contracts import Team, TeamKind
from m1.marl.reward.rewards import (RewardBreakdown, SeedReward, batch_agent_rewards, reward_kind, seed_rewards,
                                    summarize, summarize_seed)
from m1.marl.rollout.episodes import RolloutBatch, step_topology
from m1.marl.sft_examples import select_examples, select_seed_examples
from m1.registry import CPP, is_seed
from m1.team.cpp import Team as CppTeam
from m1.team.engines_registry import kind_of
from m1.team.single import SingleAgentTeam
from m1.trace import family_of

CPP_PHASES = ("plan", "communicate", "answer", "summary")
SEED_PHASES = ("act", "answer")  # the generations of a seed-kind episode (m1/team/single.py)


def team_seed_kind(team: TeamConfig) -> str | None:
    """The team's seed kind (weaver, zoomer, sage) when it is a team of one such agent, else None (CPP)."""
    name = kind_of(team).name
    return name if is_seed(name) else None


def seed_phases(phases, where: str, kind: str, default) -> list[str] | None:
    """The phases a seed-kind run trains on: every turn (None) when `phases` is the CPP default, else `phases`,
    which must name only act and answer."""
    if list(phases) == list(default):
        return None
    bad = [p for p in phases if p not in SEED_PHASES]
    if bad:
        raise ValueError(f"{where}: {bad} are CPP phases; a {kind} agent writes only {list(SEED_PHASES)}")
    return list(phases)


def check_seed_policies(team: TeamConfig, trained: list[str], where: str, engine: str = "hf") -> None:
    """A trained seed-kind policy must be one the learner can score: a text chat model (backend hf or vllm; frames
    reach it as `[frame at t s]` placeholders) or a vision-language model on backend hf (frames reach it as images,
    and the learner feeds their pixels to its forward pass; m1/marl/actor/scorer.py). Other vision backends are refused,
    and so is a vLLM rollout engine for a vision-language policy (its multimodal requests are not built)."""
    for a in team.agents:
        if a.name not in trained:
            continue
        spec = team.models[a.model]
        if spec.interface == "vision":
            if spec.backend != "hf":
                raise ValueError(f"{where}: agent {a.name!r} (kind {a.kind}) has model {a.model!r} of interface "
                                 f"'vision', backend {spec.backend!r}; a trained vision-language policy needs "
                                 "backend 'hf' "
                                 "(a Qwen2-VL / Qwen2.5-VL model)")
            if engine != "hf":
                raise ValueError(f"rollout.engine: {engine!r} cannot sample the vision-language policy of agent "
                                 f"{a.name!r} (model {a.model!r}); use rollout.engine: hf")
        elif spec.interface != "chat" or spec.backend not in ("hf", "vllm"):
            raise ValueError(f"{where}: agent {a.name!r} (kind {a.kind}) has model {a.model!r} of interface "
                             f"{spec.interface!r}, backend {spec.backend!r}; training a seed-kind policy needs a chat "
                             "model (backend hf or vllm) or a vision model (backend hf)")


def entropy(counts: Counter) -> float:
    """Shannon entropy (nats) of the distribution the counts describe."""
    n = sum(counts.values())
    return -sum(c / n * math.log(c / n) for c in counts.values() if c) if n else 0.0


def plan_entropy(batches: Sequence[RolloutBatch], agents: Sequence[str], tools: Sequence[str]) -> dict[str, float]:
    """`plans/entropy/<family>`: the entropy of the parsed plans (tool sequences) the `agents` wrote in the step's
    episodes of that family, and `plans/entropy`, its mean over families. 0 when every plan is the same."""
    plans: dict[str, Counter] = defaultdict(Counter)
    for batch in batches:
        for ep in batch.flat:
            fam = family_of(ep)
            for gen in ep.generations:
                if gen.phase == "plan" and gen.agent in agents:
                    plans[fam][tuple(parse_plan(gen.completion, tools, question=ep.question).plan.tools)] += 1
    row = {f"plans/entropy/{fam}": entropy(c) for fam, c in sorted(plans.items())}
    if row:
        row["plans/entropy"] = sum(row.values()) / len(row)
    return row


def revision_rate(batches: Sequence[RolloutBatch], agents: Sequence[str], tools: Sequence[str]) -> dict[str, float]:
    """`revisions/rate/<family>`: the share of the `agents`' communicate decisions in the step's episodes of that
    family that add a tool (a reply that does not parse counts as `continue()`, as the team reads it), and
    `revisions/rate` over all of them. Nothing when no episode had a communicate phase."""
    seen: dict[str, list[int]] = defaultdict(list)
    for batch in batches:
        for ep in batch.flat:
            fam = family_of(ep)
            for gen in ep.generations:
                if gen.phase == "communicate" and gen.agent in agents:
                    seen[fam].append(parse_decision(gen.completion, tools).decision.action == "add_tool")
    row = {f"revisions/rate/{fam}": sum(v) / len(v) for fam, v in sorted(seen.items())}
    if seen:
        every = [x for v in seen.values() for x in v]
        row["revisions/rate"] = sum(every) / len(every)
    return row


def _means(breakdowns, cls, summarise) -> dict[str, float]:
    """`summarise(breakdowns)` when every reward is a `cls` (a custom reward function's plain numbers: {})."""
    if breakdowns and all(isinstance(v, cls) for per in breakdowns for v in per.values()):
        return summarise(breakdowns)
    return {}


class CppKind:
    """The paper's team: several agents, each writing plan, communicate, answer (and one summary) generations."""

    def __init__(self, kind: str = CPP):
        self.name = kind
        self.per_phase_rewards = True  # rewards differ per agent and phase: phase and agent credit apply
        self.phases = CPP_PHASES
        self.needs_judge = True  # R_col is judged (rubric or LLM)

    def train_phases(self, phases) -> list[str]:
        return list(phases)

    def topology(self, agents, rollout, seed: int, step: int):
        return step_topology(agents, rollout, seed, step)

    def reward_fn(self, cfg, team: TeamConfig, judge):
        return lambda eps: batch_agent_rewards(eps, cfg.rewards, judge)

    def summary(self, breakdowns) -> dict[str, float]:
        return _means(breakdowns, RewardBreakdown, summarize)

    def greedy_summary(self, breakdowns) -> dict[str, float]:
        """The greedy run's result rewards (grpo.baseline greedy): what evaluation measures."""
        return {f"greedy/{k.split('/', 1)[1]}": v for k, v in self.summary(breakdowns).items()
                if k in ("reward/res", "reward/team_res")}

    def step_metrics(self, rounds, trained, tools) -> dict[str, float]:
        """How much the plan phase still explores, and how often the agents revise a plan, per question family."""
        return {**plan_entropy(rounds, trained, tools), **revision_rate(rounds, trained, tools)}

    def check(self, cfg, team: TeamConfig, trained: list[str]) -> None:
        if "act" in cfg.rollout.train_phases:
            raise ValueError(f"rollout.train_phases: 'act' is a seed-kind phase; team {team.name!r} is CPP")

    def sft_examples(self, episodes, rewards, judge, phases, keep_revised_plans, plan_filter):
        """The paper's keep rule over the phases asked for."""
        return select_examples(episodes, rewards, judge, phases, keep_revised_plans, plan_filter)


class SeedKind:
    """Weaver / VideoZoomer / SAGE: one policy whose every turn (act, answer) shares its episode's reward."""

    def __init__(self, kind: str):
        self.name = kind
        self.per_phase_rewards = False
        self.phases = SEED_PHASES
        self.needs_judge = False

    def train_phases(self, phases) -> list[str] | None:
        """Every turn (None) unless the config names its own act / answer list."""
        return seed_phases(phases, "rollout.train_phases", self.name, CPP_PHASES)

    def topology(self, agents, rollout, seed, step):
        return step_topology(agents, rollout, seed, step, complete=True)

    def reward_fn(self, cfg, team, judge):
        kind = reward_kind(cfg.rewards, team)
        return lambda eps: seed_rewards(eps, kind)

    def summary(self, breakdowns):
        return _means(breakdowns, SeedReward, summarize_seed)

    def greedy_summary(self, breakdowns):
        return {}

    def step_metrics(self, rounds, trained, tools):
        return {}

    def check(self, cfg, team, trained):
        self.train_phases(cfg.rollout.train_phases)
        check_seed_policies(team, trained, "train_agents", cfg.rollout.engine)

    def sft_examples(self, episodes, rewards, judge, phases, keep_revised_plans, plan_filter):
        """Every turn of a right episode (`phases` at the CPP default ["plan"]: all of them); the plan options do not
        apply to a tool loop."""
        return select_seed_examples(episodes, self.name, seed_phases(phases, "data.phases", self.name, ["plan"]))


# the engine a team kind runs on (m1/team/engines_registry.py) -> how the trainer trains it, built from the kind's name
TRAINED_BY: dict[Callable[..., Team], Callable[[str], TeamKind]] = {CppTeam: CppKind, SingleAgentTeam: SeedKind}


def team_kind(team: TeamConfig) -> TeamKind:
    """How the trainer trains the team's kind: its engine's entry in TRAINED_BY, or that of a class the engine
    derives from (a kind registered with an engine built on the CPP Team trains as CPP)."""
    spec = kind_of(team)
    bases = spec.engine.__mro__ if isinstance(spec.engine, type) else (spec.engine,)
    trained_by = next((TRAINED_BY[b] for b in bases if b in TRAINED_BY), None)
    if trained_by is None:
        raise ValueError(f"team kind {spec.name!r}: its engine {spec.engine!r} has no trainer kind (TRAINED_BY)")
    return trained_by(spec.name)
