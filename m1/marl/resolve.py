"""Everything a MARL run derives from its config, decided once before anything loads.

A config states what the user chose; the validators in m1/marl/config.py only check it. What follows from those
choices (the team as it trains, its prompt budget and rollout batch, the old log-probs the loss uses, the phases
trained on) is worked out here, so the trainer reads settings and never decides one.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

from m1.config import TeamConfig
from m1.contracts import TeamKind
from m1.marl.plan.planner import rollout_batch
from m1.marl.config import TrainConfig
from m1.marl.algo.reductions import default_old_logprobs
from m1.marl.rollout.episodes import agent_temperature, training_team_config
from m1.marl.team_training import team_kind

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ResolvedRun:
    """A MARL run's settings with every derived value filled in."""

    cfg: TrainConfig  # as given, with grpo.old_logprobs decided
    team: TeamConfig  # the team as it trains: sampling temperature, one model key per agent, limits for training
    kind: TeamKind  # the team kind (CPP or a seed kind)
    agents: list[str]  # every agent of the team
    trained: list[str]  # the agents that learn
    model_keys: dict[str, str]  # agent -> its model key in the hub
    temperatures: dict[str, float]  # trained agent -> the temperature it samples (and is scored) at
    phases: list[str] | None  # the phases trained on (None: every generation)


def resolve(cfg: TrainConfig, plan=None) -> ResolvedRun:
    """`cfg` as it will train; `plan`: the placement plan reserved on GPUs (it sizes the rollout batch)."""
    if cfg.grpo.old_logprobs is None:
        old = default_old_logprobs(cfg.rollout.engine, cfg.rollout.max_staleness)
        cfg = cfg.model_copy(update={"grpo": cfg.grpo.model_copy(update={"old_logprobs": old})})
    team = training_team_config(cfg.team_config(), cfg.rollout.temperature, cfg.rollout.phase_temperature,
                                cfg.rollout.distinct_plans, cfg.rollout.plan_fill)
    team = team.model_copy(update={"limits": team.limits.model_copy(update=_limits(cfg, team, plan))})
    kind = team_kind(team)
    agents = [a.name for a in team.agents]
    trained = list(cfg.train_agents or agents)
    return ResolvedRun(cfg=cfg, team=team, kind=kind, agents=agents, trained=trained,
                       model_keys={a.name: a.model for a in team.agents},
                       temperatures={a: agent_temperature(team, a) for a in trained},
                       phases=kind.train_phases(cfg.rollout.train_phases))


def _limits(cfg: TrainConfig, team: TeamConfig, plan) -> dict:
    """The team limits training sets: the prompt budget (the learner's cap when the team has none: the learner
    takes every prompt whole) and the episodes run at once (a vLLM engine gets the whole step; on hf, the
    configured number or, at auto, what the plan fits in the learners' memory; with rollout.distinct_plans, a multiple
    of num_generations, so that a question's rollouts share a batch and draw distinct plans)."""
    limits = team.limits
    out = {}
    if limits.max_prompt_tokens is None:
        out["max_prompt_tokens"] = cfg.learner.max_prompt_tokens
    if cfg.rollout.engine == "vllm":
        out["batch_episodes"] = max(limits.batch_episodes,
                                    cfg.rollout.questions_per_step * cfg.rollout.num_generations)
    elif cfg.rollout.batch_episodes is not None:
        out["batch_episodes"] = rollout_batch(cfg, plan)
        log.info("rollouts: %d episodes at once (rollout.batch_episodes: %s)", out["batch_episodes"],
                 cfg.rollout.batch_episodes)
    k, batch = cfg.rollout.num_generations, out.get("batch_episodes", limits.batch_episodes)
    if cfg.rollout.distinct_plans > 1 and batch % k:
        out["batch_episodes"] = max(k, batch - batch % k)
        log.info("rollouts: %d episodes at once, a multiple of num_generations %d (rollout.distinct_plans)",
                 out["batch_episodes"], k)
    return out
