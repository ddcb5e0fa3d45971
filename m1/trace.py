"""A self-contained HTML page for one episode: the question, the DAG, each agent's plan, tool
turns, decisions and answer, and the team's answer. For people; the JSON beside it is the data."""
from __future__ import annotations

import html

from m1.schema import Episode


def _e(x) -> str:
    return html.escape(str(x))


def render_html(ep: Episode) -> str:
    q = ep.question
    parts = [f"<!doctype html><meta charset='utf-8'><title>{_e(ep.id)}</title>",
             "<style>body{font:14px sans-serif;max-width:1100px;margin:auto}"
             ".agent{border:1px solid #ccc;border-radius:6px;padding:8px;margin:8px 0}"
             ".err{color:#b00}.ok{color:#070}pre{white-space:pre-wrap;background:#f6f6f6;padding:6px}</style>",
             f"<h2>{_e(ep.id)}</h2><p><b>Video</b> {_e(q.video)}<br><b>Question</b> {_e(q.text)}</p>"]
    if q.options:
        parts.append("<ol type='A'>" + "".join(f"<li>{_e(o)}</li>" for o in q.options) + "</ol>")
    if ep.error:
        parts.append(f"<p class='err'><b>Error</b> {_e(ep.error)}</p>")
    truth = f" (truth: {_e(q.answer)})" if q.answer is not None else ""
    parts.append(f"<p><b>Team answer</b> {_e(ep.final_answer)}{truth} via {_e(ep.aggregation)}<br>"
                 f"{_e(ep.final_reason)}</p>")
    edges = ", ".join(f"{a}&rarr;{b}" for a, b in ep.topology.edges) or "none"
    parts.append(f"<p><b>Active</b> {_e(', '.join(ep.topology.active))}; <b>edges</b> {edges}</p>")
    for name, rec in ep.memory.items():
        parts.append(f"<div class='agent'><h3>{_e(name)}</h3><p><b>Plan</b> "
                     f"{_e(' → '.join(rec.plan))}<br><b>Key info</b> {_e(rec.key_info)}</p><ol>")
        for t in rec.turns:
            body = f"<span class='err'>{_e(t.error)}</span>" if t.error else f"<pre>{_e(t.output)}</pre>"
            dec = f"<br>decision: {_e(t.decision.action)} {_e(t.decision.tool or '')}" if t.decision else ""
            parts.append(f"<li><b>{_e(t.tool)}</b> ({len(t.timestamps)} frames){body}{dec}</li>")
        parts.append(f"</ol><p><b>Answer</b> {_e(rec.answer)} — {_e(rec.reason)}</p>")
        gens = [g for g in ep.generations if g.agent == name]
        bad = sum(not g.parse_ok for g in gens)
        cls = "err" if bad else "ok"
        parts.append(f"<p class='{cls}'>{len(gens)} generations, {bad} unreadable</p>")
        parts.append("<details><summary>generations</summary>" + "".join(
            f"<p><b>{_e(g.phase)} #{g.step}</b> {'ok' if g.parse_ok else _e(g.parse_error)}<pre>{_e(g.completion)}</pre></p>"
            for g in gens) + "</details></div>")
    return "\n".join(parts)
