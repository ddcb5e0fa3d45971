"""Rule-based policies of the seed kinds on M1-Synth: what the teacher is to CPP, for Weaver, VideoZoomer and SAGE.

Each reads only its chat (never the world script): the system prompt (which kind, which tools are offered), the
question block, the tool observations, and the pixels of every frame in the chat, which it reads with the synth
vision model's pixel reader (m1/synth/vision.py) as a VLM policy would look at them. It answers in the kind's
syntax, so its replies go through the same parsers as a real model's:

- weaver: grounds the question's object in time (temporal_grounding), trims or tracks there, counts with
  temporal_count, picks a frame for background questions, then answers from everything it has seen;
- zoomer: reads its 64-frame glance, zooms (<= 16 frames, 2 fps) where the question's object was seen or at the
  stated time, refines both ends for grounding, widens a zoom once when it still cannot see (self-refine), then
  answers; counting it answers from the glance;
- sage: answers at once when the glance shows what the question needs (any-horizon); otherwise grounds the
  event, extracts frames around it and answers.

Where a rule reads its chat's text (a stated time, the video's length, the span a tool reported), `write` says where
(m1/evidence.py ChatEvidence, for SFT's attention loss); what it reads off pixels is not text and cites nothing.

`TeacherChatModel` (backend `synth`) hands a seed-kind chat to `write` here, so a config names these policies the
way it names the teacher: `{kind: chat, backend: synth}`.
"""
from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from m1.evidence import ChatEvidence, ReplyBuilder
from m1.models.base import SamplingParams, part_starts
from m1.registry import SAGE, WEAVER, ZOOMER
from m1.synth.vision import _Answerer
from m1.synth.world import COLOURS, SHAPES

_OBJ = re.compile(r"\b(?:the|a|an) (" + "|".join(COLOURS) + r") (" + "|".join(SHAPES) + r")\b")
_TIME = re.compile(r"\b(\d{1,2}):(\d{2})\b")


# kind -> what its system prompt (m1/kinds/prompts.py) holds, tried in this order
MARKS = ((SAGE, ("<json>", "final_answer")), (ZOOMER, ("<think></think>", "glance")),
         (WEAVER, ("<answer></answer>", "# Tools")))


def seed_kind(messages: list[dict]) -> str | None:
    """Which seed kind a chat belongs to, from its system prompt (None: not a seed-kind chat)."""
    system = next((m.get("content") for m in messages if m.get("role") == "system"), None)
    if not isinstance(system, str):
        return None
    return next((kind for kind, marks in MARKS if all(m in system for m in marks)), None)


@dataclass
class Chat:
    """What the policy reads of its conversation."""

    kind: str
    tools: list[str]
    question: str  # the question block: "Question: ...", options, task line
    text: str  # the question line alone
    task: str
    duration: float
    glance: list[int]  # positions (in image order) of the first turn's frames
    times: list[float]  # time of every image part, in order
    replies: list[str]  # the policy's own earlier replies
    observations: list[str]  # tool observation lines, in order
    last_turn: bool
    images: list[np.ndarray] = field(default_factory=list)
    # where the rules' reads sit, as (message, start, end) in the messages' text_only contents (m1/evidence.py):
    # the question line's text, the video's length, each tool observation
    question_at: tuple[int, int, int] | None = None
    duration_at: tuple[int, int, int] | None = None
    observation_at: list[tuple[int, int, int]] = field(default_factory=list)


def read_chat(messages: list[dict], images: list[np.ndarray] | None) -> Chat:
    kind = seed_kind(messages) or ""
    system = messages[0].get("content", "") if messages else ""
    if kind == ZOOMER:
        tools = ["video_zoom"] if "<video_zoom>" in system else []
    else:
        tools = re.findall(r"^- ([a-z_\-]+): ", system, re.M)
    times, glance, observations, users = [], [], [], []
    spots: dict[str, Any] = {"observation_at": []}
    for n, m in enumerate(messages):
        if m.get("role") != "user":
            continue
        parts = m["content"] if isinstance(m.get("content"), list) else [{"type": "text", "text": str(m.get("content"))}]
        for p, at in zip(parts, part_starts(parts)):
            if p.get("type") == "image":
                if len(users) == 0:
                    glance.append(len(times))
                times.append(float(p.get("time", 0.0)))
            else:
                text = str(p.get("text", ""))
                if text.startswith("["):
                    observations.append(text)
                    spots["observation_at"].append((n, at, at + len(text)))
                if not users:
                    _spot(spots, "question_at", r"^Question: (.+)$", text, n, at)
                    _spot(spots, "duration_at", r"The video lasts ([\d.]+) s", text, n, at)
        users.append(" ".join(str(p.get("text", "")) for p in parts if p.get("type") != "image"))
    first = users[0] if users else ""
    qm = re.search(r"^Question: .*?(?=^Task:|\Z)", first, re.M | re.S)
    question = qm.group(0).strip() if qm else first
    line = re.search(r"^Question: (.+)$", first, re.M)
    task = re.search(r"^Task: (.+)$", first, re.M)
    dur = re.search(r"The video lasts ([\d.]+) s", first)
    last = bool(re.search(r"No tool calls are left|Stop using the tool", users[-1] if users else ""))
    return Chat(kind=kind, tools=tools, question=question, text=line.group(1).strip() if line else "",
                task=_task(task.group(1) if task else ""), duration=float(dur.group(1)) if dur else 0.0,
                glance=glance, times=times, replies=[m.get("content", "") for m in messages
                                                     if m.get("role") == "assistant"],
                observations=observations, last_turn=last, images=list(images or []), **spots)


def _spot(spots: dict[str, Any], name: str, pattern: str, text: str, message: int, at: int) -> None:
    """Keep where `pattern`'s group 1 (stripped) first sits in a text part starting at `at` of `message`."""
    m = re.search(pattern, text, re.M)
    if m and name not in spots:
        raw = m.group(1)
        a = m.start(1) + len(raw) - len(raw.lstrip())
        spots[name] = (message, at + a, at + a + len(raw.strip()))


@dataclass(frozen=True)
class Read:
    """A value a rule read off its chat: written into a reply's JSON, it cites `sources` (m1/evidence.py)."""

    value: Any
    sources: tuple


def write_json(out: ReplyBuilder, value: Any) -> None:
    """`json.dumps(value)` written piece by piece into `out`, each `Read` in it citing where it was read."""
    if isinstance(value, Read):
        out.read(json.dumps(value.value), value.sources)
    elif isinstance(value, dict):
        out.add("{")
        for i, (k, v) in enumerate(value.items()):
            out.add((", " if i else "") + json.dumps(k) + ": ")
            write_json(out, v)
        out.add("}")
    elif isinstance(value, (list, tuple)):
        out.add("[")
        for i, v in enumerate(value):
            out.add(", " if i else "")
            write_json(out, v)
        out.add("]")
    else:
        out.add(json.dumps(value))


def _time_at(chat: Chat) -> tuple:
    """Where the question states its time (the sources of a read of it), or nothing."""
    t = _TIME.search(chat.text)
    if chat.question_at is None or t is None:
        return ()
    m, a, _ = chat.question_at
    return ((m, a + t.start(), a + t.end()),)


def _task(line: str) -> str:
    low = line.lower()
    for word, task in (("multiple choice", "mcq"), ("temporal grounding", "grounding"), ("numeric", "numeric")):
        if low.startswith(word):
            return task
    return "open"


@dataclass
class Reading:
    answer: str | None
    seen: bool
    reader: _Answerer | None


def read_frames(chat: Chat, positions: list[int] | None = None) -> Reading:
    """Look at the chat's frames (all, or those at `positions`), sorted by time, one per time."""
    pos = range(len(chat.times)) if positions is None else positions
    by_time: dict[float, int] = {}
    for k in pos:
        if k < len(chat.images):
            by_time.setdefault(chat.times[k], k)
    if not by_time:
        return Reading(None, False, None)
    ts = sorted(by_time)
    frames = np.stack([np.asarray(chat.images[by_time[t]], np.uint8) for t in ts])
    reader = _Answerer(frames, ts, chat.question)
    out = reader.completion(SamplingParams(max_new_tokens=64))
    m = re.search(r"##Timestamp: (\[[^\]]*\])", out.text)
    a = re.search(r"##Answer: (.+)$", out.text, re.M)
    answer = m.group(1) if m else (a.group(1).strip() if a else None)
    if answer is not None and answer.lower() in ("not seen", "not found"):
        answer = None
    return Reading(answer, bool(out.meta.get("seen")), reader)


def cue(text: str) -> tuple[str, list[str], float | None]:
    """(kind of question, objects it names, a stated time) from the question's wording."""
    q = text.lower()
    objs = [f"{c} {s}" for c, s in _OBJ.findall(q)]
    t = _TIME.search(q)
    if t and "[start" not in q:
        return "timestamp", objs, int(t.group(1)) * 60 + int(t.group(2))
    for word, name in (("right after", "order"), ("how many", "counting"), ("relative to", "spatial"),
                       ("when does", "grounding"), ("which way", "motion"), ("near the end", "late"),
                       ("background", "background"), ("where in the frame", "position")):
        if word in q:
            return name, objs, None
    return "other", objs, None


def _fallback(chat: Chat) -> str:
    return {"mcq": "A", "numeric": "0", "grounding": "[0.0 - 1.0]"}.get(chat.task, "unknown")


def _evidence(r: Reading) -> str:
    """What the frames showed about the question's objects, and the chosen option's words: the reasoning a student
    can copy its answer from (an answer letter alone gives a tiny policy nothing to learn from)."""
    if r.reader is None:
        return ""
    bits = [n.rstrip(".") for n in r.reader.notes]
    letter = (r.answer or "").strip()
    if len(letter) == 1 and "A" <= letter <= "Z" and ord(letter) - 65 < len(r.reader.options):
        bits.append(f"The answer is {r.reader.options[ord(letter) - 65]}")
    return "".join(f". {b}" for b in bits)


TOOL_SAYS = "the tool's result"  # why an answer is a tool's span


def _answer_now(chat: Chat, prefer: str | None = None) -> tuple[str, str]:
    """(answer, why) from every frame seen; `prefer` (a tool's span) when the frames settle nothing."""
    r = read_frames(chat)
    if r.answer is not None and (r.seen or prefer is None):
        return r.answer, (f"I read {len(set(chat.times))} frames" + ("" if r.seen else " but could not see it")
                          + _evidence(r))
    if prefer is not None:
        return prefer, TOOL_SAYS
    return _fallback(chat), "a guess"


def _calls_made(chat: Chat, tag: str) -> int:
    return sum(bool(re.search(rf"<{tag}>", r)) for r in chat.replies)


# ------------------------------------------------------------------------------------------ Weaver
def _last_span(chat: Chat, tool: str) -> tuple[tuple[float, float] | None, tuple]:
    """The span the last `tool` observation reports, and where it says so (the sources of a read of it)."""
    for o, (n, a, _) in zip(reversed(chat.observations), reversed(chat.observation_at)):
        if o.startswith(f"[{tool}]"):
            m = re.search(r"from ([\d.]+)s to ([\d.]+)s", o)
            return ((float(m.group(1)), float(m.group(2))), ((n, a + m.start(1), a + m.end(2)),)) if m else (None, ())
    return None, ()


def _length_at(chat: Chat) -> tuple:
    return (chat.duration_at,) if chat.duration_at else ()


def weaver_reply(chat: Chat) -> tuple[str, tuple[ChatEvidence, ...]]:
    kind, objs, t = cue(chat.text)
    x = f"the {objs[0]}" if objs else chat.text
    dur, length = chat.duration, _length_at(chat)
    plan: list[tuple[str, dict]] = []
    if kind == "timestamp" and t is not None:
        at = _time_at(chat)
        plan = [("trim", {"start": Read(max(0.0, t - 4.0), at), "end": Read(min(dur, t + 6.0), at + length)})]
    elif kind == "order":
        plan = [("temporal_grounding", {"query": x})]
        span, at = _last_span(chat, "temporal_grounding")
        if span:
            plan.append(("trim", {"start": Read(max(0.0, span[1] - 2.0), at),
                                  "end": Read(min(dur, span[1] + 10.0), at + length)}))
    elif kind == "counting":
        plan = [("temporal_count", {"query": x})]
    elif kind == "spatial" and len(objs) >= 2:
        plan = [("temporal_grounding", {"query": x}), ("spatial_grounding", {"objects": objs[:2]})]
    elif kind == "grounding":
        plan = [("temporal_grounding", {"query": x})]
    elif kind == "motion":
        plan = [("temporal_grounding", {"query": x}), ("spatial_tracking", {"objects": objs[:1] or [x]})]
    elif kind == "position":
        plan = [("temporal_grounding", {"query": x}), ("spatial_grounding", {"objects": objs[:1] or [x]})]
    elif kind == "background":
        plan = [("frame_selection", {"query": x})]
    elif kind == "late":
        plan = [("trim", {"start": Read(max(0.0, dur - 30.0), length), "end": Read(dur, length)})]
    plan = [p for p in plan if p[0] in chat.tools]
    done = _calls_made(chat, "tool_call")
    if done < len(plan) and not chat.last_turn:
        name, args = plan[done]
        step = {"trim": "cut the part of the video that matters", "temporal_grounding": f"find when {x} is on screen",
                "temporal_count": f"find every clip with {x}", "frame_selection": f"pick the frame that shows {x}",
                "spatial_grounding": "locate the objects", "spatial_tracking": f"follow {x}"}[name]
        out = ReplyBuilder()
        out.add(f"Step {done + 1}: the question needs a closer look, so I {step}.\n<tool_call>")
        write_json(out, {"tool_name": name, **args})
        out.add("</tool_call>")
        return out.done()
    span, at = _last_span(chat, "temporal_grounding")
    prefer = f"[{span[0]:.1f} - {span[1]:.1f}]" if kind == "grounding" and span else None
    answer, why = _answer_now(chat, prefer)
    out = ReplyBuilder()
    out.add(f"Final step: {why}.\n<answer>")
    out.read(answer, at if why == TOOL_SAYS else ())  # the grounding tool's span, when the frames settle nothing
    out.add("</answer>")
    return out.done()


# ------------------------------------------------------------------------------------------ VideoZoomer
def _zoom(s: float, e: float, fps: float, budget: int = 16) -> tuple[float, float, float]:
    """A segment and an fps within the frame budget (fps lowered, to 3 decimals, when the segment is long)."""
    s, e = max(0.0, round(s, 1)), round(e, 1)
    e = max(e, s + 0.5)
    fps = min(float(fps), budget / (e - s))
    return s, e, max(0.001, math.floor(fps * 1000) / 1000)


def zoomer_plan(chat: Chat) -> list[tuple[float, float, float]]:
    """The zooms the glance calls for (each within the 16-frame budget)."""
    kind, objs, t = cue(chat.text)
    dur = chat.duration
    glance = read_frames(chat, chat.glance)
    runs = {o: glance.reader.of(o) if glance.reader else [] for o in objs}
    x = runs.get(objs[0], []) if objs else []
    if kind == "timestamp" and t is not None:
        return [_zoom(t - 3.0, min(dur, t + 5.0), 2)]
    if kind == "order" and x:
        last = x[-1].last
        return [_zoom(last - 2.0, min(dur, last + 6.0), 2)]
    if kind == "grounding" and x:
        first, last = x[0].first, x[-1].last
        return [_zoom(first - 4.0, min(dur, first + 4.0), 2), _zoom(last - 4.0, min(dur, last + 4.0), 2)]
    if kind == "motion" and x:
        r = max(x, key=lambda r: r.last - r.first)
        return [_zoom(r.first, min(dur, max(r.last, r.first + 1.0)), 2)]
    if kind == "spatial" and len(objs) >= 2 and not glance.seen and runs[objs[0]]:
        a = runs[objs[0]][0].first
        return [_zoom(a - 8.0, min(dur, a + 8.0), 1)]
    if kind in ("position", "background") and not glance.seen:
        return []
    if kind == "late":
        return [_zoom(dur - 16.0, dur, 1)]
    return []


def zoomer_reply(chat: Chat) -> tuple[str, tuple[ChatEvidence, ...]]:
    done = _calls_made(chat, "video_zoom")
    can_zoom = "video_zoom" in chat.tools and not chat.last_turn
    if can_zoom:
        plan = zoomer_plan(chat)
        if done < len(plan):
            s, e, fps = plan[done]
            kind = cue(chat.text)[0]  # a stated time or the video's end is read off the chat; the rest off pixels
            at = _time_at(chat) if kind == "timestamp" else _length_at(chat) if kind == "late" else ()
            out = ReplyBuilder()
            out.add("<think>The glance is too sparse here; I zoom into ")
            out.read(f"{s:.1f}-{e:.1f}", at)
            out.add(f"s at {fps:g} fps.</think><video_zoom>")
            write_json(out, {"segment": Read([s, e], at), "fps": fps})
            out.add("</video_zoom>")
            return out.done()
        if done and done == len(plan) and not read_frames(chat).seen:  # self-refine: widen the last zoom once
            s, e, fps = plan[-1]
            c, half = (s + e) / 2, (e - s)
            ws, we = max(0.0, c - half), min(chat.duration, c + half)
            wfps = _zoom(ws, we, fps / 2)[2]
            return (f"<think>The zoom missed it; the segment was too narrow. I widen it to {ws:.1f}-{we:.1f}s."
                    f"</think><video_zoom>{json.dumps({'segment': [round(ws, 1), round(we, 1)], 'fps': wfps})}"
                    "</video_zoom>"), ()
    answer, why = _answer_now(chat)
    return f"<think>{why}.</think><answer>{answer}</answer>", ()


# ------------------------------------------------------------------------------------------ SAGE
def _sage(final: str | None, reasoning: str, calls: list[tuple[str, dict, str]], first: bool
          ) -> tuple[str, tuple[ChatEvidence, ...]]:
    rec = {"needed": bool(calls), "why_no_tool": "" if calls else "the frames answer the question",
           "tool_calls": [{"rationale": why, "name": n, "arguments": a} for n, a, why in calls]}
    body = ({"video_context": reasoning, "query_intent": "answer the question", "final_answer": final,
             "recommended_tools": rec} if first else
            {"answerable": {"verdict": final is not None, "reasoning": reasoning}, "final_answer": final,
             "recommended_tools": rec})
    out = ReplyBuilder()
    out.add("<json>")
    write_json(out, body)
    out.add("</json>")
    return out.done()


def _hms(t: float) -> str:
    t = max(0.0, t)
    return f"{int(t // 3600):02d}:{int(t % 3600 // 60):02d}:{int(t % 60):02d}"


def sage_reply(chat: Chat) -> tuple[str, tuple[ChatEvidence, ...]]:
    first = not chat.replies
    r = read_frames(chat)
    if r.seen or not chat.tools or chat.last_turn:
        answer = r.answer if r.answer is not None else _fallback(chat)
        why = (f"the {len(set(chat.times))} frames show it" if r.seen else "the evidence is thin; best guess") + _evidence(r)
        return _sage(answer, why, [], first)
    kind, objs, t = cue(chat.text)
    dur = chat.duration
    asked = [json.loads(m.group(1)) for rep in chat.replies for m in re.finditer(r"<json>(.*?)</json>", rep, re.S)]
    names = [c.get("name") for a in asked for c in a.get("recommended_tools", {}).get("tool_calls", [])]
    if "extract-video-parts" not in names and "extract-video-parts" in chat.tools:
        window, at = None, ()
        if kind == "timestamp" and t is not None:
            window, at = (t - 10.0, t + 10.0), _time_at(chat)
        elif kind == "late":
            window, at = (dur - 30.0, dur), _length_at(chat)
        elif objs and "ground-event" in chat.tools:
            if "ground-event" not in names:
                return _sage(None, f"the glance does not show the {objs[0]} clearly", [
                    ("ground-event", {"event": f"the {objs[0]} appears", "start": _hms(0), "end": _hms(dur)},
                     f"find when the {objs[0]} is on screen")], first)
            found, (n, a, _) = next(((o, w) for o, w in zip(reversed(chat.observations), reversed(chat.observation_at))
                                     if o.startswith("[ground-event]")), ("", (0, 0, 0)))
            m = re.search(r'"start": "(\d\d:\d\d:\d\d)", "end": "(\d\d:\d\d:\d\d)"', found)
            if m:
                s = sum(int(x) * k for x, k in zip(m.group(1).split(":"), (3600, 60, 1)))
                e = sum(int(x) * k for x, k in zip(m.group(2).split(":"), (3600, 60, 1)))
                window, at = (s - 5.0, e + 5.0), ((n, a + m.start(1), a + m.end(2)),)
        if window is not None:
            s, e = max(0.0, window[0]), min(dur, window[1])
            return _sage(None, "I need frames of that moment", [
                ("extract-video-parts", {"start": Read(_hms(s), at), "end": Read(_hms(e), at + _length_at(chat)),
                                         "type": "frames"}, "look at the moment densely")], first)
    answer = r.answer if r.answer is not None else _fallback(chat)
    return _sage(answer, "answering from what I could see" + _evidence(r), [], first)


REPLIES = {WEAVER: weaver_reply, ZOOMER: zoomer_reply, SAGE: sage_reply}


def reply(messages: list[dict], images: list[np.ndarray] | None) -> str:
    """The rule policy's reply to a seed-kind chat."""
    return write(messages, images)[0]


def write(messages: list[dict], images: list[np.ndarray] | None) -> tuple[str, tuple[ChatEvidence, ...]]:
    """The reply and where it reads the chat's text (m1/evidence.py ChatEvidence; what it reads off pixels is not
    text and is not cited)."""
    chat = read_chat(messages, images)
    return REPLIES[chat.kind](chat)
