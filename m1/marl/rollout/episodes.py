"""Rollouts for multi-agent GRPO: K team episodes per question, turned into per-agent training samples.

One training step samples **one** communication DAG (random edges + agent dropout) and runs every question of the
step K times over it at temperature 1, through the ordinary `Team` engine (so generation is batched exactly as at
inference). Then, for every agent:

- its reward on each episode comes from the reward function (default: `m1.marl.reward.rewards.batch_agent_rewards`);
- the advantage of rollout k of question g is normalised within that agent's own K rollouts of g;
- every generation the agent wrote in that episode (plan, each communication decision, answer, summary) becomes
  one sample carrying that advantage (with `credit: phase`, answers and the summarizer's summary carry the
  advantage of the reward's `outcome` part instead: the result they decide and the answer's own format, not the
  plan's judged quality or other generations' format).
  A sample holds the prompt token ids (the chat the agent saw, including tool outputs and other agents' memory)
  and the completion token ids (what the agent wrote). Only completion tokens are ever trained on, so tool
  outputs and peers' text are context, never targets.

With `credit: agent` (ours, per-agent credit), question i of the run has one focus agent (trained agent i mod n):
its K episodes are run with that agent sampling and every teammate decoding greedily, so they differ only through
the focus agent's draws and what follows from them. Only the focus agent's generations become samples, and its
advantages are normalised within those K episodes: the group is (question, focus agent), and a teammate's random
draw never decides the focus agent's credit.

Episodes that failed (unreadable video, or dropped over the team's prompt budget) have a NaN reward, which
`group_advantages` treats as a missing sample, and give no samples. Which advantages a step uses (credit rule,
baseline, dynamic sampling) is m1/marl/algo/credit.py's choice.
"""
from __future__ import annotations

import hashlib
import json
import random
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from m1.config import AgentSpec, TeamConfig
from m1.contracts import Team
from m1.models.base import image_frames
from m1.schema import Episode, Question, Topology
from m1.team import topology as topo

# A reward function maps the episodes of a step to {agent: reward} per episode; a value is a float or any object
# with a `.total` (RewardBreakdown).
RewardFn = Callable[[list[Episode]], list[dict[str, Any]]]


class RolloutError(RuntimeError):
    pass


@dataclass
class Sample:
    """One generation of one agent: the unit the learner trains on."""

    agent: str
    question_id: str
    group: int  # index of the question within the step
    rollout: int  # k in 0..K-1
    phase: str
    prompt_ids: list[int]
    completion_ids: list[int]
    logprobs: list[float] | None  # the sampler's, temperature-scaled
    reward: float
    advantage: float
    temperature: float = 1.0
    weight_version: int | None = None  # rollout engines: the weights that sampled it (the trainer checks it)
    # agent -> the oldest weight version among that agent's generations of the episode up to this one: every model
    # that shaped this prompt (teammates' replies included); asynchronous rollouts count staleness from it
    versions: dict[str, int] | None = None
    # a multimodal prompt (seed kinds): its video and the frame of each image part, in order. A vision-language
    # learner decodes and processes them again for its forward pass; a text learner ignores them (the prompt ids
    # hold placeholders). Pixels are never stored.
    video: str | None = None
    frames: list[int] | None = None
    # SFT with learner.attention: (query position, evidence positions) in prompt + completion tokens (unpadded), the
    # teacher's evidence placed on this learner's tokens (m1/evidence.py chat_token_evidence)
    evidence: list[tuple[int, tuple[int, ...]]] | None = None
    # a token-level estimator (`tokens` of m1/marl/algo/advantages.py): one advantage per completion token, which
    # the loss uses in place of `advantage` (that keeps the sequence's value, for records)
    token_advantages: list[float] | None = None

    @property
    def zero_advantage(self) -> bool:
        """No token carries an advantage, so with beta 0 the sample has no gradient."""
        if self.token_advantages is not None:
            return not any(self.token_advantages)
        return self.advantage == 0


@dataclass(frozen=True)
class RolloutBatch:
    """The episodes of one step, grouped [question][rollout], and the DAG they ran on; `score` returns a copy with
    the rewards filled in rather than changing a batch another part of the step may still read."""

    questions: list[Question]
    episodes: list[list[Episode]]
    topology: Topology
    rewards: dict[str, list[list[float]]] = field(default_factory=dict)  # agent -> [G][K]
    outcomes: dict[str, list[list[float]]] = field(default_factory=dict)  # agent -> [G][K], when rewards have one
    breakdowns: list[dict[str, Any]] = field(default_factory=list)  # flat, episode order
    focus: list[str] | None = None  # credit agent: the one agent sampling in each question's episodes; None: all

    @property
    def flat(self) -> list[Episode]:
        return [e for group in self.episodes for e in group]


def training_team_config(team: TeamConfig, temperature: float,
                         phase_temperature: dict[str, float] | None = None, distinct_plans: int = 0,
                         plan_fill: str | None = None) -> TeamConfig:
    """The team as trained: sampling at `temperature` (and `phase_temperature` over the team's own per-phase ones;
    `distinct_plans` and `plan_fill` when set), and one model key per agent.

    Two agents naming the same model key would share weights during generation; with one learner per agent each
    needs its own copy, so shared keys are split into `<key>@<agent>` entries with the same spec.
    """
    if team.served_teams:  # its weights are behind someone else's server: nothing here could train it
        raise ValueError(f"team {team.name!r}: agent {team.served_teams[0]!r} is a served team (model interface team), "
                         "which training cannot update or score per token; train a team of local agents")
    models = dict(team.models)
    agents: list[AgentSpec] = []
    users: dict[str, int] = {}
    for a in team.agents:
        users[a.model] = users.get(a.model, 0) + 1
    for a in team.agents:
        key = a.model
        if users[key] > 1:
            key = f"{a.model}@{a.name}"
            models[key] = team.models[a.model]
        agents.append(a.model_copy(update={"model": key}))
    sampling = team.sampling.model_copy(update={"temperature": temperature, "phase_temperature": {
        **team.sampling.phase_temperature, **(phase_temperature or {})},
        "distinct_plans": distinct_plans or team.sampling.distinct_plans,
        "plan_fill": plan_fill if plan_fill not in (None, "repeat") else team.sampling.plan_fill})
    return team.model_copy(update={"models": models, "agents": agents, "sampling": sampling})


def agent_temperature(team: TeamConfig, agent: str) -> float:
    """The temperature the agent samples with; log-probs must be recomputed at the same value."""
    spec = next(a for a in team.agents if a.name == agent)
    t = spec.temperature if spec.temperature is not None else team.sampling.temperature
    if not t > 0:
        raise RolloutError(f"agent {agent!r}: GRPO needs sampled rollouts, but its temperature is {t}")
    return t


def derive_seed(*parts: Any) -> int:
    """A 31-bit seed from ints/strings, stable across processes (Python's str hash is salted per process)."""
    digest = hashlib.sha256(json.dumps([str(p) for p in parts]).encode()).digest()
    return int.from_bytes(digest[:4], "little") & 0x7FFFFFFF


def sample_topology(agents: list[str], mode: str, edge_prob: float, dropout: float, rng: random.Random) -> Topology:
    """One DAG for a whole step (the paper's agent dropout); `complete` keeps everyone connected."""
    if mode == "complete":
        return topo.complete(agents)
    return topo.random_dag(agents, edge_prob, dropout, rng)


def step_topology(agents: list[str], rollout, seed: int, step: int, complete: bool = False) -> Topology:
    """The DAG of one training step, drawn from (seed, step) alone so a resumed run repeats it. `complete`: the
    complete graph whatever `rollout.topology` says (a seed-kind team of one)."""
    mode = "complete" if complete else rollout.topology
    return sample_topology(agents, mode, rollout.edge_prob, rollout.dropout,
                           random.Random(derive_seed(seed, step, "topology")))


def run_rollouts(team: Team, questions: Sequence[Question], k: int, topology: Topology,
                 focus: Sequence[str] | None = None) -> RolloutBatch:
    """Run each question K times over `topology`; returns episodes grouped [question][rollout].

    `focus` (`credit: agent`): one agent per question; in that question's episodes every other agent decodes
    greedily (temperature 0), so only the focus agent's draws differ between its K rollouts."""
    if k < 1:
        raise RolloutError(f"num_generations must be >= 1, got {k}")
    repeated = [q for q in questions for _ in range(k)]
    temperatures = None
    if focus is not None:
        names = [a.name for a in team.cfg.agents]
        if len(focus) != len(questions) or any(f not in names for f in focus):
            raise RolloutError(f"focus: needs one agent of {names} per question ({len(questions)}), got {list(focus)}")
        temperatures = [{a: 0.0 for a in names if a != f} for f in focus for _ in range(k)]
    flat = team.run(repeated, topologies=[topology] * len(repeated), temperatures=temperatures)
    if len(flat) != len(repeated):
        raise RolloutError(f"team returned {len(flat)} episodes for {len(repeated)} requests")
    groups = [flat[i * k:(i + 1) * k] for i in range(len(questions))]
    return RolloutBatch(questions=list(questions), episodes=groups, topology=topology,
                        focus=list(focus) if focus is not None else None)


def score(batch: RolloutBatch, agents: Sequence[str], reward_fn: RewardFn) -> RolloutBatch:
    """`batch` scored: `rewards[agent][g][k]` (NaN where an agent has no reward, e.g. a failed episode), the
    per-episode `breakdowns`, and `outcomes` alike when every reward has an `.outcome` (RewardBreakdown)."""
    flat = batch.flat
    per_episode = reward_fn(flat)
    if len(per_episode) != len(flat):
        raise RolloutError(f"reward function returned {len(per_episode)} results for {len(flat)} episodes")
    k = len(batch.episodes[0]) if batch.episodes else 0
    rewards: dict[str, list[list[float]]] = {a: [] for a in agents}
    outcomes: dict[str, list[list[float]]] = {a: [] for a in agents}
    has_outcome = all(hasattr(v, "outcome") for per in per_episode for v in per.values())
    for i, (ep, per) in enumerate(zip(flat, per_episode)):
        g, r = divmod(i, k)
        for a in agents:
            if r == 0:
                rewards[a].append([])
                outcomes[a].append([])
            value = per.get(a) if ep.error is None else None
            total = getattr(value, "total", value)  # a breakdown's total, or a custom reward function's number
            rewards[a][g].append(float("nan") if total is None else float(total))
            if has_outcome:
                outcomes[a][g].append(float("nan") if value is None else float(value.outcome))
    return replace(batch, rewards=rewards, outcomes=outcomes if has_outcome else {}, breakdowns=list(per_episode))


OUTCOME_PHASES = ("answer", "summary")  # what `credit: phase` trains on the outcome: the generations that decide it


@dataclass
class Credit:
    """What one generation was credited with: its reward and advantage, and whether it became a sample."""

    reward: float
    advantage: float
    trained: bool


def generation_credit(batch: RolloutBatch, advantages: dict[str, Any],
                      outcome_advantages: dict[str, Any] | None = None,
                      phases: Collection[str] | None = None) -> dict[tuple[int, int, int], Credit]:
    """(g, k, i) -> the Credit of generation i of rollout (g, k), for every generation of an agent in `advantages`.

    Every generation of the agent in rollout (g, k) gets advantage A[agent][g, k]; with `outcome_advantages`
    (credit: phase), its answers and summaries get outcome_advantages[agent][g, k] instead. It is trained on unless
    its episode failed, its phase is not in `phases` (`rollout.train_phases`), or another agent is its question's
    focus (`credit: agent`). The samples of a step (`build_samples`) and the record of what it trained on
    (m1/marl/samples.py) both read this."""
    out: dict[tuple[int, int, int], Credit] = {}
    for g, group in enumerate(batch.episodes):
        for k, ep in enumerate(group):
            for i, gen in enumerate(ep.generations):
                if gen.agent not in advantages:
                    continue
                table = (outcome_advantages if outcome_advantages is not None and gen.phase in OUTCOME_PHASES
                         else advantages)
                trained = (ep.error is None and (phases is None or gen.phase in phases)
                           and (batch.focus is None or gen.agent == batch.focus[g]))
                out[(g, k, i)] = Credit(reward=batch.rewards[gen.agent][g][k],
                                        advantage=float(table[gen.agent][g, k]), trained=trained)
    return out


def build_samples(batch: RolloutBatch, advantages: dict[str, Any], temperatures: dict[str, float],
                  outcome_advantages: dict[str, Any] | None = None, phases: Collection[str] | None = None,
                  phase_temperature: dict[str, float] | None = None) -> dict[str, list[Sample]]:
    """Per-agent samples: one per generation that `generation_credit` marks trained, carrying its reward and
    advantage, and the temperature it was sampled at (its phase's when `phase_temperature` names it, else its
    agent's)."""
    phase_temperature = phase_temperature or {}
    out: dict[str, list[Sample]] = {a: [] for a in advantages}
    credit = generation_credit(batch, advantages, outcome_advantages, phases)
    for g, group in enumerate(batch.episodes):
        for k, ep in enumerate(group):
            seen: dict[str, int] = {}
            for i, gen in enumerate(ep.generations):
                if gen.weight_version is not None:
                    seen[gen.agent] = min(seen.get(gen.agent, gen.weight_version), gen.weight_version)
                c = credit.get((g, k, i))
                if c is None or not c.trained:  # a failed episode (e.g. dropped over the prompt budget): nothing
                    continue
                if gen.prompt_ids is None or gen.completion_ids is None:
                    raise RolloutError(
                        f"episode {ep.id!r}, agent {gen.agent!r}, phase {gen.phase}: the model returned no token "
                        "ids; training needs a backend that reports them (hf, vllm)")
                if not gen.completion_ids:
                    continue  # nothing was generated: nothing to train on
                frames = image_frames(gen.prompt) or None
                out[gen.agent].append(Sample(
                    agent=gen.agent, question_id=ep.question.id, group=g, rollout=k, phase=gen.phase,
                    prompt_ids=list(gen.prompt_ids), completion_ids=list(gen.completion_ids),
                    logprobs=list(gen.logprobs) if gen.logprobs is not None else None,
                    reward=c.reward, advantage=c.advantage,
                    temperature=phase_temperature.get(gen.phase, temperatures[gen.agent]),
                    weight_version=gen.weight_version,
                    versions=dict(seen) or None, video=ep.question.video if frames else None, frames=frames))
    return out
