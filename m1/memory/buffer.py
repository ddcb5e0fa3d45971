"""Shared key-value memory: one record per agent, and views limited to the peers an agent may see."""
from __future__ import annotations

import json

from m1.text import format_time
from m1.schema import AgentRecord, Decision, Plan, Turn


def render_record(name: str, rec: AgentRecord, max_output_chars: int = 600) -> str:
    """The text form of one agent's record, as peers (and the agent itself) read it."""
    lines = [f"[{name}] plan: {', '.join(f'<{t}>' for t in rec.plan) or '(none yet)'}"]
    if rec.key_info:
        lines.append(f"[{name}] key info: {rec.key_info}")
    for t in rec.turns:
        head = f"[{name}] step {t.step}: {t.tool}"
        if t.timestamps:
            head += f" (frames {format_time(t.timestamps[0])}-{format_time(t.timestamps[-1])}, n={len(t.timestamps)})"
        if t.answer:
            head += f" answer: {t.answer}"
        body = f"error: {t.error}" if t.error else " / ".join(x.strip() for x in t.output.splitlines() if x.strip())
        lines.append(f"{head} -> {body[:max_output_chars]}")
        if t.decision and t.decision.action == "add_tool":
            lines.append(f"[{name}] added tool <{t.decision.tool}> for: {t.decision.key_info or ''}")
    if rec.answer is not None:
        lines.append(f"[{name}] answer: {rec.answer}; reason: {rec.reason or ''}")
    return "\n".join(lines)


class SharedMemory:
    """`{agent: AgentRecord}` written by each agent, read by peers through `view`."""

    def __init__(self, agents: list[str]):
        self.records: dict[str, AgentRecord] = {a: AgentRecord() for a in agents}

    def __getitem__(self, agent: str) -> AgentRecord:
        return self.records[agent]

    def set_plan(self, agent: str, plan: Plan) -> None:
        rec = self.records[agent]
        rec.plan, rec.key_info = list(plan.tools), plan.key_info

    def add_turn(self, agent: str, turn: Turn) -> None:
        self.records[agent].turns.append(turn)

    def set_decision(self, agent: str, decision: Decision) -> None:
        rec = self.records[agent]
        if rec.turns:
            rec.turns[-1].decision = decision
        if decision.action == "add_tool" and decision.key_info:
            rec.key_info = decision.key_info

    def set_answer(self, agent: str, answer: str, reason: str) -> None:
        self.records[agent].answer, self.records[agent].reason = answer, reason

    def render(self, agent: str) -> str:
        return render_record(agent, self.records[agent])

    def view(self, agent: str, visible: list[str], leave_out: int = 0) -> str:
        """What `agent` may read of its peers: only the records named in `visible`.

        `leave_out` (a prompt budget, m1/team/budget.py): the peers' oldest tool turns are left out, that many, oldest
        step first (peers in `visible` order within a step), and one line says so; past `peer_turns`, the peers'
        notes are left out whole."""
        peers = [p for p in visible if p != agent and p in self.records]
        if leave_out <= 0:
            return "\n".join(render_record(p, self.records[p]) for p in peers)
        if leave_out > self.peer_turns(agent, visible) or not peers:
            return f"(all notes of the {len(peers)} other agent(s) left out to fit the prompt budget)" if peers else ""
        by_age = sorted(((t.step, i, p, j) for i, p in enumerate(peers)
                         for j, t in enumerate(self.records[p].turns)))
        dropped = {(p, j) for _, _, p, j in by_age[:leave_out]}
        lines = [f"({leave_out} oldest tool output(s) of other agents left out to fit the prompt budget)"]
        for p in peers:
            rec = self.records[p]
            kept = [t for j, t in enumerate(rec.turns) if (p, j) not in dropped]
            lines.append(render_record(p, rec.model_copy(update={"turns": kept})))
        return "\n".join(lines)

    def peer_turns(self, agent: str, visible: list[str]) -> int:
        """How many tool turns of its peers `agent` reads (what `view(leave_out=...)` can trim one by one)."""
        return sum(len(self.records[p].turns) for p in visible if p != agent and p in self.records)

    def to_dict(self) -> dict[str, AgentRecord]:
        return {k: v.model_copy(deep=True) for k, v in self.records.items()}

    def to_json(self) -> str:
        return json.dumps({k: v.model_dump(mode="json") for k, v in self.records.items()})

    @classmethod
    def from_json(cls, text: str) -> SharedMemory:
        data = json.loads(text)
        mem = cls(list(data))
        mem.records = {k: AgentRecord.model_validate(v) for k, v in data.items()}
        return mem
