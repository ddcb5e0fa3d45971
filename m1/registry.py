"""The names a config is validated against, kept at the bottom of the package so that m1/config.py imports nothing
above it: the paper's eight tools with their group (select sets the focus, browse reads it; re-exported by
m1/tools), and the seed-system kinds with their tools and paper settings (re-exported by m1/kinds, which runs them).

Plain data, no imports from m1 or beyond.
"""
from __future__ import annotations

from dataclasses import dataclass

SELECT_TOOLS = ["Global Sampling", "Video Retrieval", "Time Stamp Retrieval", "Image Retrieval"]
BROWSE_TOOLS = ["Rough Browser", "Fine Browser", "Space Tool", "Grounding Tool"]
TOOL_NAMES = {**{t: "select" for t in SELECT_TOOLS}, **{t: "browse" for t in BROWSE_TOOLS}}

KINDS = ("weaver", "zoomer", "sage")


@dataclass(frozen=True)
class KindDefaults:
    tools: tuple[str, ...]  # every tool the kind knows, in the order its prompt lists them
    glance_frames: int  # uniform frames of the first user turn
    max_turns: int  # policy turns, the answer turn included
    tool_fps: float  # frames per second inside the clips tools return (Weaver: 1 fps; SAGE extract: ours)


WEAVER_TOOLS = ("temporal_grounding", "frame_selection", "temporal_count", "trim", "spatial_tracking",
                "spatial_grounding")
ZOOMER_TOOLS = ("video_zoom",)
# SAGE's transcribe-speech, web-search and parse-website need audio or the web, which M1's videos and machines
# do not have; they are left out (a policy that names them gets an error observation).
SAGE_TOOLS = ("ground-event", "extract-video-parts", "analyze")
SAGE_UNAVAILABLE = ("transcribe-speech", "web-search", "parse-website")

DEFAULTS: dict[str, KindDefaults] = {
    "weaver": KindDefaults(WEAVER_TOOLS, glance_frames=128, max_turns=10, tool_fps=1.0),
    "zoomer": KindDefaults(ZOOMER_TOOLS, glance_frames=64, max_turns=5, tool_fps=1.0),
    "sage": KindDefaults(SAGE_TOOLS, glance_frames=128, max_turns=11, tool_fps=1.0),
}
