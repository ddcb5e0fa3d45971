"""A policy agent: a name, the chat model it runs on, and what it asks and reads in each phase.

The agent holds no model: the engine batches every agent's request per model and hands the
replies back here to be parsed. Parsers never raise; a reply that cannot be read is recorded
as a format failure and a safe fallback is used.
"""
from __future__ import annotations

from m1.agents import parsers, prompts
from m1.config import AgentSpec
from m1.schema import Question


class PolicyAgent:
    def __init__(self, spec: AgentSpec, tools: list[str]):
        self.name, self.model, self.temperature = spec.name, spec.model, spec.temperature
        self.tools = list(tools)

    def plan_messages(self, q: Question) -> list[dict]:
        return prompts.plan_messages(q, self.tools)

    def read_plan(self, text: str, q: Question) -> parsers.PlanParse:
        return parsers.parse_plan(text, self.tools, question=q)

    def communicate_messages(self, q: Question, own: str, peers: str, remaining: list[str],
                             next_tool: str | None) -> list[dict]:
        return prompts.communicate_messages(q, own, peers, remaining, next_tool, self.tools)

    def read_decision(self, text: str) -> parsers.DecisionParse:
        return parsers.parse_decision(text, self.tools)

    def answer_messages(self, q: Question, memory: str) -> list[dict]:
        return prompts.answer_messages(q, memory)

    def read_answer(self, text: str, q: Question) -> parsers.AnswerParse:
        return parsers.parse_answer(text, q)

    def summary_messages(self, q: Question, answers: list[tuple[str, str, str]]) -> list[dict]:
        return prompts.summary_messages(q, answers)

    def read_summary(self, text: str, q: Question) -> parsers.AnswerParse:
        return parsers.parse_summary(text, q)
