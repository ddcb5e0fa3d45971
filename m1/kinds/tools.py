"""The toolkit the seed kinds' tools are written with (each tool's code is in its kind's module, SeedKindSpec
`tool_code`), backed by what M1 has: frame sampling (m1/video/), the CLIP index (m1/tools/clip_index.py) and the
vision model of the browse tools (`tools.browser` / `grounding` / `space`).

Which of them stands in for which of the papers' models is in each kind's module.

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
from m1.kinds.settings import KindSettings
from m1.models.base import Completion, VisionRequest
from m1.registry import seed_kind
from m1.schema import Question
from m1.text import format_time, parse_span, parse_timestamp
from m1.video import VideoError, fps_indices, uniform_indices


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


def done(obs: Observation) -> Pending:
    """A call that needs no vision model: its observation as it stands."""
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
    """The tools of one kind for a run: `prepare` runs the kind's code for a call (SeedKindSpec `tool_code`, each
    `(toolkit, ctx, args) -> Pending`); the helpers below are what that code is written with. `settings` are the
    run's loop settings, `cfg` the team's ToolsConfig, `clip()` the CLIP index (None: none configured)."""

    def __init__(self, settings: KindSettings, tools_cfg, clip: Callable[[], object | None]):
        self.settings, self.cfg, self.clip = settings, tools_cfg, clip
        self.code = seed_kind(settings.kind).tool_code

    # ------------------------------------------------------------------ entry point
    def prepare(self, ctx: Context, name: str, args: dict) -> Pending:
        if name not in self.settings.tools:
            return done(Observation(name, args, "", error=f"{name} is not an available tool "
                                                           f"(available: {', '.join(self.settings.tools) or 'none'})"))
        try:
            return self.code[name](self, ctx, args)
        except (ToolFailure, VideoError, ValueError) as exc:
            return done(Observation(name, args, "", error=f"{name}: {exc}"))

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
        return fps_indices(ctx.video.info, fps or self.settings.tool_fps, s, e,
                           max_frames=self.settings.max_tool_frames)

    def window(self, ctx: Context, start, end, default: tuple[float, float]) -> tuple[float, float]:
        """A call's start and end (seconds or HH:MM:SS; `default` where left out), checked and kept in the video."""
        dur = ctx.video.info.duration
        s = _seconds(start, "start", default[0])
        e = _seconds(end, "end", default[1])
        if e < s:
            raise ToolFailure(f"end {format_time(e)} is before start {format_time(s)}")
        if s >= dur:
            raise ToolFailure(f"start {format_time(s)} is past the end of the video ({format_time(dur)})")
        return max(0.0, s), min(dur, e)

    def request(self, ctx: Context, kind: str, question: Question, focus: str, idx: list[int],
                tokens: int) -> VisionRequest:
        """A vision request of the browser prompt `kind` over the frames `idx`."""
        ts = ctx.video.timestamps(idx)
        return VisionRequest(frames=ctx.video.frames(idx), timestamps=ts,
                             prompt=browser_prompt(kind, question, focus, ts, tokens))

    def ground(self, ctx: Context, query: str, span: tuple[float, float],
               describe: Callable[[tuple[float, float] | None, list[int]], Observation]) -> Pending:
        """Ask the grounding VLM when `query` happens inside `span`; `describe` turns the span into an observation."""
        thing = object_phrase(query)
        q = Question(id="tool", video=ctx.question.video, task="grounding",
                     text=f"When does the {thing} appear? Give [start - end] in seconds.")
        s, e = span
        idx = fps_indices(ctx.video.info, self.cfg.grounding_fps, s, e, max_frames=self.cfg.grounding_max_frames)
        req = self.request(ctx, "grounding", q, query, idx, self.cfg.grounding_tokens)

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
