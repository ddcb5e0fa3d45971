"""The names a config is validated against, kept at the bottom of the package so that m1/config.py imports nothing
above it: the tools agents plan with (`TOOLS`, one `ToolSpec` each, the paper's eight registered here; everything
else that names a tool reads it from here), and the seed-system kinds with their tools and paper settings
(re-exported by m1/kinds, which runs them).

Plain data, no imports from m1 or beyond.
"""
from __future__ import annotations

from dataclasses import dataclass

TOOL_GROUPS = ("select", "browse")  # select sets the focus, browse reads it


@dataclass(frozen=True)
class ToolSpec:
    """One tool: the one place its name and the settings that depend on it are written. Its implementation stays
    in m1/tools (select.SELECT, browse.KIND), looked up by name."""

    name: str  # as agents write it in a plan
    group: str  # one of TOOL_GROUPS
    short: str  # its abbreviation in compact rows and reports ("VR+FB")
    blurb: str  # its line in the plan prompt's tool menu
    aliases: tuple[str, ...] = ()  # loose spellings the parsers accept (lower case, letters and digits)
    model_attr: str | None = None  # ToolsConfig field naming its vision model (browse tools); unset: tools.browser
    clip: bool = False  # needs the CLIP embedder (tools.clip)
    tokens_attr: str | None = None  # ToolsConfig field of its answer's new-token budget

    def vision_model(self, tools) -> str | None:
        """The model key this tool's vision model resolves to in a ToolsConfig (None: it uses none)."""
        if self.model_attr is None:
            return None
        return getattr(tools, self.model_attr) or tools.browser


TOOLS: dict[str, ToolSpec] = {}
# Views kept in step by register_tool (mutated in place, so that importers see later registrations).
TOOL_NAMES: dict[str, str] = {}  # name -> group
SELECT_TOOLS: list[str] = []
BROWSE_TOOLS: list[str] = []


def register_tool(spec: ToolSpec) -> ToolSpec:
    """Add a tool to the registry (config validation, parsers, prompts and preflight then know it)."""
    if spec.group not in TOOL_GROUPS:
        raise ValueError(f"tool {spec.name!r}: unknown group {spec.group!r} (known: {list(TOOL_GROUPS)})")
    if spec.name in TOOLS:
        if TOOLS[spec.name] == spec:
            return spec
        raise ValueError(f"tool {spec.name!r} is already registered with other settings")
    TOOLS[spec.name] = spec
    TOOL_NAMES[spec.name] = spec.group
    (SELECT_TOOLS if spec.group == "select" else BROWSE_TOOLS).append(spec.name)
    return spec


GLOBAL_SAMPLING = register_tool(ToolSpec(
    "Global Sampling", "select", "GS",
    "takes frames at even intervals over the whole video; for questions about the video as a whole.",
    aliases=("uniformsampling", "uniform", "global", "globalsample")))
VIDEO_RETRIEVAL = register_tool(ToolSpec(
    "Video Retrieval", "select", "VR",
    "cuts the video into equal clips and keeps the clip that best matches the key info; "
    "for finding where an event, action or object appears.",
    aliases=("clipretrieval",), clip=True))
TIME_STAMP_RETRIEVAL = register_tool(ToolSpec(
    "Time Stamp Retrieval", "select", "TSR",
    "takes the minute of video around a time written in the question (like 'at 02:15'); "
    "only useful when such a time is given.",
    aliases=("timeretrieval", "timestamp")))
IMAGE_RETRIEVAL = register_tool(ToolSpec(
    "Image Retrieval", "select", "IR",
    "scores single frames against the key info and keeps the best-matching ones; "
    "for small objects, still scenes or what a person looks like.",
    aliases=("frameretrieval",), clip=True))
ROUGH_BROWSER = register_tool(ToolSpec(
    "Rough Browser", "browse", "RB",
    "a vision model reads a sparse set of the selected frames and writes a short summary; "
    "enough for most questions.",
    aliases=("roughbrowse", "roughbrowsing"), model_attr="browser", tokens_attr="rough_tokens"))
FINE_BROWSER = register_tool(ToolSpec(
    "Fine Browser", "browse", "FB",
    "a vision model reads a dense run of frames from the selected clip; slower, keep it for "
    "fine detail such as small text or quick motion.",
    aliases=("finebrowse", "finebrowsing"), model_attr="browser", tokens_attr="fine_tokens"))
SPACE_TOOL = register_tool(ToolSpec(
    "Space Tool", "browse", "ST",
    "a vision model works out where objects are relative to one another; for questions on "
    "position, direction, distance or layout.",
    aliases=("space", "spatial", "spatialtool"), model_attr="space", tokens_attr="space_tokens"))
GROUNDING_TOOL = register_tool(ToolSpec(
    "Grounding Tool", "browse", "GT",
    "a vision model finds when a described moment starts and ends; for questions whose "
    "answer is a time span.",
    aliases=("grounding", "temporalgrounding"), model_attr="grounding", tokens_attr="grounding_tokens"))

# The paper's eight, in this order: what a config enables by default, and the tiny tokenizer's vocabulary (cached
# by content, so tools registered later must not change it).
PAPER_TOOLS: tuple[str, ...] = tuple(TOOLS)


def vision_model_attrs() -> tuple[str, ...]:
    """The ToolsConfig fields that name a tool's vision model, the fallback `browser` first."""
    return tuple(dict.fromkeys(["browser"] + [s.model_attr for s in TOOLS.values() if s.model_attr]))


# ------------------------------------------------------------------------------------------------ agent kinds
# Every module that branches on an agent kind reads these names; per-kind behaviour (prompts, parsers, rewards,
# synth rules) sits in tables keyed by them next to the functions (m1/kinds, m1/marl/rewards.py, m1/synth).
CPP = "cpp"  # the paper's policy agents, run by the CPP engine (m1/team/cpp.py)
WEAVER, ZOOMER, SAGE = "weaver", "zoomer", "sage"
KINDS = (WEAVER, ZOOMER, SAGE)  # the seed systems: one policy in a tool loop (m1/team/single.py)
# Kinds whose agents plan with TOOLS, CPP first; m1/team/kinds.py register_kind adds to it (mutated in place).
PLAN_KINDS: list[str] = [CPP]


def is_seed(kind: str) -> bool:
    """Whether agents of this kind are a seed system's policy (a team of one) rather than planning agents."""
    return kind in DEFAULTS


def agent_kinds() -> list[str]:
    """The kinds an agent may have, as configs validate them."""
    return [*PLAN_KINDS, *KINDS]


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
    WEAVER: KindDefaults(WEAVER_TOOLS, glance_frames=128, max_turns=10, tool_fps=1.0),
    ZOOMER: KindDefaults(ZOOMER_TOOLS, glance_frames=64, max_turns=5, tool_fps=1.0),
    SAGE: KindDefaults(SAGE_TOOLS, glance_frames=128, max_turns=11, tool_fps=1.0),
}
