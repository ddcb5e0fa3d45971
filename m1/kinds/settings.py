"""A seed kind's loop settings for one run: the config's `seed_system` section over the kind's paper settings."""
from __future__ import annotations

from dataclasses import dataclass

from m1.config import SeedSystemConfig
from m1.registry import is_seed, seed_kind, seed_kind_names

# The settings each kind gives a value of its own (SeedKindSpec); the others take SeedSystemConfig's defaults.
PAPER_SETTINGS = ("tools", "glance_frames", "max_turns", "tool_fps")


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


def settings_for(kind: str, section: SeedSystemConfig | None = None) -> KindSettings:
    """Merge a `SeedSystemConfig` (or None: every default) over the paper settings of `kind`."""
    if not is_seed(kind):
        raise ValueError(f"agent kind {kind!r} has no single-agent loop (kinds: {list(seed_kind_names())})")
    spec = seed_kind(kind)
    section = section if section is not None else SeedSystemConfig()

    def pick(name: str):
        value = getattr(section, name)
        return getattr(spec, name) if value is None and name in PAPER_SETTINGS else value

    return KindSettings(kind=kind, tools=tuple(pick("tools")), glance_frames=int(pick("glance_frames")),
                        max_turns=int(pick("max_turns")), tool_fps=float(pick("tool_fps")),
                        max_tool_frames=int(pick("max_tool_frames")), zoom_frames=int(pick("zoom_frames")),
                        count_clips=int(pick("count_clips")), reply_tokens=int(pick("reply_tokens")),
                        captioner=pick("captioner"), caption_tokens=int(pick("caption_tokens")))
