"""Which generations of a teacher's episodes become SFT examples, by the team kind's rule (the kind chooses:
`TeamKind.sft_examples`, m1/marl/team_training.py).

CPP teams (`select_examples`): the paper's keep rule: **at least one agent of the episode answered right, and the
writing agent's plan was never changed** (it never added a tool during communication). "Right" is a positive result
reward R_res (MCQ: the right letter; grounding: IoU above 0.5; numeric: MRA above 0.5; open: the judge's or an
exact-match verdict). By default only plan generations are kept (`phases: [plan]`), as in the paper. The other phases
(ours) need only the first condition: the plan condition is about plans, and an episode whose plan was revised is
exactly where the communicate step that revised it, and the answers written from the revised evidence, are worth
learning (on M1-Synth the teacher revises every "flash near the end" plan, so the strict rule would leave the students
almost no open-ended answers). `keep_revised_plans` (ours) also keeps the plan of an agent that revised it when that
agent itself answered right: the revision is then learnt from its communicate example, and questions the teacher
always revises (M1-Synth's late flashes: 0 of 640 plans kept by the strict rule) get plan examples at all.

Seed kinds (`select_seed_examples`): every turn of an episode the policy answered right.
"""
from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from m1.evidence import ChatEvidence
from m1.marl.reward.rewards import RewardConfig, batch_agent_rewards, seed_rewards
from m1.schema import Episode, Turn


@dataclass
class SFTExample:
    """One kept generation: the chat the teacher agent saw and what it wrote."""

    agent: str
    question_id: str
    phase: str
    messages: list[dict[str, Any]]
    completion: str
    video: str | None = None  # the video of the messages' image parts (seed kinds): a VLM student decodes them again
    # where the completion reads the messages, as the teacher recorded it (m1/evidence.py ChatEvidence); None: not
    # recorded (older files, served teachers). Read by `learner.attention` (the evidence attention loss)
    evidence: list[ChatEvidence] | None = None

    def __post_init__(self):  # read back from JSON, each entry is a dict
        if self.evidence is not None:
            self.evidence = [e if isinstance(e, ChatEvidence) else ChatEvidence(**e) for e in self.evidence]

    @classmethod
    def from_json(cls, line: str, where: str = "") -> SFTExample:
        try:
            return cls(**json.loads(line))
        except (TypeError, ValueError) as exc:
            raise ValueError(f"{where}: not an SFT example ({exc})") from exc


# ------------------------------------------------------------------------------------------------ the keep rule
def plan_unchanged(episode: Episode, agent: str) -> bool:
    """True when the agent never added a tool to its plan during communication."""
    rec = episode.memory.get(agent)
    if rec is None:
        return False
    return not any(t.decision is not None and t.decision.action == "add_tool" for t in rec.turns)


def right_agents(episodes: Sequence[Episode], rewards: RewardConfig, judge=None) -> list[list[str]]:
    """Per episode, the agents whose own answer earns a positive result reward."""
    cfg = rewards.model_copy(update={"w_col": 0.0})  # only R_res matters here: no collaboration verdicts needed
    ok = [e for e in episodes if e.error is None]
    scored = iter(batch_agent_rewards(ok, cfg, judge))
    out = []
    for e in episodes:
        per = next(scored) if e.error is None else {}
        out.append([a for a, b in per.items() if b.res > 0])
    return out


def select_examples(episodes: Sequence[Episode], rewards: RewardConfig, judge=None,
                    phases: Sequence[str] = ("plan",), keep_revised_plans: bool = False,
                    plan_filter: str = "keep_rule") -> tuple[list[SFTExample], dict[str, int]]:
    """Apply the keep rule to episodes (plan examples also need an unchanged plan, or with `keep_revised_plans` an
    agent that answered right after revising it; with `plan_filter="all"` every plan is kept); returns the examples
    and counts of why others were dropped."""
    stats = {"episodes": len(episodes), "episodes_failed": 0, "episodes_nobody_right": 0, "kept": 0,
             "dropped_plan_changed": 0}
    if keep_revised_plans:
        stats["kept_revised_plans"] = 0
    examples: list[SFTExample] = []
    for ep, right in zip(episodes, right_agents(episodes, rewards, judge)):
        if ep.error is not None:
            stats["episodes_failed"] += 1
            continue
        if not right:
            stats["episodes_nobody_right"] += 1
        for gen in ep.generations:
            if gen.phase not in phases:
                continue
            if gen.phase == "plan" and plan_filter == "all":
                pass
            elif not right:
                continue
            elif gen.phase == "plan" and not plan_unchanged(ep, gen.agent):
                if not (keep_revised_plans and gen.agent in right):
                    stats["dropped_plan_changed"] += 1
                    continue
                stats["kept_revised_plans"] += 1
            examples.append(SFTExample(agent=gen.agent, question_id=ep.question.id, phase=gen.phase,
                                       messages=gen.prompt, completion=gen.completion, video=ep.question.video,
                                       evidence=gen.evidence))
            stats["kept"] += 1
    return examples, stats


def corrected_calls(episode: Episode, agent: str) -> int:
    """Tool calls that correct an earlier one (VideoZoomer's reflection pattern): any call after a call that returned
    an error, or the same tool again over a span that strictly contains an earlier call's span (a zoom that missed,
    then a wider one). Calls over other spans (both ends of an event, say) are a plan, not a correction."""
    rec = episode.memory.get(agent)
    turns = rec.turns if rec is not None else []

    def widens(t: Turn, e: Turn) -> bool:
        return (t.tool == e.tool and t.span is not None and e.span is not None and tuple(t.span) != tuple(e.span)
                and t.span[0] <= e.span[0] and e.span[1] <= t.span[1])

    return sum(any(e.error for e in turns[:i]) or any(widens(t, e) for e in turns[:i]) for i, t in enumerate(turns))


def select_seed_examples(episodes: Sequence[Episode], kind: str,
                         phases: Sequence[str] | None = None) -> tuple[list[SFTExample], dict[str, int]]:
    """Seed-kind trajectories (weaver / zoomer / sage): every turn of a right episode is an example (its chat so far,
    tool observations included, as the prompt; its reply as the target), `phases` (act, answer) when given. Right
    is the seed reward's `correct` (m1.data.metrics.is_correct on the final answer). A right episode that corrected
    a tool call on the way (`corrected_calls`) is kept like any other: these are VideoZoomer's reflection
    trajectories, counted in `kept_reflection_episodes`."""
    stats = {"episodes": len(episodes), "episodes_failed": 0, "episodes_wrong": 0, "kept": 0,
             "kept_episodes": 0, "kept_reflection_episodes": 0}
    examples: list[SFTExample] = []
    for ep, per in zip(episodes, seed_rewards(episodes, kind)):
        if ep.error is not None:
            stats["episodes_failed"] += 1
            continue
        reward = next(iter(per.values()))
        if reward.correct != 1.0:
            stats["episodes_wrong"] += 1
            continue
        stats["kept_episodes"] += 1
        stats["kept_reflection_episodes"] += corrected_calls(ep, reward.agent) > 0
        for gen in ep.generations:
            if phases is not None and gen.phase not in phases:
                continue
            examples.append(SFTExample(agent=gen.agent, question_id=ep.question.id, phase=gen.phase,
                                       messages=gen.prompt, completion=gen.completion, video=ep.question.video,
                                       evidence=gen.evidence))
            stats["kept"] += 1
    return examples, stats
