"""A served M1 team as one agent of this team: teams of teams.

An agent whose model is `interface: team` stands for a whole team behind `m1 serve`:

    models:
      panel: {interface: team, backend: openai, path: synth_teacher, base_url: "http://host:8000/v1",
              video_input: video_url, video_transport: file}   # or data: the video inlined
    agents:
      - {name: local_a, model: q3}
      - {name: panel, model: panel}

Why it answers and does nothing else: its team plans, browses, talks and votes on its own side, so what it gives
this team is exactly what a peer gives at the end of an episode, a final answer with a reason. It neither plans,
calls tools nor reads its peers' notes, and it summarizes nothing (config: it cannot be aggregation.summarizer).
Its question goes out when the batch starts planning (m1/models/served_team.py), so the served team works while
the local agents plan and browse; its reply is read at the answer phase like any agent's answer: it enters the vote
or the summarizer's notes, its reason the trace and the results row, the tokens its server counted `Episode.usage`.

A reply that cannot be read as an answer to the question (none, or not in the task's form), or a question the
server refused, is that agent's format failure (`parse_ok` false, the error as its reason): the others still
answer. A server that stops answering raises ServerUnavailable naming the agent and its URL (never its key):
m1 infer / eval write that batch's error rows (m1/team/engine.py `TeamEngine.run`), which a rerun answers again.
"""
from __future__ import annotations

import logging
from concurrent.futures import Future, ThreadPoolExecutor

from m1.agents.reading import read_value
from m1.config import TeamConfig
from m1.models.base import SamplingParams, ServerUnavailable
from m1.schema import AgentAnswer, Generation

log = logging.getLogger(__name__)


class ServedMembers:
    """The team's agents whose model is a served team: asked at `start`, answers taken in at `finish`."""

    def __init__(self, cfg: TeamConfig, hub):
        self.cfg, self.hub = cfg, hub
        self.names = set(cfg.served_teams)
        self._pending: list[tuple[str, object, list, Future]] = []

    def start(self, eps: list) -> None:
        """Send every episode's question to each served team, in the background."""
        self._pending = []
        if not self.names or not eps:
            return
        pool = ThreadPoolExecutor(max_workers=len(self.names), thread_name_prefix="m1-served-team")
        for a in self.cfg.agents:
            if a.name in self.names:
                temp = a.temperature if a.temperature is not None else self.cfg.sampling.temperature
                params = SamplingParams(max_new_tokens=self.cfg.limits.answer_tokens, temperature=temp,
                                        top_p=self.cfg.sampling.top_p, seed=self.cfg.sampling.seed)
                model = self.hub.team(a.model)
                self._pending.append((a.name, model, eps, pool.submit(model.ask, [e.question for e in eps], params)))
        pool.shutdown(wait=False)

    def finish(self, add_usage) -> None:
        """Each served team's reply as its agent's answer in every episode still going (`add_usage`: the engine's
        token counter). ServerUnavailable, naming the agent, when a server did not answer."""
        pending, self._pending = self._pending, []
        for name, model, eps, future in pending:
            try:
                replies = future.result()
            except ServerUnavailable as exc:
                raise ServerUnavailable(f"agent {name!r} (a served team): {exc}") from None
            for ep, out in zip(eps, replies):
                if ep.error is None:
                    add_usage(ep.usage, name, model, out)
                    _answer(ep, name, out)


def _answer(ep, name: str, out) -> None:
    """One reply as agent `name`'s answer of episode `ep` (the engine's _Episode)."""
    q = ep.question
    error = out.meta.get("error")
    if error is None:
        answer, _span, ok, error = read_value(out.text, q, lambda s: " ".join(s.split()))
        answer, reason = answer or "", out.meta.get("reason") or ""
        if not answer:
            ok, error = False, error or "the served team gave no answer"
        elif not ok:
            error = error or f"the answer {out.text[:40]!r} is not in the exact form for a {q.task} answer"
    else:
        answer, reason, ok = "", f"no answer from the served team: {error}", False
        log.warning("agent %r, question %s: %s", name, q.id, error)
    gen = Generation(agent=name, phase="answer", prompt=out.meta.get("prompt") or [], completion=out.text,
                     parse_ok=ok, parse_error=None if ok else error)
    ep.generations.append(gen)
    ep.agents[name].answer_gen = gen
    ep.answers.append(AgentAnswer(agent=name, answer=answer, reason=reason, parse_ok=ok))
    ep.memory.set_answer(name, answer, reason)
