"""Per-agent rewards for multi-agent GRPO: R = w_res * R_res + w_format * R_format + w_col * R_col
(+ w_team * team_res, ours, off by default).

- R_res (result): each agent's own answer against the ground truth.
  MCQ: +1 for the right letter, -1 otherwise (also when no letter can be read).
  Grounding (ours; the paper only states +/- for right/wrong): the temporal IoU of the predicted
  span with the true span, mapped to [-1, 1] as 2*IoU - 1 ("linear", default: a dense signal,
  a perfect span +1, a disjoint or unreadable one -1) or thresholded (+1 iff IoU >= threshold).
  Numeric: VSI-Bench's mean relative accuracy (MRA, in [0, 1]) mapped the same way.
  Open-ended: the judge's correctness verdict (+1/-1), or a normalised exact match without one.
- R_format: the share of the agent's generations (plan, communicate, answer, summary) whose
  reply parsed in the strict format, in [0, 1]. `format: phases` (ours) averages the share per
  phase instead, so a plan or an answer counts as much as all communication decisions together
  (these are most generations). On the mini team it kept neither plans nor answers in format.
- R_col: the judge's binary verdict on the agent's memory record, in {0, 1} as in the paper,
  plus `over_limit_penalty` (default -2) for every tool call past `tool_call_limit` (default 5).
  A plan reply the parser had to repair or fill in fails the verdict (`JudgeItem.unreadable_plan`):
  crediting the repaired plan is what drove the mini team's plans out of format under MARL.
  One call over the limit thus turns the best verdict (1) into -1, below a failed verdict (0):
  the penalty is "strong" because it dominates the judge's whole range.

The team's answer (`episode.final_answer`) is scored with the same rule and logged as `team_res`.
In the paper each agent is rewarded for its own answer only, which is our default (`w_team` = 0).
`w_team` > 0 (ours) adds `w_team * team_res` to every agent's total: a shared team term that also
rewards the generations no own-answer reward reaches, such as the summarizer's merged answer.
`outcome` = w_res * R_res + w_format * (the agent's answer, and its summary if it wrote one, parsed strictly)
+ w_team * team_res is what an answer (or the summarizer's summary) decides; with `rollout.credit: phase` (ours)
both are trained on the advantage of the outcome alone (m1.marl.rollout.episodes). Their own format is part of it so
that a reply the parser must rescue (an option letter for an open question, say) loses to a well-formed one with the
same result.
"""
from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator


from m1.text import parse_span
from m1.config import Strict
from m1.data.metrics import iou, is_correct, mra, normalize_answer, parse_number
from m1.marl.reward.judge import CorrectItem, Judge, JudgeItem
from m1.registry import CPP, is_seed, seed_kind, seed_kind_names
from m1.schema import Episode, Question

log = logging.getLogger(__name__)

__all__ = [
    "RewardConfig", "RewardBreakdown", "result_reward", "format_reward",
    "outcome_parsed", "collaboration_reward",
    "tool_penalty", "agent_answer", "agent_rewards", "batch_agent_rewards", "log_breakdowns",
    "summarize", "SeedReward", "seed_reward", "seed_rewards", "summarize_seed",
    "reward_kind", "turns_strict", "tool_used",
]


class RewardConfig(Strict):
    """Reward weights and mappings (the `rewards:` block of a MARL config)."""

    w_res: float = Field(default=1.0, description="Weight of R_res, the agent's own answer against the truth.")
    w_format: float = Field(default=1.0, description="Weight of R_format, the share of its replies in the strict "
                                                     "format.")
    w_col: float = Field(default=1.0, description="Weight of R_col, the judge's verdict on its memory record (0 "
                                                  "with judge.method none).")
    w_team: float = Field(default=0.0, description="Ours: weight of the team's result, shared by every agent "
                                                   "(paper: 0).")
    tool_call_limit: int = Field(5, ge=1, description="Tool calls an agent may make before each one is penalised.")
    over_limit_penalty: float = Field(-2.0, le=0.0, description="Added to R_col once per tool call past the limit; "
                                                                "at most 0.")
    grounding: Literal["linear", "threshold"] = Field(default="linear", description=(
        "Grounding R_res from the span's IoU: linear 2 * IoU - 1, or threshold +1 / -1 around grounding_threshold."))
    grounding_threshold: float = Field(0.5, gt=0.0, le=1.0, description="IoU needed for +1 in threshold mode.")
    numeric: Literal["linear", "threshold"] = Field(default="linear", description=(
        "Numeric R_res from the mean relative accuracy (MRA): linear 2 * MRA - 1, or threshold +1 / -1 around "
        "numeric_threshold."))
    numeric_threshold: float = Field(0.5, gt=0.0, le=1.0, description="MRA needed for +1 in threshold mode.")
    format: Literal["generations", "phases"] = Field(default="generations", description=(
        "R_format: the share of all generations in format, or (phases, ours) the mean of that share per phase."))
    kind: str = Field(default="auto", description=(
        "Which reward: auto follows the team's agent kind. cpp: the rewards above; weaver / zoomer / sage: that "
        "seed system's own reward with the papers' weights (w_* ignored)."))

    @field_validator("kind")
    @classmethod
    def _known_kind(cls, v: str) -> str:
        """Checked against the registry's kind names (m1/registry.py spells them)."""
        known = ["auto", CPP, *seed_kind_names()]
        if v not in known:
            raise ValueError(f"rewards.kind: unknown reward {v!r} (known: {known})")
        return v


class RewardBreakdown(BaseModel):
    """One agent's reward on one episode, with everything needed to read it in a log."""

    model_config = ConfigDict(extra="forbid")

    agent: str
    res: float
    format: float
    col: float
    total: float
    team_res: float
    outcome: float  # w_res * res + w_format * answer (and summary) parsed + w_team * team_res: what they decide
    verdict: int
    verdict_ok: bool
    judge: str
    judge_reason: str = ""
    tool_calls: int
    penalty: float


# ----------------------------------------------------------------------------- R_res
def _mapped(score: float, mode: str, threshold: float) -> float:
    """A [0, 1] score to [-1, 1]: linear 2s-1, or +1/-1 around the threshold."""
    if mode == "linear":
        return 2.0 * score - 1.0
    return 1.0 if score >= threshold else -1.0


def _rule_score(question: Question, answer: str | None, cfg: RewardConfig) -> float | None:
    """R_res for every task a rule can decide; None for an open question that needs matching."""
    if question.answer is None:
        raise ValueError(f"question {question.id!r}: no ground truth answer; the result reward needs one")
    task = question.task
    if task == "mcq":  # the evaluation's own definition of a right answer (m1/data/metrics.py)
        return 1.0 if is_correct(question, answer) else -1.0
    if task == "grounding":
        gt = parse_span(question.answer)
        if gt is None:
            raise ValueError(f"question {question.id!r}: grounding ground truth {question.answer!r} "
                             "is not a '[s - e]' span")
        pred = parse_span(answer) if answer else None
        return -1.0 if pred is None else _mapped(iou(pred, gt), cfg.grounding, cfg.grounding_threshold)
    if task == "numeric":
        gt_n = parse_number(question.answer)
        if gt_n is None or not math.isfinite(gt_n):
            raise ValueError(f"question {question.id!r}: numeric ground truth {question.answer!r} is not a number")
        pred_n = parse_number(answer) if answer else None
        if pred_n is None:
            return -1.0
        # MRA is a relative error and undefined at 0: a true count of 0 needs an exact 0.
        score = mra(pred_n, gt_n) if gt_n != 0 else float(pred_n == 0)
        return _mapped(score, cfg.numeric, cfg.numeric_threshold)
    if task == "open":
        if not answer or not answer.strip():
            return -1.0
        return None
    raise ValueError(f"question {question.id!r}: unknown task {task!r}")


def _open_by_match(question: Question, answer: str) -> float:
    got = normalize_answer(answer)
    return 1.0 if got and got == normalize_answer(question.answer) else -1.0


def _result_rewards(pairs: Sequence[tuple[Question, str | None]], cfg: RewardConfig,
                    judge: Judge | None) -> list[float]:
    """R_res for many (question, answer) pairs; open answers go to the judge in one call."""
    out: list[float | None] = [_rule_score(q, a, cfg) for q, a in pairs]
    open_idx = [i for i, v in enumerate(out) if v is None]
    if open_idx:
        if judge is None:
            for i in open_idx:
                q, a = pairs[i]
                out[i] = _open_by_match(q, a or "")
        else:
            verdicts = judge.correct([CorrectItem(pairs[i][0], pairs[i][1] or "") for i in open_idx])
            if len(verdicts) != len(open_idx):
                raise RuntimeError(f"judge {judge.name}: {len(verdicts)} correctness verdicts for "
                                   f"{len(open_idx)} answers")
            for i, v in zip(open_idx, verdicts):
                out[i] = 1.0 if v.value == 1 else -1.0
    return [float(v) for v in out]  # type: ignore[arg-type]


def result_reward(question: Question, answer: str | None, judge: Judge | None = None,
                  cfg: RewardConfig | None = None) -> float:
    """R_res of one answer in [-1, 1] (see the module docstring for each task's rule)."""
    return _result_rewards([(question, answer)], cfg or RewardConfig(), judge)[0]


# ----------------------------------------------------------------------------- R_format
def format_reward(episode: Episode, agent: str, mode: str = "generations") -> float:
    """Share of the agent's generations that parsed in the strict format (`phases`: the mean of that share over
    the phases it wrote); 0.0 if it wrote none."""
    gens = [g for g in episode.generations if g.agent == agent]
    if not gens:
        return 0.0
    if mode == "generations":
        return sum(g.parse_ok for g in gens) / len(gens)
    by_phase: dict[str, list[bool]] = {}
    for g in gens:
        by_phase.setdefault(g.phase, []).append(g.parse_ok)
    return sum(sum(v) / len(v) for v in by_phase.values()) / len(by_phase)


def outcome_parsed(episode: Episode, agent: str) -> float:
    """1.0 if the agent's last answer reply parsed in the strict format and, when it wrote the team's summary, that
    summary did too; else 0.0 (also when it wrote no answer). The summary counts because it decides the team's
    open and grounding answers: without it MARL let a summarizer drift to option letters on open questions (dev,
    one seed: open questions 42% -> 4%)."""
    answers = [g for g in episode.generations if g.agent == agent and g.phase == "answer"]
    summaries = [g for g in episode.generations if g.agent == agent and g.phase == "summary"]
    return float(bool(answers) and answers[-1].parse_ok and all(g.parse_ok for g in summaries))


# ----------------------------------------------------------------------------- R_col
def tool_penalty(n_calls: int, cfg: RewardConfig) -> float:
    """`over_limit_penalty` per tool call past the limit (0 within it)."""
    return cfg.over_limit_penalty * max(0, n_calls - cfg.tool_call_limit)


def _tool_calls(episode: Episode, agent: str) -> int:
    rec = episode.memory.get(agent)
    return len(rec.turns) if rec is not None else 0


def collaboration_reward(episode: Episode, agent: str, judge: Judge, cfg: RewardConfig | None = None) -> float:
    """The judge's verdict (0 or 1) on the agent's memory record plus the over-limit penalty."""
    cfg = cfg or RewardConfig()
    verdict = judge.judge([JudgeItem.from_episode(episode, agent)])[0]
    return verdict.value + tool_penalty(_tool_calls(episode, agent), cfg)


# ----------------------------------------------------------------------------- all together
def agent_answer(episode: Episode, agent: str) -> str | None:
    """The agent's own final answer: its entry in `episode.answers`, else its memory record."""
    for a in reversed(episode.answers):
        if a.agent == agent:
            return a.answer
    rec = episode.memory.get(agent)
    return rec.answer if rec is not None else None


def _agents(episode: Episode) -> list[str]:
    return [a for a in episode.topology.agents if a in episode.memory]


def batch_agent_rewards(episodes: Sequence[Episode], cfg: RewardConfig,
                        judge: Judge | None) -> list[dict[str, RewardBreakdown]]:
    """Rewards of every agent of every episode, with one judge call for all collaboration
    verdicts and one for all open-ended correctness checks (agents' and teams' answers)."""
    if judge is None and cfg.w_col != 0:
        raise ValueError(f"rewards: w_col={cfg.w_col} needs a judge (pass LLMJudge or the offline RubricJudge)")
    names = [_agents(ep) for ep in episodes]
    pairs: list[tuple[Question, str | None]] = []
    for ep, agents in zip(episodes, names):
        pairs += [(ep.question, agent_answer(ep, a)) for a in agents]
        pairs.append((ep.question, ep.final_answer))
    res = iter(_result_rewards(pairs, cfg, judge))
    items = [JudgeItem.from_episode(ep, a) for ep, agents in zip(episodes, names) for a in agents]
    got = judge.judge(items) if judge is not None and items else []
    if judge is not None and len(got) != len(items):
        raise RuntimeError(f"judge {judge.name}: {len(got)} verdicts for {len(items)} trajectories")
    verdicts = iter(got)
    out: list[dict[str, RewardBreakdown]] = []
    for ep, agents in zip(episodes, names):
        agent_res = [next(res) for _ in agents]
        team_res = next(res)
        per: dict[str, RewardBreakdown] = {}
        for a, r in zip(agents, agent_res):
            n_calls = _tool_calls(ep, a)
            pen = tool_penalty(n_calls, cfg)
            v = next(verdicts, None)
            value, ok = (v.value, v.ok) if v is not None else (0, True)
            col = value + pen
            fmt = format_reward(ep, a, cfg.format)
            outcome = cfg.w_res * r + cfg.w_format * outcome_parsed(ep, a) + cfg.w_team * team_res
            per[a] = RewardBreakdown(
                agent=a, res=r, format=fmt, col=col,
                # summed in this order so that reruns reproduce earlier runs bit for bit
                total=cfg.w_res * r + cfg.w_format * fmt + cfg.w_col * col + cfg.w_team * team_res,
                team_res=team_res, outcome=outcome, verdict=value, verdict_ok=ok,
                judge=v.judge if v else "none (w_col=0)", judge_reason=v.reason if v else "", tool_calls=n_calls,
                penalty=pen)
        out.append(per)
    return out


def agent_rewards(episode: Episode, cfg: RewardConfig, judge: Judge | None) -> dict[str, RewardBreakdown]:
    """{agent: RewardBreakdown} for one episode (see `batch_agent_rewards` for many)."""
    return batch_agent_rewards([episode], cfg, judge)[0]


def log_breakdowns(episode_id: str, breakdowns: dict[str, RewardBreakdown],
                   logger: logging.Logger = log) -> None:
    """One INFO line per agent; the judge's name is always part of it."""
    for b in breakdowns.values():
        logger.info("episode %s agent %s: total %.3f = res %.3f + format %.3f + col %.3f "
                    "(verdict %d by %s%s, %d tool calls, penalty %.1f; team res %.3f)",
                    episode_id, b.agent, b.total, b.res, b.format, b.col, b.verdict, b.judge,
                    "" if b.verdict_ok else ", unreadable", b.tool_calls, b.penalty, b.team_res)


def summarize(batch: Sequence[dict[str, RewardBreakdown]]) -> dict[str, float]:
    """Batch means for the training log: overall, per agent, and the judge's readability rate."""
    rows = [b for per in batch for b in per.values()]
    if not rows:
        return {}
    n = len(rows)
    out = {f"reward/{k}": sum(getattr(b, k) for b in rows) / n for k in ("total", "res", "format", "col")}
    out["reward/verdict"] = sum(b.verdict for b in rows) / n
    out["reward/verdict_unreadable"] = sum(not b.verdict_ok for b in rows) / n
    out["reward/over_limit"] = sum(b.penalty < 0 for b in rows) / n
    teams = [next(iter(per.values())).team_res for per in batch if per]  # one team answer per episode
    out["reward/team_res"] = sum(teams) / len(teams)
    for agent in sorted({b.agent for b in rows}):
        mine = [b.total for b in rows if b.agent == agent]
        out[f"reward/total/{agent}"] = sum(mine) / len(mine)
    return out


# ----------------------------------------------------------------------------- the seed kinds' rewards
# Each kind's weights of (correct, format, tool) and any extra term are in its spec (SeedKindSpec reward_weights,
# reward_extra: m1/kinds/weaver.py, zoomer.py, sage.py, with the papers' reasons).


class SeedReward(BaseModel):
    """One seed-kind episode's reward and its parts (all 0/1 except `step`, the kind's extra term: SAGE's
    reasonable-tool term)."""

    model_config = ConfigDict(extra="forbid")

    agent: str
    kind: str
    correct: float
    format: float  # every policy turn parsed strictly
    tool: float  # a tool was called and the answer is right (Weaver, VideoZoomer)
    step: float = 0.0  # the kind's extra term (SeedKindSpec reward_extra; SAGE: +/- 0.1 for a repeated call or not)
    total: float
    tool_calls: int
    turns: int


def reward_kind(cfg: RewardConfig, team) -> str:
    """The reward a team trains with: `rewards.kind`, or with `auto` its agents' kind; a CPP reward on a seed-kind
    team (or the reverse) is refused naming both."""
    kinds = {a.kind for a in team.agents}
    team_kind = next((k for k in kinds if is_seed(k)), CPP)  # a planning team (cpp or another) takes CPP's
    if cfg.kind == "auto":
        return team_kind
    if is_seed(cfg.kind) != is_seed(team_kind):
        raise ValueError(f"rewards.kind: {cfg.kind!r} does not fit team {team.name!r}, whose agent kind is "
                         f"{team_kind!r} (use auto)")
    return cfg.kind


def turns_strict(episode: Episode, agent: str) -> float:
    """1.0 when the agent wrote at least one reply and every one parsed in the strict format, else 0.0."""
    gens = [g for g in episode.generations if g.agent == agent]
    return float(bool(gens) and all(g.parse_ok for g in gens))


def tool_used(episode: Episode, agent: str) -> bool:
    """Whether the agent called a tool (an executed call, even one answered with an error observation)."""
    return _tool_calls(episode, agent) > 0


def seed_reward(episode: Episode, kind: str, agent: str | None = None) -> SeedReward:
    """The reward of a seed-kind episode for its (only) agent, as its paper defines it (the kind's SeedKindSpec
    reward_weights and reward_extra). Right or wrong is `m1.data.metrics.is_correct` on the team's final answer, the
    evaluation's own definition (grounding: IoU >= 0.5)."""
    if not is_seed(kind):
        raise ValueError(f"rewards.kind: {kind!r} has no seed reward ({', '.join(seed_kind_names())})")
    if episode.question.answer is None:
        raise ValueError(f"question {episode.question.id!r}: no ground truth answer; the seed reward needs one")
    spec = seed_kind(kind)
    agent = agent if agent is not None else next(iter(episode.memory))
    correct = float(is_correct(episode.question, episode.final_answer))
    fmt = turns_strict(episode, agent)
    calls = _tool_calls(episode, agent)
    tool = float(calls > 0 and correct == 1.0)
    turns = sum(g.agent == agent for g in episode.generations)
    w_c, w_f, w_t = spec.reward_weights
    total = w_c * correct + w_f * fmt + w_t * tool
    if spec.reward_extra is None:
        return SeedReward(agent=agent, kind=kind, correct=correct, format=fmt, tool=tool, total=total,
                          tool_calls=calls, turns=turns)
    step = spec.reward_extra(episode, agent, calls)
    return SeedReward(agent=agent, kind=kind, correct=correct, format=fmt, tool=tool, step=step, total=total + step,
                      tool_calls=calls, turns=turns)


def seed_rewards(episodes: Sequence[Episode], kind: str) -> list[dict[str, SeedReward]]:
    """`seed_reward` per episode as {agent: SeedReward}; a failed episode (unreadable video) gets {} (no reward)."""
    return [{} if ep.error is not None else {(r := seed_reward(ep, kind)).agent: r} for ep in episodes]


def summarize_seed(batch: Sequence[dict[str, SeedReward]]) -> dict[str, float]:
    """Batch means of the seed rewards' parts for the training log."""
    rows = [b for per in batch for b in per.values()]
    if not rows:
        return {}
    n = len(rows)
    out = {f"reward/{k}": sum(getattr(b, k) for b in rows) / n for k in ("total", "correct", "format", "tool", "step")}
    out["reward/tool_calls"] = sum(b.tool_calls for b in rows) / n
    out["reward/turns"] = sum(b.turns for b in rows) / n
    for agent in sorted({b.agent for b in rows}):
        mine = [b.total for b in rows if b.agent == agent]
        out[f"reward/total/{agent}"] = sum(mine) / len(mine)
    return out
