"""The seed systems as agent kinds: Weaver, VideoZoomer and SAGE, single VLM policies in a tool loop.

An agent of `kind: weaver | zoomer | sage` is a team of one run by `m1.team.single` (the CPP engine keeps
`kind: cpp`). This module stays import-light; the kinds' tools and paper settings are m1/registry.py's
(configs validate against them there), re-exported here; the pieces live beside it:
`prompts` (system prompts and observation turns), `parsers` (each kind's syntax, strict then lenient),
`tools` (each kind's tools over the video, the vision model and CLIP). The rule-based policies that make the
kinds meaningful offline are M1-Synth's, in `m1/synth/seed_rules.py`.

Paper settings (`/work/shared/notes/seed-systems.md`): Weaver glances at 128 uniform frames, then its tools
return clips sampled at 1 fps, for at most 10 turns; VideoZoomer glances at 64 frames and may zoom 4 times,
each zoom at most 16 frames (5 turns with the answer); SAGE glances at 128 frames and answers at once or keeps
calling tools, for at most 11 turns.
"""
from __future__ import annotations

from dataclasses import dataclass

from m1.registry import (  # noqa: F401 (re-exported)
    DEFAULTS, KINDS, SAGE_TOOLS, SAGE_UNAVAILABLE, WEAVER_TOOLS, ZOOMER_TOOLS, KindDefaults,
)


@dataclass(frozen=True)
class KindSettings:
    """A kind's loop settings once the config's `seed_system` section is merged over the paper defaults."""

    kind: str
    tools: tuple[str, ...]
    glance_frames: int
    max_turns: int
    tool_fps: float
    max_tool_frames: int
    zoom_frames: int
    count_clips: int
    reply_tokens: int
    captioner: str | None = None  # the vision model that describes each frame for a text policy
    caption_tokens: int = 48


def settings_for(kind: str, section=None) -> KindSettings:
    """Merge a `SeedSystemConfig` (or None) over the defaults of `kind`."""
    if kind not in DEFAULTS:
        raise ValueError(f"agent kind {kind!r} has no single-agent loop (kinds: {list(KINDS)})")
    d = DEFAULTS[kind]

    def pick(name, default):
        value = getattr(section, name, None) if section is not None else None
        return default if value is None else value

    return KindSettings(kind=kind, tools=tuple(pick("tools", d.tools)),
                        glance_frames=int(pick("glance_frames", d.glance_frames)),
                        max_turns=int(pick("max_turns", d.max_turns)), tool_fps=float(pick("tool_fps", d.tool_fps)),
                        max_tool_frames=int(pick("max_tool_frames", 64)), zoom_frames=int(pick("zoom_frames", 16)),
                        count_clips=int(pick("count_clips", 8)), reply_tokens=int(pick("reply_tokens", 512)),
                        captioner=pick("captioner", None), caption_tokens=int(pick("caption_tokens", 48)))
