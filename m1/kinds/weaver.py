"""Weaver as an agent kind: one policy that reasons step by step and calls one tool per reply, each tool returning a
new clip (the *context* the next tool works in) or a frame, until it answers.

Syntax: `<tool_call>{"tool_name": ..., ...}</tool_call>` or `<answer>..</answer>`. Paper settings: a 128-frame
uniform glance, tool clips at 1 fps, at most 10 turns.

| tool | the paper's backing | here (m1/kinds/tools.py SeedTools) |
|---|---|---|
| temporal_grounding | UniTime | the grounding VLM over the context (the Grounding Tool's frames and prompt) |
| frame_selection | Qwen2.5-VL frame confidence, top 1 | CLIP scores of the context's frames at `tools.image_fps` |
| temporal_count | Qwen2.5-VL per clip, positives joined | the browser VLM per equal clip (`count_clips`) |
| trim | deterministic cut | the same |
| spatial_tracking / spatial_grounding | GroundedSAM2 / Grounding-DINO boxes | the space VLM's description |

Its M1-Synth rule policy, by the question's cue: trim around a stated time; ground the object in time (then trim
right after it for "right after X leaves", locate or track it for spatial / position / motion questions);
temporal_count for counting; frame_selection for background; then answer from every frame it has seen.
"""
from __future__ import annotations

import math
import re
from collections.abc import Sequence

from m1.evidence import ChatEvidence, ReplyBuilder
from m1.kinds.parsers import SeedReply, ToolCall, answer_from_prose, answer_value, canonical_name, finish, guard, \
    loads_lenient, reason_of, tags
from m1.kinds.rules import Chat, Read, answer_now, answer_reply, calls_made, length_at, time_at, write_json
from m1.kinds.settings import KindSettings
from m1.kinds.tools import Context, Observation, Pending, SeedTools, ToolFailure, done, object_phrase
from m1.models.base import Completion
from m1.registry import SeedKindSpec, register_seed_kind
from m1.schema import Question
from m1.text import format_span, format_time
from m1.tools.select import clip_spans
from m1.video import fps_indices, uniform_indices

WEAVER = "weaver"

# ------------------------------------------------------------------------------------------ prompts
USAGE = {
    "temporal_grounding": ("Finds the clip of the current context where an event happens and returns it.",
                           '{"tool_name": "temporal_grounding", "query": "the event to ground"}'),
    "frame_selection": ("Picks the single frame of the current context that best shows a scene.",
                        '{"tool_name": "frame_selection", "query": "a description of the wanted moment"}'),
    "temporal_count": ("Checks the current context clip by clip for an event and returns the clips where it "
                       "happens, joined, so the occurrences can be counted.",
                       '{"tool_name": "temporal_count", "query": "the event to count"}'),
    "trim": ("Cuts the video from start to end (seconds, floats; start defaults to 0, end to the video's end); "
             "also good for 'before' or 'after' an event.",
             '{"tool_name": "trim", "start": 0.0, "end": 30.0}'),
    "spatial_tracking": ("Follows the named objects through the current context clip and reports where they go.",
                         '{"tool_name": "spatial_tracking", "objects": ["object1", "object2"]}'),
    "spatial_grounding": ("Locates the named objects in a still scene (the middle frame when the context holds "
                          "several).",
                          '{"tool_name": "spatial_grounding", "objects": ["object1", "object2"]}'),
}


def system(settings: KindSettings) -> str:
    lines = ["You answer questions about a video by reasoning step by step and, when it helps, calling tools "
             "that return new clips or frames of the video.", "", "# Tools"]
    for t in settings.tools:
        what, usage = USAGE[t]
        lines += [f"- {t}: {what}", f"  Usage: <tool_call>{usage}</tool_call>"]
    if not settings.tools:
        lines.append("- (no tools in this run: answer from the frames you have)")
    lines += ["", "# Rules",
              "1. Think about what the question needs and whether a tool would show it; call at most one tool per "
              "reply.",
              "2. Temporal tools (temporal_grounding, temporal_count, frame_selection) find moments; spatial tools "
              "(spatial_tracking, spatial_grounding) read positions. Pick the one that fits.",
              "3. Check what a tool returns; if it missed, call again with other arguments.",
              "4. Tools can be wrong: trust what you see in the frames.",
              "5. When you know, give only the final answer inside <answer></answer>, e.g. <answer>B</answer>."]
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------ parser
def _args(name: str, obj: dict) -> tuple[dict | None, str | None]:
    """Arguments of a Weaver tool, checked: query str; objects list of str; start/end floats."""
    if name == "trim":
        out = {}
        for key in ("start", "end"):
            v = obj.get(key)
            if v is None:
                continue
            try:
                out[key] = float(v)
            except (TypeError, ValueError):
                return None, f"trim {key} {v!r} is not a number"
            if not math.isfinite(out[key]):
                return None, f"trim {key} {v!r} is not finite"
        return out, None
    if name in ("spatial_tracking", "spatial_grounding"):
        objs = obj.get("objects")
        if isinstance(objs, str):
            objs = [x.strip() for x in objs.split(",") if x.strip()]
        if not isinstance(objs, list) or not objs or not all(isinstance(x, str) and x.strip() for x in objs):
            return None, f"{name} needs objects: a list of names"
        return {"objects": [x.strip() for x in objs][:8]}, None
    q = obj.get("query")
    if not isinstance(q, str) or not q.strip():
        return None, f"{name} needs a query string"
    return {"query": q.strip()[:300]}, None


def parse_weaver(text: str, question: Question, tools: Sequence[str]) -> SeedReply:
    """One `<tool_call>{"tool_name": ..., ...}</tool_call>` or one `<answer>...</answer>`."""
    return guard(_parse_weaver, text, question, tools)


def _parse_weaver(raw: str, question: Question, tools: Sequence[str]) -> SeedReply:
    reply, errors = SeedReply(reason=reason_of(raw)), []
    calls = tags(raw, "tool_call", errors)
    answers = tags(raw, "answer", errors)
    if calls:
        if len(calls) > 1:
            errors.append(f"{len(calls)} tool calls in one reply; the first is run")
        if answers:
            errors.append("a tool call and an answer in one reply; the tool call is run")
        obj, exact, err = loads_lenient(calls[0])
        if not exact:
            errors.append(err or "tool call JSON repaired")
        if isinstance(obj, dict):
            given = obj.get("tool_name", obj.get("name"))
            if "tool_name" not in obj:
                errors.append("tool call without tool_name")
            name = canonical_name(given, tools)
            if name is None:
                errors.append(f"unknown tool {str(given)[:40]!r} (tools: {', '.join(tools) or 'none'})")
            else:
                if name != given:
                    errors.append(f"tool name {str(given)[:40]!r} read as {name!r}")
                args, aerr = _args(name, obj.get("arguments", obj) if isinstance(obj.get("arguments"), dict)
                                   else obj)
                if args is None:
                    errors.append(aerr)
                else:
                    reply.calls = [ToolCall(name, args)]
        elif obj is not None:
            errors.append("tool call is not a JSON object")
        if reply.calls:
            return finish(reply, errors)
    if answers:
        reply.raw_answer = answers[-1].strip()
        value, exact, err = answer_value(reply.raw_answer, question)
        reply.answer = value
        if not exact:
            errors.append(err or f"answer {reply.raw_answer[:40]!r} is not in the exact form for a {question.task} "
                                 f"answer")
        return finish(reply, errors)
    value, err = answer_from_prose(raw, question)
    reply.answer = value
    errors.append("no <tool_call> and no <answer>" + (f" ({err})" if err and not value else ""))
    return finish(reply, errors)


# ------------------------------------------------------------------------------------------ tools
def temporal_grounding(tk: SeedTools, ctx: Context, args: dict) -> Pending:
    query = args["query"]

    def describe(span, idx) -> Observation:
        if span is None:
            return Observation("temporal_grounding", args, f"No clip matching {query!r} was found in "
                               f"{format_time(ctx.span[0])}-{format_time(ctx.span[1])}.")
        frames = tk.clip_frames(ctx, span)
        ctx.span = span
        return Observation("temporal_grounding", args,
                           f"Grounded the clip from {span[0]:.1f}s to {span[1]:.1f}s for {query!r}; its "
                           f"{len(frames)} frames at {tk.settings.tool_fps:g} fps follow.",
                           indices=frames, span=span, answer=format_span(span))

    return tk.ground(ctx, query, ctx.span, describe)


def frame_selection(tk: SeedTools, ctx: Context, args: dict) -> Pending:
    clip = tk.clip()
    if clip is None:
        raise ToolFailure("needs a CLIP model (tools.clip) and none is configured")
    s, e = ctx.span
    cand = fps_indices(ctx.video.info, tk.cfg.image_fps, s, e) if e > s else uniform_indices(
        ctx.video.info, 1, s, s)
    scores = clip.scores(ctx.video, cand, args["query"])
    best = int(cand[int(scores.argmax())])
    t = ctx.video.timestamps([best])[0]
    ctx.span = (t, t)
    return done(Observation("frame_selection", args, f"Selected the frame at {t:.1f}s for {args['query']!r}.",
                            indices=[best], span=(t, t)))


def temporal_count(tk: SeedTools, ctx: Context, args: dict) -> Pending:
    query = args["query"]
    s, e = ctx.span
    if e <= s:
        raise ToolFailure("the context is a single frame; trim a clip first")
    thing = object_phrase(query)
    q = Question(id="tool", video=ctx.question.video, task="numeric", text=f"How many times does a {thing} appear?")
    spans = [(s + a, s + b) for a, b in clip_spans(e - s, tk.settings.count_clips)]
    reqs, per = [], []
    for a, b in spans:
        idx = fps_indices(ctx.video.info, tk.cfg.grounding_fps, a, b, max_frames=tk.cfg.rough_frames)
        per.append(idx)
        reqs.append((tk.vision_key("browser"), tk.request(ctx, "fine", q, query, idx, tk.cfg.rough_tokens)))

    def read(replies: list[Completion]) -> Observation:
        hits = [sp for sp, r in zip(spans, replies) if _positive(r.text)]
        seen = sorted({i for idx in per for i in idx})
        if not hits:
            return Observation("temporal_count", args, f"Found no clip with {query!r} among {len(spans)} "
                               "clips.", tool_frames=seen, answer="0")
        frames = sorted({i for sp in hits for i in tk.clip_frames(ctx, sp)})[:tk.settings.max_tool_frames]
        ctx.span = (hits[0][0], hits[-1][1])
        listing = ", ".join(f"[{a:.1f} - {b:.1f}]" for a, b in hits)
        return Observation("temporal_count", args,
                           f"Found {len(hits)} of {len(spans)} clips with {query!r}: {listing}; joined, "
                           f"{len(frames)} frames follow.", indices=frames, span=ctx.span,
                           tool_frames=seen, answer=str(len(hits)))

    return Pending(reqs, read)


def _positive(text: str) -> bool:
    """A clip judge's reply says the event occurs: an answer count above 0, or a yes."""
    m = re.search(r"##\s*answer\s*:\s*(.+)", text, re.IGNORECASE)
    value = (m.group(1) if m else text).strip().lower()
    num = re.search(r"\d+", value)
    if num:
        return int(num.group(0)) > 0
    return value.startswith("yes")


def trim(tk: SeedTools, ctx: Context, args: dict) -> Pending:
    span = tk.window(ctx, args.get("start"), args.get("end"), (0.0, ctx.video.info.duration))
    frames = tk.clip_frames(ctx, span)
    ctx.span = span
    return done(Observation("trim", args, f"Trimmed the clip from {span[0]:.1f}s to {span[1]:.1f}s; its "
                            f"{len(frames)} frames follow.", indices=frames, span=span))


def _spatial(tk: SeedTools, ctx: Context, name: str, args: dict, idx: list[int]) -> Pending:
    objs = args["objects"]
    q = Question(id="tool", video=ctx.question.video, task="open",
                 text="Where is each of these in the frame: " + ", ".join(objs) + "?")
    req = tk.request(ctx, "space", q, ", ".join(objs), idx, tk.cfg.space_tokens)

    def read(replies: list[Completion]) -> Observation:
        text = (replies[0].text if replies else "").strip()
        text = re.sub(r"^##\s*summary\s*:\s*", "", text, flags=re.IGNORECASE)
        return Observation(name, args, f"{'Tracked' if name == 'spatial_tracking' else 'Located'} "
                           f"{', '.join(objs)}: {text or '(the model returned nothing)'}", indices=list(idx),
                           tool_frames=list(idx))

    return Pending([(tk.vision_key("space"), req)], read)


def spatial_tracking(tk: SeedTools, ctx: Context, args: dict) -> Pending:
    return _spatial(tk, ctx, "spatial_tracking", args, tk.clip_frames(ctx, ctx.span))


def spatial_grounding(tk: SeedTools, ctx: Context, args: dict) -> Pending:
    s, e = ctx.span  # a still scene: the middle frame of the context
    return _spatial(tk, ctx, "spatial_grounding", args, uniform_indices(ctx.video.info, 1, s, e))


# ------------------------------------------------------------------------------------------ M1-Synth rule policy
def _last_span(chat: Chat, tool: str) -> tuple[tuple[float, float] | None, tuple]:
    """The span the last `tool` observation reports, and where it says so (the sources of a read of it)."""
    for o, (n, a, _) in zip(reversed(chat.observations), reversed(chat.observation_at)):
        if o.startswith(f"[{tool}]"):
            m = re.search(r"from ([\d.]+)s to ([\d.]+)s", o)
            return ((float(m.group(1)), float(m.group(2))), ((n, a + m.start(1), a + m.end(2)),)) if m else (None, ())
    return None, ()


def _plan(chat: Chat, kind: str, objs: list[str], t: float | None, x: str) -> list[tuple[str, dict]]:
    """The calls the question's cue asks for, in order (those of them the run offers)."""
    dur, length = chat.duration, length_at(chat)
    plan: list[tuple[str, dict]] = []
    if kind == "timestamp" and t is not None:
        at = time_at(chat)
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
    return [p for p in plan if p[0] in chat.tools]


def rules(chat: Chat) -> tuple[str, tuple[ChatEvidence, ...]]:
    kind, objs, t = chat.cue()
    x = f"the {objs[0]}" if objs else chat.text
    plan = _plan(chat, kind, objs, t, x)
    made = calls_made(chat, "tool_call")
    if made < len(plan) and not chat.last_turn:
        name, args = plan[made]
        step = {"trim": "cut the part of the video that matters", "temporal_grounding": f"find when {x} is on screen",
                "temporal_count": f"find every clip with {x}", "frame_selection": f"pick the frame that shows {x}",
                "spatial_grounding": "locate the objects", "spatial_tracking": f"follow {x}"}[name]
        out = ReplyBuilder()
        out.add(f"Step {made + 1}: the question needs a closer look, so I {step}.\n<tool_call>")
        write_json(out, {"tool_name": name, **args})
        out.add("</tool_call>")
        return out.done()
    span, at = _last_span(chat, "temporal_grounding")
    # the grounding tool's span, when the frames settle nothing
    prefer = Read(f"[{span[0]:.1f} - {span[1]:.1f}]", at) if kind == "grounding" and span else None
    answer, why = answer_now(chat, prefer)
    return answer_reply("Final step: ", why, ".\n<answer>", answer)


# ------------------------------------------------------------------------------------------ the spec
SPEC = register_seed_kind(SeedKindSpec(
    name=WEAVER,
    tools=tuple(USAGE),
    tool_code={"temporal_grounding": temporal_grounding, "frame_selection": frame_selection,
               "temporal_count": temporal_count, "trim": trim, "spatial_tracking": spatial_tracking,
               "spatial_grounding": spatial_grounding},
    glance_frames=128, max_turns=10, tool_fps=1.0,
    system=system,
    ask="Think step by step; call a tool or give <answer></answer>.",
    last_turn="No tool calls are left: give your final answer in <answer></answer> now.",
    parse=parse_weaver,
    # R = 0.7 R_corr + 0.2 R_format + 0.1 R_tool (the paper). Format is 1 when every policy turn parsed strictly
    # (m1/kinds/parsers.py `ok`); the paper only asks for an <answer> tag, which the strict parser checks along with
    # every tool call, so a malformed call costs the format part too.
    reward_weights=(0.7, 0.2, 0.1),
    rules=rules,
    marks=("<answer></answer>", "# Tools"),
    # the mini policies' loop (configs/sft/weaver_synth.yaml): described frames, a 16-frame glance, short results
    corpus_loop={"glance_frames": 16, "max_turns": 4, "max_tool_frames": 16},
))
