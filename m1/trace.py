"""Trace pages a person reads: one self-contained HTML page per episode (the run's index is `m1.trace_index`).

A page holds everything needed to see why the team answered as it did: the question and truth, the
votes and the aggregation, the communication DAG (inline SVG), and per agent its plan and revisions, a
timeline of the video with a mark wherever a tool looked, thumbnails of those frames with their times,
the tool results, what it read of its peers, its answer, and its model calls. Pages carry no external
resources (CSS, JS and JPEG thumbnails are inline), so a trace folder can be mailed or opened offline.
The JSON written beside each page is the data; the index (`index.html`, which each page links back to) is rebuilt
from those JSONs.

Everything that comes from a model or a question is escaped: traces hold arbitrary model output.
"""
from __future__ import annotations

import base64
import html
import io
import json
import math
from pathlib import Path

from m1.data.metrics import is_correct
from m1.memory.buffer import render_record
from m1.schema import LETTERS, AgentRecord, Episode, Turn
from m1.text import parse_span
from m1.video import VideoReader, time_to_index

THUMB_WIDTH = 96  # px; small enough that a page of 4 agents x 4 turns stays a few hundred KB
MAX_THUMBS = 16  # per tool turn; a turn that read more frames shows this many, evenly spread
JPEG_QUALITY = 70
INDEX_NAME = "index.html"  # the run's index (m1/trace_index.py), which every page links back to


def _e(x) -> str:
    return html.escape("" if x is None else str(x))


TRACE_STEM_MAX = 120  # bytes (UTF-8) kept of a long id's name; names have 255 bytes, and the hash keeps it unique


def trace_name(episode_id: str) -> str:
    """The file stem of an episode's trace files, one per id: an id that is already a plain file name is kept as it
    is; one with other characters ('/', ':', a space, an unpaired surrogate), a leading dot (a hidden file the index
    would skip) or past TRACE_STEM_MAX bytes is cleaned, cut to that many bytes (a letter of another script is 2-4
    bytes: the file system's limit is in bytes) and gets a short hash of the raw id, so `clip 1` and `clip_1` never
    share a file."""
    import hashlib

    safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in episode_id)
    if safe.startswith("."):
        safe = "_" + safe[1:]
    if safe == episode_id and len(safe.encode()) <= TRACE_STEM_MAX:
        return safe
    cut = safe.encode()[:TRACE_STEM_MAX].decode("utf-8", errors="ignore")  # never half a letter
    return f"{cut}-{hashlib.sha1(episode_id.encode('utf-8', 'surrogatepass')).hexdigest()[:10]}"


def clock(t: float) -> str:
    """'mm:ss.ss': tools sample frames a fraction of a second apart, so whole seconds would hide that."""
    m, s = divmod(max(float(t), 0.0), 60.0)
    return f"{int(m):02d}:{s:05.2f}"


def family_of(ep: Episode) -> str:
    return str(ep.question.meta.get("family") or ep.question.task)


def _correct(ep: Episode, answer) -> bool | None:
    """Right or wrong against the truth; None when the question has no truth."""
    if ep.question.answer is None:
        return None

    return bool(is_correct(ep.question, answer))


# ------------------------------------------------------------------ frames


def spread(items: list, n: int) -> list:
    """At most n items, evenly spread over the list, first and last included."""
    if len(items) <= n:
        return list(items)
    if n == 1:
        return [items[0]]
    return [items[round(k * (len(items) - 1) / (n - 1))] for k in range(n)]


class Thumbnails:
    """JPEG thumbnails of an episode's video as data: URIs, one encode per frame.

    Frames come from the run's VideoPool when given (the tools decoded them already, so they are in its
    cache); otherwise the video is opened here and closed again. A video that cannot be read leaves
    `note` set and every lookup empty: the page is still written, without thumbnails."""

    def __init__(self, video: str, pool=None, width: int = THUMB_WIDTH):
        self.width, self.reader, self.note, self.duration = width, None, None, None
        self._own = pool is None
        self._uris: dict[int, str] = {}
        self._shown: set[int] = set()  # frames already inlined on the page
        try:
            self.reader = pool.open(video) if pool is not None else VideoReader(video)
            self.duration = self.reader.info.duration
        except Exception as exc:  # any failure to open only costs the thumbnails, never the trace
            self.note = f"no thumbnails: {exc}"

    def index(self, t: float) -> int | None:
        if self.reader is None or not math.isfinite(t):
            return None
        return time_to_index(self.reader.info, t)

    def load(self, times: list[float]) -> None:
        """Decode and encode the frames at `times` in one batch (sorted, so decoding only goes forward)."""
        if self.reader is None:
            return
        wanted = sorted({i for i in map(self.index, times) if i is not None} - self._uris.keys())
        if not wanted:
            return
        try:
            frames = self.reader.frames(wanted)
            for i, frame in zip(wanted, frames):
                self._uris[i] = self._encode(frame)
        except Exception as exc:  # a frame that will not decode: the page says so instead of failing
            self.note = f"thumbnails incomplete: {exc}"

    def _encode(self, frame) -> str:
        from PIL import Image

        img = Image.fromarray(frame)
        h = max(1, round(img.height * self.width / img.width))
        img = img.resize((self.width, h), Image.BILINEAR)
        buf = io.BytesIO()
        img.save(buf, "JPEG", quality=JPEG_QUALITY, optimize=True)
        return "data:image/jpeg;base64," + base64.b64encode(buf.getvalue()).decode("ascii")

    def uri(self, t: float) -> str | None:
        i = self.index(t)
        return self._uris.get(i) if i is not None else None

    def img(self, t: float) -> str | None:
        """An <img> of the frame at t. A frame already on the page is not inlined again (agents often look
        at the same frames): it names the first copy in `data-same`, and the page's script copies its src."""
        i, uri = self.index(t), self.uri(t)
        if uri is None:
            return None
        alt = f"frame at {clock(t)}"
        if i in self._shown:
            return f"<img data-same='f{i}' alt='{_e(alt)}' width='{self.width}'>"
        self._shown.add(i)
        return f"<img data-f='f{i}' src='{uri}' alt='{_e(alt)}' width='{self.width}'>"

    def close(self) -> None:
        if self._own and self.reader is not None:
            self.reader.close()


# ------------------------------------------------------------------ what an agent read of its peers


def _record_at(rec: AgentRecord, step: int | None) -> AgentRecord:
    """`rec` as a peer could read it while deciding after tool step `step` (None: while answering).

    Agents run one tool per round in lockstep, so an agent's step k is round k; in round k the peers' turns
    up to k are in memory, their decisions of round k and all answers are not yet (each phase writes
    memory after all of its model calls)."""
    if step is None:
        return rec.model_copy(update={"answer": None, "reason": None})
    turns = [t.model_copy(update={"decision": None}) if t.step == step else t for t in rec.turns if t.step <= step]
    key_info = rec.turns[0].key_info if rec.turns else rec.key_info
    for t in rec.turns:
        if t.step < step and t.decision and t.decision.action == "add_tool" and t.decision.key_info:
            key_info = t.decision.key_info
    return rec.model_copy(update={"turns": turns, "key_info": key_info, "answer": None, "reason": None})


def peer_views(ep: Episode, agent: str) -> list[tuple[str, int | None, str]]:
    """What `agent` read of its peers, as (label, step, text): once per communication step and once
    before answering, rebuilt with the same `render_record` the team used for its prompts."""
    visible = [p for p in ep.topology.visible_to(agent) if p != agent and p in ep.memory]
    steps = sorted({g.step for g in ep.generations if g.agent == agent and g.phase == "communicate"})
    moments: list[tuple[str, int | None]] = [(f"deciding after step {s}", s) for s in steps]
    if any(g.agent == agent and g.phase == "answer" for g in ep.generations):
        moments.append(("answering", None))
    return [(label, step, "\n".join(render_record(p, _record_at(ep.memory[p], step)) for p in visible))
            for label, step in moments]


# ------------------------------------------------------------------ SVG pieces

_PALETTE = ["#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#17becf", "#8c564b", "#e377c2", "#7f7f7f"]


def _tool_colour(tool: str, tools: list[str]) -> str:
    return _PALETTE[tools.index(tool) % len(_PALETTE)] if tool in tools else "#555"


def dag_svg(ep: Episode) -> str:
    """The communication DAG: agents on an ellipse, an arrow a -> b where b reads a's memory.
    Node colour: green right, red wrong (against the truth), grey dropped from the DAG."""
    agents = list(ep.topology.agents) or list(ep.memory)
    active = set(ep.topology.active)
    answers = {a.agent: a.answer for a in ep.answers}
    w, h, nw, nh = 560, 300, 124, 40
    cx, cy, rx, ry = w / 2, h / 2, w / 2 - nw / 2 - 10, h / 2 - nh / 2 - 12
    pos = {}
    for i, a in enumerate(agents):
        ang = -math.pi / 2 + 2 * math.pi * i / max(1, len(agents))
        pos[a] = (cx + rx * math.cos(ang), cy + ry * math.sin(ang)) if len(agents) > 1 else (cx, cy)
    out = [f"<svg class='dag' viewBox='0 0 {w} {h}' width='{w}' height='{h}' role='img' "
           f"aria-label='communication graph'><defs>"
           "<marker id='arrow' viewBox='0 0 10 10' refX='9' refY='5' markerWidth='7' markerHeight='7' "
           "orient='auto-start-reverse'><path d='M0,0 L10,5 L0,10 z' fill='#444'/></marker>"
           "<marker id='arrow-off' viewBox='0 0 10 10' refX='9' refY='5' markerWidth='7' markerHeight='7' "
           "orient='auto-start-reverse'><path d='M0,0 L10,5 L0,10 z' fill='#bbb'/></marker></defs>"]
    edges = set(map(tuple, ep.topology.edges))

    def clip(x0, y0, x1, y1):  # the point where the segment (x0,y0)->(x1,y1) leaves the node box at (x1,y1)
        dx, dy = x0 - x1, y0 - y1
        t = min((nw / 2 + 3) / abs(dx) if dx else math.inf, (nh / 2 + 3) / abs(dy) if dy else math.inf)
        return x1 + dx * t, y1 + dy * t

    for a, b in ep.topology.edges:
        if a not in pos or b not in pos or a == b:
            continue
        (x0, y0), (x1, y1) = pos[a], pos[b]
        if (b, a) in edges:  # both directions: offset each arrow to its own side
            L = math.hypot(x1 - x0, y1 - y0) or 1
            ox, oy = -(y1 - y0) / L * 5, (x1 - x0) / L * 5
            x0, y0, x1, y1 = x0 + ox, y0 + oy, x1 + ox, y1 + oy
        sx, sy = clip(x1, y1, x0, y0)
        ex, ey = clip(x0, y0, x1, y1)
        on = a in active and b in active
        out.append(f"<line class='edge{'' if on else ' off'}' data-from='{_e(a)}' data-to='{_e(b)}' "
                   f"x1='{sx:.1f}' y1='{sy:.1f}' x2='{ex:.1f}' y2='{ey:.1f}' stroke='{'#444' if on else '#bbb'}' "
                   f"stroke-width='1.4' marker-end='url(#{'arrow' if on else 'arrow-off'})'>"
                   f"<title>{_e(b)} reads {_e(a)}</title></line>")
    for a in agents:
        x, y = pos[a]
        ok = _correct(ep, answers.get(a)) if a in answers else None
        dropped = a not in active
        fill = "#eee" if dropped else {True: "#d8f3d8", False: "#f8d7d7", None: "#fff"}[ok]
        stroke = "#aaa" if dropped else "#333"
        label = f"answer {answers[a]}" if answers.get(a) else "no answer"
        dash = " stroke-dasharray='4 3'" if dropped else ""
        out.append(f"<g class='node{' dropped' if dropped else ''}' data-agent='{_e(a)}'>"
                   f"<title>{_e(a)}{' (dropped)' if dropped else ''}: {_e(label)}</title>"
                   f"<rect x='{x - nw / 2:.1f}' y='{y - nh / 2:.1f}' width='{nw}' height='{nh}' rx='8' "
                   f"fill='{fill}' stroke='{stroke}'{dash}/>"
                   f"<text x='{x:.1f}' y='{y - 3:.1f}' text-anchor='middle' font-size='12' font-weight='bold' "
                   f"fill='{'#999' if dropped else '#111'}'>{_e(a)}</text>"
                   f"<text x='{x:.1f}' y='{y + 12:.1f}' text-anchor='middle' font-size='11' "
                   f"fill='{'#999' if dropped else '#333'}'>{_e(label if not dropped else 'dropped · ' + label)}"
                   f"</text></g>")
    out.append("</svg>")
    return "".join(out)


def timeline_svg(rows: list[tuple[str, str, list[float], tuple[float, float] | None]], duration: float,
                 truth_span: tuple[float, float] | None = None) -> str:
    """A bar over the video's duration per row (label, colour, times looked at, span reported), with a
    mark at every time a tool looked and the reported span shaded."""
    w, left, right, rh = 900, 170, 24, 18
    span_w = w - left - right
    h = 22 + rh * max(1, len(rows))
    dur = duration if duration and duration > 0 else 1.0

    def x(t: float) -> float:
        return left + span_w * min(max(t, 0.0), dur) / dur

    out = [f"<svg class='timeline' viewBox='0 0 {w} {h}' width='100%' data-duration='{dur:.3f}' role='img' "
           f"aria-label='timeline of the video'>"]
    step = next((s for s in (1, 2, 5, 10, 15, 30, 60, 120, 300, 600, 900, 1800, 3600) if dur / s <= 10), 7200)
    t = 0.0
    while t <= dur + 1e-9:
        out.append(f"<line x1='{x(t):.1f}' y1='{h - 16}' x2='{x(t):.1f}' y2='{h - 12}' stroke='#999'/>"
                   f"<text x='{x(t):.1f}' y='{h - 2}' font-size='10' text-anchor='middle' fill='#666'>"
                   f"{_e(clock(t)[:5])}</text>")
        t += step
    if truth_span:
        tw = max(2, x(truth_span[1]) - x(truth_span[0]))
        out.append(f"<rect class='truth' x='{x(truth_span[0]):.1f}' y='2' width='{tw:.1f}' "
                   f"height='{h - 20}' fill='#2ca02c' opacity='0.15'><title>truth {_e(clock(truth_span[0]))}"
                   f"-{_e(clock(truth_span[1]))}</title></rect>")
    for r, (label, colour, times, span) in enumerate(rows):
        y = 4 + r * rh
        out.append(f"<text x='{left - 6}' y='{y + 11}' font-size='11' text-anchor='end' fill='#333'>{_e(label)}</text>"
                   f"<rect x='{left}' y='{y + 3}' width='{span_w}' height='{rh - 8}' fill='#f0f0f0'/>")
        if span:
            out.append(f"<rect class='span' x='{x(span[0]):.1f}' y='{y + 1}' "
                       f"width='{max(2, x(span[1]) - x(span[0])):.1f}' height='{rh - 4}' fill='{colour}' "
                       f"opacity='0.25'><title>span {_e(clock(span[0]))}-{_e(clock(span[1]))}</title></rect>")
        for t in times:
            out.append(f"<rect class='mark' data-t='{t:.3f}' x='{x(t) - 1:.1f}' y='{y + 1}' width='2' "
                       f"height='{rh - 4}' fill='{colour}'><title>{_e(clock(t))}</title></rect>")
    out.append("</svg>")
    return "".join(out)


# ------------------------------------------------------------------ the episode page

_CSS = """
body{font:14px/1.4 system-ui,sans-serif;max-width:1180px;margin:0 auto;padding:12px 16px;color:#222}
h1{font-size:20px;margin:4px 0}h2{font-size:17px;margin:18px 0 6px}h3{font-size:15px;margin:4px 0}
a{color:#1a5fb4}.muted{color:#777}.err{color:#b00020}.ok{color:#1a7f37}.bad{color:#b00020}
.note{background:#fff4ce;border:1px solid #e0c060;padding:6px 10px;border-radius:4px}
.box{border:1px solid #ccc;border-radius:6px;padding:8px 12px;margin:10px 0}
.agent.dropped{border-style:dashed;background:#fafafa}
.banner{font-size:16px;padding:8px 12px;border-radius:6px;margin:8px 0}
.banner.right{background:#e3f6e3}.banner.wrong{background:#fbe3e3}.banner.none{background:#eef}
ol.opts li.truth{font-weight:bold;color:#1a7f37}ol.opts li.team{text-decoration:underline}
table{border-collapse:collapse}td,th{border:1px solid #ddd;padding:2px 8px;text-align:left;vertical-align:top}
.chip{display:inline-block;border-radius:10px;padding:0 8px;margin:1px 2px;color:#fff;font-size:12px}
pre{white-space:pre-wrap;word-break:break-word;background:#f6f6f6;padding:6px;margin:4px 0;font-size:12px}
.thumbs{display:flex;flex-wrap:wrap;gap:4px;margin:4px 0}
.thumbs figure{margin:0;text-align:center;font-size:10px;color:#555}
.thumbs img{display:block;border:1px solid #ccc;width:96px}
.turn{border-left:3px solid #ccc;padding-left:8px;margin:8px 0}
.top{display:flex;gap:16px;flex-wrap:wrap;align-items:flex-start}
details>summary{cursor:pointer;color:#1a5fb4}
.credit{font-weight:bold;color:#333}.advantage.pos{color:#1a7f37}.advantage.neg{color:#b00020}
"""


def _options_html(ep: Episode) -> str:
    q = ep.question
    if not q.options:
        return ""
    truth = q.answer.strip().upper() if q.task == "mcq" and q.answer else None
    team = (ep.final_answer or "").strip().upper()[:1] if q.task == "mcq" else None
    items = []
    for i, o in enumerate(q.options):
        cls = " ".join(c for c, on in (("truth", LETTERS[i] == truth), ("team", LETTERS[i] == team)) if on)
        items.append(f"<li class='{cls}'>{_e(o)}</li>")
    return "<ol class='opts' type='A'>" + "".join(items) + "</ol>"


def _truth_span(ep: Episode):
    if ep.question.task != "grounding" or not ep.question.answer:
        return None

    return parse_span(ep.question.answer)


def render_html(ep: Episode, pool=None) -> str:
    """The page of one episode. `pool`: the run's VideoPool, to reuse its decoded frames."""
    q = ep.question
    thumbs = Thumbnails(q.video, pool)
    try:
        shown: dict[tuple[str, int], list[float]] = {}
        for name, rec in ep.memory.items():
            for k, t in enumerate(rec.turns):
                shown[(name, k)] = spread(sorted(set(t.timestamps)), MAX_THUMBS)
        thumbs.load([t for ts in shown.values() for t in ts])
        return _page(ep, thumbs, shown)
    finally:
        thumbs.close()


def _page(ep: Episode, thumbs: Thumbnails, shown: dict) -> str:
    q = ep.question
    all_times = [t for rec in ep.memory.values() for turn in rec.turns for t in turn.timestamps]
    duration = thumbs.duration or q.meta.get("duration") or (max(all_times) * 1.05 if all_times else 0.0)
    ok = _correct(ep, ep.final_answer)
    tools = list(dict.fromkeys(t.tool for rec in ep.memory.values() for t in rec.turns))
    p = [f"<!doctype html><html lang='en'><head><meta charset='utf-8'><title>{_e(ep.id)} · M1 trace</title>"
         f"<meta name='viewport' content='width=device-width'><style>{_CSS}</style></head><body>",
         f"<p><a href='{INDEX_NAME}'>&larr; all questions</a></p>",
         f"<h1>{_e(ep.id)}</h1>",
         f"<p><b>Question</b> <span class='qtext'>{_e(q.text)}</span><br><span class='muted'>{_e(q.task)} · "
         f"family {_e(family_of(ep))} · video <span title='{_e(q.video)}'>{_e(Path(q.video).name)}</span>"
         + (f" · {duration:.1f}s" if duration else "") + "</span></p>",
         _options_html(ep)]
    if ep.error:
        p.append(f"<p class='note err'><b>Error</b> {_e(ep.error)}</p>")
    verdict = {True: ("right", "✓ right"), False: ("wrong", "✗ wrong"), None: ("none", "no truth")}[ok]
    p.append(f"<div class='banner {verdict[0]}'><b>Team answer</b> <span class='team-answer'>{_e(ep.final_answer)}"
             f"</span>{'(none)' if ep.final_answer is None else ''} · <b>truth</b> "
             f"<span class='truth'>{_e(q.answer)}</span> · {verdict[1]}"
             f" · aggregation <b>{_e(ep.aggregation)}</b><br><span class='muted'>{_e(ep.final_reason)}</span></div>")
    if thumbs.note:
        p.append(f"<p class='note thumbs-note'>{_e(thumbs.note)}</p>")
    # votes + DAG side by side
    rows = []
    for a in ep.answers:
        c = _correct(ep, a.answer)
        mark = "" if c is None else ("<span class='ok'>✓</span>" if c else "<span class='bad'>✗</span>")
        rows.append(f"<tr class='vote' data-agent='{_e(a.agent)}'><td><a href='#agent-{_e(trace_name(a.agent))}'>"
                    f"{_e(a.agent)}</a></td><td><span class='vote-answer'>{_e(a.answer)}</span> {mark}</td>"
                    f"<td>{'' if a.parse_ok else '<span class=err>unreadable reply</span>'}</td>"
                    f"<td>{_e(a.reason)}</td></tr>")
    p.append("<div class='top'><div><h2>Votes</h2><table><tr><th>agent</th><th>answer</th><th>format</th>"
             "<th>reason</th></tr>" + "".join(rows) + "</table>"
             f"<p class='muted'>{ep.frames_used} distinct frames used · "
             + " · ".join(f"{k} {v:.2f}s" for k, v in ep.timings.items() if k in ("llm", "vision", "tools", "decode"))
             + "</p></div>"
             f"<div><h2>Communication</h2>{dag_svg(ep)}<div class='muted'>arrow a&rarr;b: b reads a's memory; "
             "dashed grey: dropped from the graph</div></div></div>")
    # the whole team on one timeline
    team_rows = []
    for name, rec in ep.memory.items():
        times = sorted({t for turn in rec.turns for t in turn.timestamps})
        team_rows.append((name, "#444" if name in ep.topology.active else "#aaa", times, None))
    p.append("<h2>Where the team looked</h2>" + timeline_svg(team_rows, duration, _truth_span(ep)))
    for name, rec in ep.memory.items():
        p.append(_agent_html(ep, name, rec, thumbs, shown, duration, tools))
    p.append(f"<script>{_PAGE_JS}</script></body></html>")
    return "\n".join(p)


# fills the thumbnails of frames shown earlier on the page (see Thumbnails.img)
_PAGE_JS = ("[].forEach.call(document.querySelectorAll('img[data-same]'),function(i){"
            "var s=document.querySelector('img[data-f=\"'+i.dataset.same+'\"]');if(s)i.src=s.src;});")


def _agent_html(ep: Episode, name: str, rec: AgentRecord, thumbs: Thumbnails, shown: dict, duration: float,
                tools: list[str]) -> str:
    """One agent's section: its plan and revisions, its tool turns (on a timeline, with their frames), what it read
    of its peers, its answer and its model calls."""
    dropped = name not in ep.topology.active
    c = _correct(ep, rec.answer)
    mark = "" if c is None else (" <span class='ok'>✓</span>" if c else " <span class='bad'>✗</span>")
    p = [f"<section class='box agent{' dropped' if dropped else ''}' id='agent-{_e(trace_name(name))}' "
         f"data-agent='{_e(name)}'><h2>{_e(name)}"
         + (" <span class='muted'>(dropped from the graph: works alone)</span>" if dropped else "") + "</h2>",
         _plan_html(rec, tools)]
    rows = [(f"{t.step}. {t.tool}", _tool_colour(t.tool, tools), list(t.timestamps), t.span) for t in rec.turns]
    if rows:
        p.append(timeline_svg(rows, duration, _truth_span(ep)))
    p += [_turn_html(t, thumbs, shown.get((name, k), []), tools) for k, t in enumerate(rec.turns)]
    p.append(_peers_html(ep, name))
    p.append(f"<p><b>Answer</b> <span class='agent-answer'>{_e(rec.answer)}</span>{mark}"
             f" — {_e(rec.reason)}</p>")
    p.append(_calls_html(ep, name) + "</section>")
    return "".join(p)


def _plan_html(rec: AgentRecord, tools: list[str]) -> str:
    """The agent's plan as tool chips, what it looked for, and how it revised the plan."""
    chips = "".join(f"<span class='chip plan-tool' style='background:{_tool_colour(t, tools)}'>{_e(t)}</span>"
                    for t in rec.plan) or "<span class='muted'>(no plan)</span>"
    plan_key = rec.turns[0].key_info if rec.turns else rec.key_info
    p = [f"<p><b>Plan</b> {chips}<br><b>Key info</b> {_e(plan_key)}</p>"]
    revisions = [(t.step, t.decision) for t in rec.turns if t.decision and t.decision.action != "continue"]
    if revisions:
        p.append("<p><b>Revisions</b></p><ul class='revisions'>" + "".join(
            f"<li>after step {s}: {'add tool <b>' + _e(d.tool) + '</b>' if d.action == 'add_tool' else _e(d.action)}"
            + (f" — looking for {_e(d.key_info)}" if d.key_info else "") + "</li>" for s, d in revisions) + "</ul>")
    else:
        p.append("<p class='muted'>No revisions: the plan ran as written.</p>")
    return "".join(p)


def _turn_html(t: Turn, thumbs: Thumbnails, times: list[float], tools: list[str]) -> str:
    """One tool turn: what it looked for, the frames it read (`times`: those shown), its output and the decision
    after it."""
    p = [f"<div class='turn' style='border-color:{_tool_colour(t.tool, tools)}'>"
         f"<h3>Step {t.step}: {_e(t.tool)}</h3>"
         f"<div class='muted'>looking for: {_e(t.key_info)} · {len(t.timestamps)} frames"
         + (f" from {_e(clock(min(t.timestamps)))} to {_e(clock(max(t.timestamps)))}" if t.timestamps else "")
         + (f" · span {_e(clock(t.span[0]))}-{_e(clock(t.span[1]))}" if t.span else "")
         + (f" · answer <b>{_e(t.answer)}</b>" if t.answer else "") + "</div>"]
    figs = []
    for ts in times:
        img = thumbs.img(ts)
        if img:
            figs.append(f"<figure>{img}<figcaption class='ts'>{_e(clock(ts))}</figcaption></figure>")
    if figs:
        n = len(set(t.timestamps))
        p.append("<div class='thumbs'>" + "".join(figs) + "</div>"
                 + (f"<div class='muted'>{len(figs)} of {n} frames shown</div>" if n > len(figs) else ""))
    p.append(f"<p class='err'>{_e(t.error)}</p>" if t.error else f"<pre class='output'>{_e(t.output)}</pre>")
    if t.decision:
        d = t.decision
        p.append(f"<div class='muted'>decision: {_e(d.action)}" + (f" {_e(d.tool)}" if d.tool else "")
                 + (f" — {_e(d.key_info)}" if d.key_info else "") + "</div>")
    p.append("</div>")
    return "".join(p)


def _peers_html(ep: Episode, name: str) -> str:
    """Whom the agent reads, and what it read of them at each moment it decided or answered."""
    visible = [x for x in ep.topology.visible_to(name) if x != name]
    views = peer_views(ep, name)
    p = [f"<h3>What it read of its peers</h3><p class='muted'>reads: {_e(', '.join(visible) or 'nobody')}</p>"]
    if not views:
        p.append("<p class='muted'>(no model calls: nothing read)</p>")
    for i, (label, step, text) in enumerate(views):
        open_ = " open" if i == len(views) - 1 else ""
        p.append(f"<details class='peers'{open_} data-step='{'' if step is None else step}'>"
                 f"<summary>{_e(label)}</summary>"
                 f"<pre>{_e(text) or 'No output from other agents is visible to it.'}</pre></details>")
    return "".join(p)


def _calls_html(ep: Episode, name: str) -> str:
    """The agent's model calls, each with its prompt, completion, whether it was read, and its training credit."""
    gens = [g for g in ep.generations if g.agent == name]
    bad = sum(not g.parse_ok for g in gens)
    items = []
    for g in gens:
        prompt = "".join(f"<div class='muted'>{_e(m.get('role', '?'))}</div><pre>{_e(_content(m.get('content')))}</pre>"
                         for m in g.prompt)
        status = ("<span class='ok'>read</span>" if g.parse_ok else
                  f"<span class='err'>unreadable: {_e(g.parse_error)}</span>")
        items.append(f"<details class='gen'><summary>{_e(g.phase)} · step {g.step} · "
                     f"{status}{_credit_html(g.credit)}</summary>"
                     f"<b>prompt</b>{prompt}<b>completion</b>"
                     f"<pre class='completion'>{_e(g.completion)}</pre></details>")
    return (f"<details class='gens'{' open' if any(g.credit for g in gens) else ''}><summary>{len(gens)} model "
            f"calls, {bad} unreadable</summary>" + "".join(items) + "</details>")


def _credit_html(credit: dict | None) -> str:
    """A training sample's reward and advantage beside its generation (nothing on an inference trace)."""
    if not credit:
        return ""
    adv = credit.get("advantage")
    sign = "" if adv is None or (isinstance(adv, float) and math.isnan(adv)) else ("pos" if adv > 0 else
                                                                                 "neg" if adv < 0 else "zero")
    named = " · ".join(f"{k} {_num(v) if isinstance(v, float) else v}" for k, v in (credit.get("parts") or {}).items()
                       if k != "agent")
    parts = [f" · <span class='credit reward' title='{_e(named)}'>reward {_num(credit.get('reward'))}</span>",
             f" · <span class='credit advantage {sign}'>advantage {_num(adv, signed=True)}</span>"]
    if not credit.get("trained", True):
        parts.append(" · <span class='muted not-trained'>not trained on</span>")
    return "".join(parts)


def _num(x, signed: bool = False) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "–"
    return f"{x:+.3f}" if signed else f"{x:.3f}"


def _content(content) -> str:
    """A chat message's content as text; images in multimodal content are named, not inlined."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "\n".join(c.get("text", f"[{c.get('type', 'part')}]") if isinstance(c, dict) else str(c)
                         for c in content)
    return json.dumps(content, ensure_ascii=False)
