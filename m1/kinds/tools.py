"""The seed kinds' tools over one video, backed by what M1 has: frame sampling (m1/video/), the CLIP index
(m1/tools/clip_index.py) and the vision model of the browse tools (`tools.browser` / `grounding` / `space`).

| tool | the paper's backing | here |
|---|---|---|
| weaver temporal_grounding | UniTime | the grounding VLM over the context at `tools.grounding_fps` (the Grounding Tool's frames and prompt) |
| weaver frame_selection | Qwen2.5-VL frame confidence, top 1 | CLIP scores of the context's frames at `tools.image_fps`, top 1 |
| weaver temporal_count | Qwen2.5-VL per clip, positives joined | the browser VLM per equal clip (`count_clips`), positives joined |
| weaver trim | deterministic cut | the same |
| weaver spatial_tracking / spatial_grounding | GroundedSAM2 / Grounding-DINO boxes | the space VLM's description (no boxes drawn) |
| zoomer video_zoom | deterministic resampling | the same, `(end - start) * fps <= zoom_frames` or an error |
| sage ground-event / extract-video-parts / analyze | an MLLM on the window / ffmpeg / an MLLM | grounding VLM / frames at `tool_fps` / browser VLM |

A tool that returns a clip hands its frames to the policy (at `tool_fps`, Weaver's 1 fps, at most
`max_tool_frames`) and makes it the *context* the next Weaver tool works in. Each call is split in `prepare`
(vision requests, so the loop can batch every episode's requests into one call per model) and `finish` (reads
the replies). Nothing here raises for a bad argument or a tool failure: the observation carries the error, the
policy reads it, the episode goes on.
"""
from __future__ import annotations

import math
import re
from collections.abc import Callable
from dataclasses import dataclass, field

from m1.agents.prompts import browser_prompt
from m1.kinds import KindSettings
from m1.models.base import Completion, VisionRequest
from m1.schema import Question
from m1.text import format_span, format_time, parse_span, parse_timestamp
from m1.tools.select import clip_spans
from m1.video import VideoError, fps_indices, uniform_indices

SAGE_MAX_GROUND_S = 600.0  # SAGE's ground-event window (< 10 min)
SAGE_MAX_EXTRACT_S = 300.0  # SAGE's extract-video-parts window (< 5 min)


@dataclass
class Context:
    """What one episode's tools work on: the video, the question, and the clip last returned (Weaver's context)."""

    question: Question
    video: object  # m1.video.VideoReader
    span: tuple[float, float]
    extracted: list[int] = field(default_factory=list)  # SAGE: frames of the last extract-video-parts


@dataclass
class Observation:
    tool: str
    args: dict
    text: str
    indices: list[int] = field(default_factory=list)  # frames handed to the policy
    span: tuple[float, float] | None = None
    error: str | None = None
    tool_frames: list[int] = field(default_factory=list)  # frames a tool model read
    answer: str | None = None  # a span or count the tool settled on


@dataclass
class Pending:
    """A prepared call: vision requests (model key, request) to send, and how to read their replies."""

    requests: list[tuple[str, VisionRequest]]
    finish: Callable[[list[Completion]], Observation]


class ToolFailure(Exception):
    """A bad argument or a tool that cannot run; becomes an error observation."""


def _done(obs: Observation) -> Pending:
    return Pending([], lambda _replies: obs)


def object_phrase(text: str) -> str:
    """'the red circle appears' -> 'red circle': the thing a query names, without articles and trailing verbs."""
    t = " ".join(str(text).lower().replace("?", " ").split())
    t = re.sub(r"^(?:when does |how many times does |find |count |every |each |all )+", "", t)
    t = re.sub(r"^(?:the|a|an)\s+", "", t)
    t = re.sub(r"\s+(?:appears?|occurs?|shows? up|is visible|leaves?|moves?)\b.*$", "", t)
    return t.strip() or str(text).strip()


def _seconds(value, name: str, default: float | None) -> float:
    if value is None or (isinstance(value, str) and not value.strip()):
        if default is None:
            raise ToolFailure(f"{name} is missing")
        return default
    if isinstance(value, bool):
        raise ToolFailure(f"{name} {value!r} is not a time")
    if isinstance(value, (int, float)):
        t = float(value)
    else:
        t = parse_timestamp(str(value))
        if t is None:
            raise ToolFailure(f"{name} {str(value)[:30]!r} is not a time (HH:MM:SS or seconds)")
    if not math.isfinite(t):
        raise ToolFailure(f"{name} {value!r} is not finite")
    return t


def hms(t: float) -> str:
    t = max(0.0, t)
    return f"{int(t // 3600):02d}:{int(t % 3600 // 60):02d}:{int(t % 60):02d}"


class SeedTools:
    """The tools of one kind for a run; `vision_key(role)` names the vision model of a role, `clip()` the index."""

    def __init__(self, settings: KindSettings, tools_cfg, clip: Callable[[], object | None]):
        self.s, self.cfg, self._clip = settings, tools_cfg, clip

    # ------------------------------------------------------------------ entry point
    def prepare(self, ctx: Context, name: str, args: dict) -> Pending:
        if name not in self.s.tools:
            return _done(Observation(name, args, "", error=f"{name} is not an available tool "
                                                            f"(available: {', '.join(self.s.tools) or 'none'})"))
        try:
            return getattr(self, "_" + name.replace("-", "_"))(ctx, args)
        except (ToolFailure, VideoError, ValueError) as exc:
            return _done(Observation(name, args, "", error=f"{name}: {exc}"))

    # ------------------------------------------------------------------ helpers
    def vision_key(self, role: str) -> str:
        key = {"grounding": self.cfg.grounding, "space": self.cfg.space}.get(role) or self.cfg.browser
        if key is None:
            raise ToolFailure("needs a vision model (tools.browser) and none is configured")
        return key

    def clip_frames(self, ctx: Context, span: tuple[float, float], fps: float | None = None) -> list[int]:
        """The frames a clip hands to the policy: `fps` (default tool_fps) over the span, at most max_tool_frames."""
        s, e = span
        if e - s <= 0:
            return uniform_indices(ctx.video.info, 1, s, s)
        return fps_indices(ctx.video.info, fps or self.s.tool_fps, s, e, max_frames=self.s.max_tool_frames)

    def _span(self, ctx: Context, start, end, default: tuple[float, float]) -> tuple[float, float]:
        dur = ctx.video.info.duration
        s = _seconds(start, "start", default[0])
        e = _seconds(end, "end", default[1])
        if e < s:
            raise ToolFailure(f"end {format_time(e)} is before start {format_time(s)}")
        if s >= dur:
            raise ToolFailure(f"start {format_time(s)} is past the end of the video ({format_time(dur)})")
        return max(0.0, s), min(dur, e)

    def _request(self, ctx: Context, kind: str, question: Question, focus: str, idx: list[int],
                 tokens: int) -> VisionRequest:
        ts = ctx.video.timestamps(idx)
        return VisionRequest(frames=ctx.video.frames(idx), timestamps=ts,
                             prompt=browser_prompt(kind, question, focus, ts, tokens))

    def _ground(self, ctx: Context, name: str, args: dict, query: str, span: tuple[float, float],
                describe: Callable[[tuple[float, float] | None, list[int]], Observation]) -> Pending:
        """Ask the grounding VLM when `query` happens inside `span`; `describe` turns the span into an observation."""
        thing = object_phrase(query)
        q = Question(id="tool", video=ctx.question.video, task="grounding",
                     text=f"When does the {thing} appear? Give [start - end] in seconds.")
        s, e = span
        idx = fps_indices(ctx.video.info, self.cfg.grounding_fps, s, e, max_frames=self.cfg.grounding_max_frames)
        req = self._request(ctx, "grounding", q, query, idx, self.cfg.grounding_tokens)

        def finish(replies: list[Completion]) -> Observation:
            text = replies[0].text if replies else ""
            m = re.search(r"##\s*timestamps?\s*:\s*(.+)", text, re.IGNORECASE)
            got = parse_span(m.group(1)) if m else None
            if got and not (s - 1e-6 <= got[0] and got[1] <= e + 1e-6) and got[1] <= (e - s) + 1e-6:
                got = (got[0] + s, got[1] + s)  # a VLM counting from the clip's start
            if got:
                got = (max(s, min(got)), min(e, max(got)))
            obs = describe(got if got and got[1] >= got[0] else None, idx)
            obs.tool_frames = list(idx)
            return obs

        return Pending([(self.vision_key("grounding"), req)], finish)

    # ------------------------------------------------------------------ Weaver
    def _temporal_grounding(self, ctx: Context, args: dict) -> Pending:
        query = args["query"]

        def describe(span, idx) -> Observation:
            if span is None:
                return Observation("temporal_grounding", args, f"No clip matching {query!r} was found in "
                                   f"{format_time(ctx.span[0])}-{format_time(ctx.span[1])}.")
            frames = self.clip_frames(ctx, span)
            ctx.span = span
            return Observation("temporal_grounding", args,
                               f"Grounded the clip from {span[0]:.1f}s to {span[1]:.1f}s for {query!r}; its "
                               f"{len(frames)} frames at {self.s.tool_fps:g} fps follow.",
                               indices=frames, span=span, answer=format_span(span))

        return self._ground(ctx, "temporal_grounding", args, query, ctx.span, describe)

    def _frame_selection(self, ctx: Context, args: dict) -> Pending:
        clip = self._clip()
        if clip is None:
            raise ToolFailure("needs a CLIP model (tools.clip) and none is configured")
        s, e = ctx.span
        cand = fps_indices(ctx.video.info, self.cfg.image_fps, s, e) if e > s else uniform_indices(
            ctx.video.info, 1, s, s)
        scores = clip.scores(ctx.video, cand, args["query"])
        best = int(cand[int(scores.argmax())])
        t = ctx.video.timestamps([best])[0]
        ctx.span = (t, t)
        return _done(Observation("frame_selection", args, f"Selected the frame at {t:.1f}s for {args['query']!r}.",
                                 indices=[best], span=(t, t)))

    def _temporal_count(self, ctx: Context, args: dict) -> Pending:
        query = args["query"]
        s, e = ctx.span
        if e <= s:
            raise ToolFailure("the context is a single frame; trim a clip first")
        thing = object_phrase(query)
        q = Question(id="tool", video=ctx.question.video, task="numeric",
                     text=f"How many times does a {thing} appear?")
        spans = [(s + a, s + b) for a, b in clip_spans(e - s, self.s.count_clips)]
        reqs, per = [], []
        for a, b in spans:
            idx = fps_indices(ctx.video.info, self.cfg.grounding_fps, a, b, max_frames=self.cfg.rough_frames)
            per.append(idx)
            reqs.append((self.vision_key("browser"), self._request(ctx, "fine", q, query, idx, self.cfg.rough_tokens)))

        def finish(replies: list[Completion]) -> Observation:
            hits = [sp for sp, r in zip(spans, replies) if _positive(r.text)]
            read = sorted({i for idx in per for i in idx})
            if not hits:
                return Observation("temporal_count", args, f"Found no clip with {query!r} among {len(spans)} "
                                   "clips.", tool_frames=read, answer="0")
            frames = sorted({i for sp in hits for i in self.clip_frames(ctx, sp)})[:self.s.max_tool_frames]
            ctx.span = (hits[0][0], hits[-1][1])
            listing = ", ".join(f"[{a:.1f} - {b:.1f}]" for a, b in hits)
            return Observation("temporal_count", args,
                               f"Found {len(hits)} of {len(spans)} clips with {query!r}: {listing}; joined, "
                               f"{len(frames)} frames follow.", indices=frames, span=ctx.span,
                               tool_frames=read, answer=str(len(hits)))

        return Pending(reqs, finish)

    def _trim(self, ctx: Context, args: dict) -> Pending:
        span = self._span(ctx, args.get("start"), args.get("end"), (0.0, ctx.video.info.duration))
        frames = self.clip_frames(ctx, span)
        ctx.span = span
        return _done(Observation("trim", args, f"Trimmed the clip from {span[0]:.1f}s to {span[1]:.1f}s; its "
                                 f"{len(frames)} frames follow.", indices=frames, span=span))

    def _spatial(self, ctx: Context, name: str, args: dict, idx: list[int]) -> Pending:
        objs = args["objects"]
        q = Question(id="tool", video=ctx.question.video, task="open",
                     text="Where is each of these in the frame: " + ", ".join(objs) + "?")
        req = self._request(ctx, "space", q, ", ".join(objs), idx, self.cfg.space_tokens)

        def finish(replies: list[Completion]) -> Observation:
            text = (replies[0].text if replies else "").strip()
            text = re.sub(r"^##\s*summary\s*:\s*", "", text, flags=re.IGNORECASE)
            return Observation(name, args, f"{'Tracked' if name == 'spatial_tracking' else 'Located'} "
                               f"{', '.join(objs)}: {text or '(the model returned nothing)'}", indices=list(idx),
                               tool_frames=list(idx))

        return Pending([(self.vision_key("space"), req)], finish)

    def _spatial_tracking(self, ctx: Context, args: dict) -> Pending:
        return self._spatial(ctx, "spatial_tracking", args, self.clip_frames(ctx, ctx.span))

    def _spatial_grounding(self, ctx: Context, args: dict) -> Pending:
        s, e = ctx.span  # a still scene: the middle frame of the context
        return self._spatial(ctx, "spatial_grounding", args, uniform_indices(ctx.video.info, 1, s, e))

    # ------------------------------------------------------------------ VideoZoomer
    def _video_zoom(self, ctx: Context, args: dict) -> Pending:
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
        if need > self.s.zoom_frames + 1e-6:
            raise ToolFailure(f"segment [{s:g}, {e:g}] at {fps:g} fps asks for {need:.0f} frames; the budget is "
                              f"{self.s.zoom_frames} per zoom: shorten the segment or lower the fps")
        frames = fps_indices(ctx.video.info, fps, s, e, max_frames=self.s.zoom_frames)
        ctx.span = (s, e)
        return _done(Observation("video_zoom", args, f"Zoomed into {s:.1f}s-{e:.1f}s at {fps:g} fps: "
                                 f"{len(frames)} frames follow.", indices=frames, span=(s, e)))

    # ------------------------------------------------------------------ SAGE
    def _ground_event(self, ctx: Context, args: dict) -> Pending:
        event = args.get("event")
        if not isinstance(event, str) or not event.strip():
            raise ToolFailure("needs event: a description of what happens")
        span = self._span(ctx, args.get("start"), args.get("end"), (0.0, ctx.video.info.duration))
        if span[1] - span[0] > SAGE_MAX_GROUND_S:
            raise ToolFailure(f"the window {hms(span[0])}-{hms(span[1])} is longer than 10 minutes")

        def describe(got, idx) -> Observation:
            body = ({"name": event, "timestamps": {"start": hms(got[0]), "end": hms(got[1])}} if got else
                    {"name": event, "timestamps": {"start": None, "end": None}})
            import json

            return Observation("ground-event", args, json.dumps(body), span=got,
                               answer=format_span(got) if got else None)

        return self._ground(ctx, "ground-event", args, event, span, describe)

    def _extract_video_parts(self, ctx: Context, args: dict) -> Pending:
        span = self._span(ctx, args.get("start"), args.get("end"), (0.0, ctx.video.info.duration))
        if span[1] - span[0] > SAGE_MAX_EXTRACT_S:
            raise ToolFailure(f"the window {hms(span[0])}-{hms(span[1])} is longer than 5 minutes")
        kind = str(args.get("type", "frames"))
        if kind not in ("frames", "subclips"):
            raise ToolFailure(f"type {kind[:20]!r} must be frames or subclips")
        frames = self.clip_frames(ctx, span)
        ctx.span, ctx.extracted = span, frames
        return _done(Observation("extract-video-parts", args, f"Extracted {len(frames)} frames from {hms(span[0])} "
                                 f"to {hms(span[1])}; they follow.", indices=frames, span=span))

    def _analyze(self, ctx: Context, args: dict) -> Pending:
        query = args.get("query")
        if not isinstance(query, str) or not query.strip():
            raise ToolFailure("needs query: what to find out")
        if args.get("start") is not None or args.get("end") is not None or not ctx.extracted:
            span = self._span(ctx, args.get("start"), args.get("end"), (0.0, ctx.video.info.duration))
            idx = uniform_indices(ctx.video.info, self.cfg.rough_frames, *span)
        else:
            idx = ctx.extracted[:self.cfg.fine_frames]
        q = Question(id="tool", video=ctx.question.video, task="open", text=query.strip())
        req = self._request(ctx, "fine", q, query, idx, self.cfg.fine_tokens)

        def finish(replies: list[Completion]) -> Observation:
            text = (replies[0].text if replies else "").strip()
            return Observation("analyze", args, text or "(the model returned nothing)", tool_frames=list(idx))

        return Pending([(self.vision_key("browser"), req)], finish)


def _positive(text: str) -> bool:
    """A clip judge's reply says the event occurs: an answer count above 0, or a yes."""
    m = re.search(r"##\s*answer\s*:\s*(.+)", text, re.IGNORECASE)
    value = (m.group(1) if m else text).strip().lower()
    num = re.search(r"\d+", value)
    if num:
        return int(num.group(0)) > 0
    return value.startswith("yes")
