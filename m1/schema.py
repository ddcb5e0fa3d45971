"""Records that flow through M1: questions in, episodes out.

Every record is a pydantic model so an episode can be written as JSON, read back, and used
both as the trace a person reads and as the sample source for training.
"""
from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from m1.evidence import ChatEvidence

Task = Literal["mcq", "open", "grounding", "numeric"]
Phase = Literal["plan", "communicate", "answer", "summary", "act"]  # act: a seed-kind turn that calls tools
LETTERS = "ABCDEFGHIJKLMNOPQRSTUVWXYZ"
MAX_QUESTION_CHARS = 1 << 20  # a question's text and options together (m1 serve's --max-text-kb default)


class Record(BaseModel):
    model_config = ConfigDict(extra="forbid")


class Question(Record):
    """One question about one video. `answer` is the ground truth when known."""

    id: str
    video: str
    text: str
    options: list[str] = Field(default_factory=list)
    task: Task = "mcq"
    answer: str | None = None
    meta: dict[str, Any] = Field(default_factory=dict)

    @field_validator("options")
    @classmethod
    def _lettered(cls, options: list[str]) -> list[str]:
        if len(options) > len(LETTERS):  # every option needs its letter
            raise ValueError(f"{len(options)} options: at most {len(LETTERS)} (A-Z)")
        return options

    def options_block(self) -> str:
        return "\n".join(f"{LETTERS[i]}: {o}" for i, o in enumerate(self.options))


class Plan(Record):
    """An agent's tool plan: what to look for, and which tools in which order."""

    key_info: str
    tools: list[str]


class Decision(Record):
    """The outcome of one communication step."""

    action: Literal["continue", "add_tool", "stop"] = "continue"
    tool: str | None = None
    key_info: str | None = None


class Turn(Record):
    """One executed tool call of one agent, as written into shared memory."""

    step: int
    tool: str
    key_info: str
    output: str
    timestamps: list[float] = Field(default_factory=list)
    answer: str | None = None
    span: tuple[float, float] | None = None
    error: str | None = None
    decision: Decision | None = None


class Generation(Record):
    """One model call of one agent: what it saw, what it wrote, and whether we could read it."""

    agent: str
    phase: Phase
    step: int = 0
    prompt: list[dict[str, Any]]
    completion: str
    prompt_ids: list[int] | None = None
    completion_ids: list[int] | None = None
    logprobs: list[float] | None = None
    parse_ok: bool = True
    parse_error: str | None = None
    # training with a rollout engine: the version of the weights that sampled it (left out of traces when unknown)
    weight_version: int | None = Field(None, exclude_if=lambda v: v is None)
    # entries of the peers' notes left out of the prompt to fit limits.max_prompt_tokens (m1/team/budget.py); left
    # out of traces when none were
    trimmed: int = Field(0, ge=0, exclude_if=lambda v: v == 0)
    # training (a step's sample pages, m1/marl/samples.py): the reward and advantage this generation was credited
    # with and whether it was trained on; left out of other traces
    credit: dict[str, Any] | None = Field(None, exclude_if=lambda v: v is None)
    # where the completion reads the prompt's messages, as its writer recorded it (the rule teacher,
    # m1/evidence.py ChatEvidence); SFT's attention loss learns from it. Left out of traces when none
    evidence: list[ChatEvidence] | None = Field(None, exclude_if=lambda v: v is None)


class AgentAnswer(Record):
    agent: str
    answer: str
    reason: str = ""
    parse_ok: bool = True


class AgentRecord(Record):
    """Everything one agent has written to shared memory."""

    plan: list[str] = Field(default_factory=list)
    key_info: str = ""
    turns: list[Turn] = Field(default_factory=list)
    answer: str | None = None
    reason: str | None = None


class Topology(Record):
    """Who may read whom: an edge (a, b) means b sees a's memory. Inactive agents are dropped."""

    agents: list[str]
    active: list[str]
    edges: list[tuple[str, str]]

    def visible_to(self, agent: str) -> list[str]:
        return [a for a, b in self.edges if b == agent and a in self.active]


class Episode(Record):
    """A whole team run on one question: the trace and the training sample."""

    id: str
    question: Question
    topology: Topology
    memory: dict[str, AgentRecord]
    generations: list[Generation] = Field(default_factory=list)
    answers: list[AgentAnswer] = Field(default_factory=list)
    final_answer: str | None = None
    final_reason: str = ""
    aggregation: str = ""
    frames_used: int = 0
    # seed kinds (m1/team/single.py): frames the policy saw, frames tool models read, turns, tool calls; left out
    # of dumps when empty, so CPP episodes read and write as before
    frame_counts: dict[str, int] = Field(default_factory=dict, exclude_if=lambda v: not v)
    timings: dict[str, float] = Field(default_factory=dict)
    error: str | None = None
    # why an answer stands on no frame (the team's plans read none); left out of dumps when None
    note: str | None = Field(None, exclude_if=lambda v: v is None)
    # served models (backend openai): per agent (its chat calls) and per tool model key (its vision calls), the
    # served model's name, calls and the tokens the server reported; left out of dumps when no server reported any
    usage: dict[str, dict[str, Any]] = Field(default_factory=dict, exclude_if=lambda v: not v)
