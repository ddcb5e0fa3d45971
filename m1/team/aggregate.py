"""How the team turns per-agent answers into one answer.

Rules (pure functions, tested on hand-built answers):
- vote: the most common valid answer. Tie rule: the tied answer given first in team order wins
  (team order lists the strongest agent first), unless a summarizer breaks the tie (the engine
  asks the summarizer when `tie` is set and uses this rule only if that reply is unreadable).
- best_score: the answer of the agent whose answer generation had the highest mean token
  log-prob (a confidence proxy); agents without log-probs score -inf; all missing -> vote.
- decide_by_agent: the designated agent's answer; if it has none, vote.
- median (grounding): the median start and end of the agents' spans, no summary call.
- summarizer (open-ended, grounding): a summary call made by the engine; when its reply cannot
  be read, `fallback_answer` gives the vote (open) or the median span (grounding).
"""
from __future__ import annotations

import statistics
from collections import Counter
from dataclasses import dataclass, field

from m1.text import format_span, parse_span
from m1.schema import AgentAnswer


@dataclass
class VoteResult:
    answer: str | None
    counts: dict[str, int] = field(default_factory=dict)
    tie: bool = False
    tied: list[str] = field(default_factory=list)


def _valid(answers: list[AgentAnswer]) -> list[AgentAnswer]:
    return [a for a in answers if a.answer and a.answer.strip()]


def vote(answers: list[AgentAnswer], order: list[str]) -> VoteResult:
    valid = _valid(answers)
    if not valid:
        return VoteResult(None)
    counts = Counter(a.answer.strip() for a in valid)
    top = max(counts.values())
    tied = [ans for ans, c in counts.items() if c == top]
    rank = {name: i for i, name in enumerate(order)}
    first_by = {}
    for a in sorted(valid, key=lambda a: rank.get(a.agent, len(rank))):
        first_by.setdefault(a.answer.strip(), rank.get(a.agent, len(rank)))
    winner = min(tied, key=lambda ans: first_by[ans])
    return VoteResult(winner, dict(counts), tie=len(tied) > 1, tied=sorted(tied, key=lambda x: first_by[x]))


def best_score(answers: list[AgentAnswer], scores: dict[str, float | None], order: list[str]) -> str | None:
    scored = [(scores.get(a.agent), a) for a in _valid(answers) if scores.get(a.agent) is not None]
    if not scored:
        return vote(answers, order).answer
    return max(scored, key=lambda s: s[0])[1].answer.strip()


def decide_by_agent(answers: list[AgentAnswer], agent: str, order: list[str]) -> str | None:
    for a in _valid(answers):
        if a.agent == agent:
            return a.answer.strip()
    return vote(answers, order).answer


def median_span(answers: list[AgentAnswer]) -> str | None:
    spans = [s for s in (parse_span(a.answer) for a in _valid(answers)) if s]
    if not spans:
        return None
    s, e = statistics.median(x[0] for x in spans), statistics.median(x[1] for x in spans)
    return format_span((s, max(s, e)))


def fallback_answer(task: str, answers: list[AgentAnswer], order: list[str]) -> str | None:
    """The team answer when the summarizer's reply cannot be read."""
    if task == "grounding":
        return median_span(answers)
    return vote(answers, order).answer


def agreeing_reason(answers: list[AgentAnswer], final: str | None) -> str:
    """The reasons of the agents that gave the final answer, one line each."""
    return " ".join(f"{a.agent}: {a.reason.strip()}" for a in _valid(answers)
                    if a.answer.strip() == final and a.reason.strip())
