"""VideoZoomer as an agent kind: one policy that reads a sparse glance, thinks, and zooms into segments of its
choosing (at most `zoom_frames` frames each) until it answers.

Syntax: `<think>..</think>` then `<video_zoom>{"segment": [s, e], "fps": n}</video_zoom>` or `<answer>`. Paper
settings: a 64-frame uniform glance, 5 turns (4 zooms and the answer), B = 16 frames per zoom. Its one tool,
video_zoom, resamples deterministically as the paper's does; `(end - start) * fps > zoom_frames` is an error
observation.

Its M1-Synth rule policy reads the 64-frame glance and zooms (2 fps, 16 frames) at the stated time, where the object
was last seen, at both ends of its appearance (grounding), over its run (motion), or the last 16 s; it widens a zoom
once if it still cannot see (self-refine); counting it answers from the glance (16 frames cannot cover a video).
"""
from __future__ import annotations

import json
import math
import re
from collections.abc import Sequence

from m1.evidence import ChatEvidence, ReplyBuilder
from m1.kinds.parsers import SeedReply, ToolCall, answer_from_prose, answer_value, finish, guard, loads_lenient, \
    reason_of, tags
from m1.kinds.rules import Chat, Read, answer_now, answer_reply, calls_made, length_at, time_at, write_json
from m1.kinds.settings import KindSettings
from m1.kinds.tools import Context, Observation, Pending, SeedTools, ToolFailure, done
from m1.registry import SeedKindSpec, register_seed_kind
from m1.schema import Question
from m1.text import parse_span
from m1.video import fps_indices

ZOOMER = "zoomer"
ZOOM = "video_zoom"  # its one tool


def system(settings: KindSettings) -> str:
    lines = ["You receive a low-frame-rate glance at a video and a question about it."]
    if settings.tools:
        lines += [
            "When you need a closer look at a moment, ask for a zoom: give the segment in seconds and the frame "
            "rate you want, as JSON inside <video_zoom></video_zoom>, e.g. "
            '<video_zoom>{"segment": [4.0, 6.0], "fps": 2}</video_zoom>.',
            f"A zoom returns at most {settings.zoom_frames} frames: (end - start) * fps must not exceed "
            f"{settings.zoom_frames}. Do not give an answer in a reply that zooms.",
            "Zoom as often as you need until you can answer or are told to stop."]
    lines += ["Reason inside <think></think> first in every reply, then either zoom or put the final answer "
              "inside <answer></answer>."]
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------ parser
def _zoom_args(obj: object) -> tuple[dict | None, str | None]:
    if not isinstance(obj, dict):
        return None, "zoom request is not a JSON object"
    seg = obj.get("segment")
    if isinstance(seg, str):
        span = parse_span(seg)
        seg = list(span) if span else None
    if seg is None and "start" in obj and "end" in obj:
        seg = [obj.get("start"), obj.get("end")]
    try:
        s, e = (float(x) for x in seg)  # type: ignore[union-attr]
        fps = float(obj.get("fps"))
    except (TypeError, ValueError):
        return None, "zoom needs segment [start, end] and fps as numbers"
    if not all(math.isfinite(x) for x in (s, e, fps)):
        return None, "zoom numbers must be finite"
    return {"segment": [s, e], "fps": fps}, None


def parse_zoomer(text: str, question: Question) -> SeedReply:
    """`<think>...</think>` then one `<video_zoom>{"segment": [s, e], "fps": n}</video_zoom>` or one
    `<answer>...</answer>`."""
    return guard(_parse_zoomer, text, question)


def _parse_zoomer(raw: str, question: Question) -> SeedReply:
    reply, errors = SeedReply(reason=reason_of(raw)), []
    if not re.match(r"\s*<think>.*?</think>", raw, re.DOTALL):
        errors.append("the reply does not open with <think>...</think>")
    zooms = tags(raw, "video_zoom", errors)
    answers = tags(raw, "answer", errors)
    if zooms:
        if answers:
            errors.append("a zoom and an answer in one reply; the zoom is run")
        if len(zooms) > 1:
            errors.append(f"{len(zooms)} zooms in one reply; the first is run")
        obj, exact, err = loads_lenient(zooms[0])
        if not exact:
            errors.append(err or "zoom JSON repaired")
        args, aerr = _zoom_args(obj)
        if args is not None:
            if exact and not (isinstance(obj.get("segment"), list) and "fps" in obj):
                errors.append("zoom JSON not in the exact form")
            reply.calls = [ToolCall(ZOOM, args)]
            return finish(reply, errors)
        errors.append(aerr)
    if answers:
        reply.raw_answer = answers[-1].strip()
        value, exact, err = answer_value(reply.raw_answer, question)
        reply.answer = value
        if not exact:
            errors.append(err or "answer not in the exact form")
        return finish(reply, errors)
    value, err = answer_from_prose(raw, question)
    reply.answer = value
    errors.append("no <video_zoom> and no <answer>" + (f" ({err})" if err and not value else ""))
    return finish(reply, errors)


def parse_zoomer_turn(text: str, question: Question, tools: Sequence[str]) -> SeedReply:
    """`parse_zoomer`, with its zoom refused when the run has not enabled video_zoom."""
    reply = parse_zoomer(text, question)
    if reply.calls and ZOOM not in tools:
        reply.calls = []
        reply.ok, reply.error = False, "; ".join(x for x in (reply.error, "video_zoom is not enabled") if x)
    return reply


# ------------------------------------------------------------------------------------------ its tool
def video_zoom(tk: SeedTools, ctx: Context, args: dict) -> Pending:
    (s, e), fps = args["segment"], float(args["fps"])
    dur = ctx.video.info.duration
    if fps <= 0:
        raise ToolFailure(f"fps {fps:g} must be > 0")
    if not 0 <= s < e:
        raise ToolFailure(f"segment [{s:g}, {e:g}] must have 0 <= start < end")
    if s >= dur:
        raise ToolFailure(f"segment starts at {s:g}s, past the end of the video ({dur:.1f}s)")
    e = min(e, dur)
    need = (e - s) * fps
    budget = tk.settings.zoom_frames
    if need > budget + 1e-6:
        raise ToolFailure(f"segment [{s:g}, {e:g}] at {fps:g} fps asks for {need:.0f} frames; the budget is "
                          f"{budget} per zoom: shorten the segment or lower the fps")
    frames = fps_indices(ctx.video.info, fps, s, e, max_frames=budget)
    ctx.span = (s, e)
    return done(Observation(ZOOM, args, f"Zoomed into {s:.1f}s-{e:.1f}s at {fps:g} fps: "
                            f"{len(frames)} frames follow.", indices=frames, span=(s, e)))


# ------------------------------------------------------------------------------------------ M1-Synth rule policy
def _zoom(s: float, e: float, fps: float, budget: int = 16) -> tuple[float, float, float]:
    """A segment and an fps within the frame budget (fps lowered, to 3 decimals, when the segment is long)."""
    s, e = max(0.0, round(s, 1)), round(e, 1)
    e = max(e, s + 0.5)
    fps = min(float(fps), budget / (e - s))
    return s, e, max(0.001, math.floor(fps * 1000) / 1000)


def zoom_plan(chat: Chat) -> list[tuple[float, float, float]]:
    """The zooms the glance calls for (each within the 16-frame budget)."""
    kind, objs, t = chat.cue()
    dur = chat.duration
    glance = chat.look(chat.glance)
    runs = {o: glance.runs(o) for o in objs}
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


def rules(chat: Chat) -> tuple[str, tuple[ChatEvidence, ...]]:
    made = calls_made(chat, ZOOM)
    if ZOOM in chat.tools and not chat.last_turn:
        plan = zoom_plan(chat)
        if made < len(plan):
            s, e, fps = plan[made]
            kind = chat.cue()[0]  # a stated time or the video's end is read off the chat; the rest off pixels
            at = time_at(chat) if kind == "timestamp" else length_at(chat) if kind == "late" else ()
            out = ReplyBuilder()
            out.add("<think>The glance is too sparse here; I zoom into ")
            out.read(f"{s:.1f}-{e:.1f}", at)
            out.add(f"s at {fps:g} fps.</think><video_zoom>")
            write_json(out, {"segment": Read([s, e], at), "fps": fps})
            out.add("</video_zoom>")
            return out.done()
        if made and made == len(plan) and not chat.look().seen:  # self-refine: widen the last zoom once
            s, e, fps = plan[-1]
            c, half = (s + e) / 2, (e - s)
            ws, we = max(0.0, c - half), min(chat.duration, c + half)
            wfps = _zoom(ws, we, fps / 2)[2]
            return (f"<think>The zoom missed it; the segment was too narrow. I widen it to {ws:.1f}-{we:.1f}s."
                    f"</think><video_zoom>{json.dumps({'segment': [round(ws, 1), round(we, 1)], 'fps': wfps})}"
                    "</video_zoom>"), ()
    answer, why = answer_now(chat)
    return answer_reply("<think>", why, ".</think><answer>", answer)


# ------------------------------------------------------------------------------------------ the spec
SPEC = register_seed_kind(SeedKindSpec(
    name=ZOOMER,
    tools=(ZOOM,),
    tool_code={ZOOM: video_zoom},
    glance_frames=64, max_turns=5, tool_fps=1.0,
    system=system,
    ask="Answer the question, zooming in where you need to.",
    last_turn="Stop using the tool: give your final answer in <answer></answer> now.",
    parse=parse_zoomer_turn,
    # R = 0.9 R_acc + 0.1 R_format + 0.5 R_tool (the paper's table of RL settings), R_tool only when the answer is
    # right; format: each turn <think> then a valid <video_zoom> or <answer> (the parser's strict `ok`)
    reward_weights=(0.9, 0.1, 0.5),
    rules=rules,
    marks=("<think></think>", "glance"),
    offered_tools=lambda system: [ZOOM] if "<video_zoom>" in system else [],
    corpus_loop={"glance_frames": 16, "max_turns": 3},
))
