"""Browsing tools: a VLM reads the frames of the agent's focus and writes a summary.

Each browse call is split in two so the engine can batch every agent's request to the same
vision model into one call: `prepare` builds the VisionRequest, `finish` reads the reply.
"""
from __future__ import annotations

import re

import numpy as np

from m1.agents.prompts import browser_prompt
from m1.models.base import Completion, VisionRequest
from m1.registry import FINE_BROWSER, GROUNDING_TOOL, ROUGH_BROWSER, SPACE_TOOL, TOOLS
from m1.text import format_span, parse_span
from m1.tools.base import Focus, ToolContext, ToolResult
from m1.video import fps_indices, uniform_indices


# The prompt kind of each browse tool (m1/agents/prompts.py BROWSER_KINDS); the rest of its spec is in the registry.
KIND = {ROUGH_BROWSER.name: "rough", FINE_BROWSER.name: "fine", SPACE_TOOL.name: "space",
        GROUNDING_TOOL.name: "grounding"}


def _subsample(values: list[int], n: int) -> list[int]:
    if len(values) <= n:
        return list(values)
    pos = (np.linspace(0, len(values), n, endpoint=False) + len(values) / (2 * n)).astype(int)
    return [values[p] for p in pos]


def frames_for(tool: str, ctx: ToolContext, focus: Focus) -> list[int]:
    """Which frames a browser reads: Rough 16 of the focus; Fine 32 over the focused span (or
    the retrieved frames themselves when the focus is a scattered set); Space 16 over the span;
    Grounding `grounding_fps` over the span (capped)."""
    info, cfg, (s, e) = ctx.video.info, ctx.cfg, focus.span
    kind = KIND[tool]
    if kind == "rough":
        return _subsample(focus.indices, cfg.rough_frames)
    if focus.scattered and kind in ("fine", "space"):
        return _subsample(focus.indices, cfg.fine_frames if kind == "fine" else cfg.space_frames)
    if kind == "fine":
        return uniform_indices(info, cfg.fine_frames, s, e) if e > s else list(focus.indices)
    if kind == "space":
        return uniform_indices(info, cfg.space_frames, s, e) if e > s else list(focus.indices)
    return fps_indices(info, cfg.grounding_fps, s, e, max_frames=cfg.grounding_max_frames) if e > s \
        else list(focus.indices)


def max_tokens(tool: str, ctx: ToolContext) -> int:
    return getattr(ctx.cfg, TOOLS[tool].tokens_attr)


def prepare(tool: str, ctx: ToolContext, focus: Focus) -> tuple[VisionRequest, list[int]]:
    idx = frames_for(tool, ctx, focus)
    ts = ctx.video.timestamps(idx)
    prompt = browser_prompt(KIND[tool], ctx.question, ctx.key_info, ts, max_tokens(tool, ctx))
    return VisionRequest(frames=ctx.video.frames(idx), timestamps=ts, prompt=prompt), idx


_ANSWER = re.compile(r"##\s*answer\s*:\s*(.+)", re.IGNORECASE)
_TIMESTAMP = re.compile(r"##\s*timestamps?\s*:\s*(.+)", re.IGNORECASE)


def finish(tool: str, ctx: ToolContext, focus: Focus, completion: Completion, idx: list[int]) -> ToolResult:
    """Keep the summary; pull out an answer line and, for grounding, a span in video time.

    A VLM given a clip may count time from the clip's start: a span that fits inside
    [0, clip length] but not inside the clip is shifted by the clip's start."""
    text = completion.text.strip()
    m = _ANSWER.search(text)
    answer = m.group(1).strip()[:200] if m else None
    span = None
    if KIND[tool] == "grounding":  # the span comes from the ##Timestamp line, not from times in the prose
        stamp = _TIMESTAMP.search(text)
        span = parse_span(stamp.group(1)) if stamp else None
        s0, e0 = focus.span
        if span and not (s0 - 1e-6 <= span[0] and span[1] <= e0 + 1e-6) and span[1] <= (e0 - s0) + 1e-6:
            span = (span[0] + s0, span[1] + s0)
        if span:
            answer = format_span((round(span[0], 1), round(span[1], 1)))
    return ToolResult(output=text or "(the browser returned nothing)", answer=answer, span=span, frames=idx,
                      error=None if text else "empty browser reply")
