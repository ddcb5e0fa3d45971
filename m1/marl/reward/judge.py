"""Judges for the collaboration reward R_col (and for open-ended answer correctness).

A judge reads one agent's memory record (plan, tool calls with outputs and decisions, answer)
and returns a binary verdict on three criteria: is the plan feasible, are the tools fit for the
question, are the steps well managed. This module holds what both implementations share (the items judged, the
verdict, the `Judge` protocol, the plan rubrics); each lives in a module of its own:

- `LLMJudge` (m1/marl/reward/llm_judge.py): any `ChatModel` (the paper uses GPT-4o behind an OpenAI-compatible API). All
  items of a call go to the model in one batched `generate`; a requests-per-minute token bucket splits
  the batch when it would exceed the budget; verdicts are cached on disk by a SHA-256 of the
  rendered prompt (which contains the trajectory) and the judge model name. A reply that cannot
  be read is a verdict of 0 with `ok=False`, never an exception.
- `RubricJudge` (m1/marl/reward/rubric_judge.py): the **offline rubric judge** - deterministic rules over the same three
  criteria, for CPU runs and tests where no judge model is available. Its name, "offline-rubric-judge",
  appears in every verdict and log line it produces, so its scores are never mistaken for an
  LLM judge's.

Both take `plan_rubric` (`judge.plan_rubric` of a MARL config), how plans and tool choices are judged:
- `cues` (default, the paper's judge as we read it): the tools must fit cues of the question (a stated time
  -> Time Stamp Retrieval, spatial words -> Space Tool, counting -> Global Sampling, grounding -> Grounding
  Tool). These are the rule-based teacher's own preferences, so a different plan that answers right fails.
- `outcome` (ours): no tool is required for any cue. A plan passes when it is well-formed (strict
  format, known tools, selection first, a browser, no tool named twice), ran (every planned tool was called,
  unless the agent stopped or reached the call limit) and its calls produced notes the answer follows (a
  browsing call returned a description; when the agent's own tools suggested answers, its answer is one of them).
- `none` (ours): the plan's content is not judged at all; only that the agent wrote it in the required format
  (a plan the parser repaired is still not credited). Tool calls and step management are judged as before.
Every mode keeps the non-plan rules: key info drawn from the question, no failed calls, step management.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Protocol, runtime_checkable

from pydantic import BaseModel, ConfigDict, Field

from m1.schema import AgentRecord, Episode, Question

PlanRubric = Literal["cues", "outcome", "none"]
PLAN_RUBRICS: tuple[str, ...] = ("cues", "outcome", "none")


# ----------------------------------------------------------------------------- records
class Verdict(BaseModel):
    """One binary judgement. `ok` is False when the judge's reply could not be read (value 0)."""

    model_config = ConfigDict(extra="forbid")

    value: Literal[0, 1]
    ok: bool = True
    reason: str = ""
    judge: str
    lenient: bool = False  # read only by the lenient parser (format was off, meaning was clear)
    cached: bool = False
    raw: str = ""
    criteria: dict[str, bool] = Field(default_factory=dict)  # per-criterion results (rubric judge)
    error: str | None = None


@dataclass
class JudgeItem:
    """One agent's trajectory to judge: the question and that agent's memory record."""

    question: Question
    agent: str
    record: AgentRecord
    episode_id: str = ""
    # None when the agent's plan reply parsed in the strict format; else that reply. The team then ran a plan it
    # read leniently or filled in (the question as key info, default tools): judging that plan would credit the
    # agent for the system's repair, which MARL learned to exploit on the mini team (README, mini team).
    unreadable_plan: str | None = None

    @classmethod
    def from_episode(cls, episode: Episode, agent: str) -> JudgeItem:
        if agent not in episode.memory:
            raise KeyError(f"episode {episode.id!r}: agent {agent!r} has no memory record "
                           f"(agents with records: {sorted(episode.memory)})")
        rec = episode.memory[agent]
        if rec.answer is None:  # the answer phase writes both; prefer the memory, fall back to answers
            ans = next((a for a in episode.answers if a.agent == agent), None)
            if ans is not None:
                rec = rec.model_copy(update={"answer": ans.answer, "reason": ans.reason})
        bad = next((g.completion for g in episode.generations
                    if g.agent == agent and g.phase == "plan" and not g.parse_ok), None)
        return cls(question=episode.question, agent=agent, record=rec, episode_id=episode.id, unreadable_plan=bad)


@dataclass
class CorrectItem:
    """An open-ended answer to check against the question's reference answer."""

    question: Question
    answer: str


@runtime_checkable
class Judge(Protocol):
    name: str

    def judge(self, items: list[JudgeItem]) -> list[Verdict]:
        """One collaboration verdict per item, in order."""
        ...

    def correct(self, items: list[CorrectItem]) -> list[Verdict]:
        """One correctness verdict per open-ended answer, in order (1 = means the reference)."""
        ...


def check_plan_rubric(value: str, who: str) -> str:
    if value not in PLAN_RUBRICS:
        raise ValueError(f"{who}: plan_rubric must be one of {list(PLAN_RUBRICS)}, got {value!r}")
    return value
