"""The names a config is validated against, kept at the bottom of the package so that m1/config.py imports nothing
above it: the tools agents plan with (`TOOLS`, one `ToolSpec` each, the paper's eight registered here; everything
else that names a tool reads it from here), the planning kinds, and the seed kinds (`SEED_KINDS`, one
`SeedKindSpec` each, registered by the module that writes the kind: m1/kinds/weaver.py, zoomer.py, sage.py).

No imports from m1: m1/config.py validates against it, so it sits below everything else.
"""
from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar

S = TypeVar("S")


def add_entry(table: dict[str, S], name: str, spec: S, what: str) -> bool:
    """Put `spec` in `table` under `name`, the one rule every registry of M1 follows: True when it is new, False
    when that same spec is there already (registering twice, e.g. a module imported again, is a no-op); another
    spec under a taken name is a ValueError that `what` names ("tool", "seed kind", "policy objective")."""
    if name in table:
        if table[name] == spec:
            return False
        raise ValueError(f"{what} {name!r} is already registered with other settings")
    table[name] = spec
    return True


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
    if add_entry(TOOLS, spec.name, spec, "tool"):
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
CPP = "cpp"  # the paper's policy agents, run by the CPP engine (m1/team/cpp.py)
# Kinds whose agents plan with TOOLS, CPP first; m1/team/engines_registry.py register_kind adds to it (mutated
# in place).
PLAN_KINDS: list[str] = [CPP]


@dataclass(frozen=True)
class SeedKindSpec:
    """A seed system as an agent kind (one policy in a tool loop, m1/team/single.py): the one place all of it is
    written. M1's three are m1/kinds/weaver.py, zoomer.py and sage.py; the loop, the trainer and M1-Synth read
    their pieces from here. The callables are typed loosely because their argument types live above this module;
    the comments give their signatures."""

    name: str  # as a config writes it (`kind: <name>`)
    tools: tuple[str, ...]  # every tool the kind knows, in the order its prompt lists them
    tool_code: Mapping[str, Callable[..., Any]]  # tool -> (m1.kinds.tools.SeedTools, Context, args) -> Pending
    # paper settings: what an unset `seed_system` field of m1/config.py takes
    glance_frames: int  # uniform frames of the first user turn
    max_turns: int  # policy turns, the answer turn included
    tool_fps: float  # frames per second inside the clips tools return
    system: Callable[..., str]  # (m1.kinds.settings.KindSettings) -> the system prompt
    ask: str  # the line after the question in the first user turn
    last_turn: str  # added to the last user turn: no tools are left, answer now
    parse: Callable[..., Any]  # (reply text, Question, enabled tools) -> m1.kinds.parsers.SeedReply, never raising
    # reward (m1/marl/reward/rewards.py seed_reward): weights of (correct, every turn strict, a tool used and right),
    # and an extra term (Episode, agent, tool calls) -> float added to the total and logged as `step`
    reward_weights: tuple[float, float, float]
    reward_extra: Callable[..., float] | None = None
    # M1-Synth's rule-based policy (m1/kinds/rules.py Chat) -> (reply, ChatEvidence...), and the strings its system
    # prompt holds, by which the synth backend tells a chat of this kind (a later kind's are tried first)
    rules: Callable[..., Any] | None = None
    marks: tuple[str, ...] = ()
    # (system prompt) -> the tools it offers, as the rule policy reads them; None: its "- name: " lines
    offered_tools: Callable[[str], list[str]] | None = None
    unavailable: Mapping[str, str] = field(default_factory=dict)  # a paper tool M1 cannot run -> why (config errors)
    # the `seed_system` settings its chats are written with in the tiny tokenizer's `seed_kinds` corpus
    # (m1/synth/corpus.py); None: not in it. That corpus is cached by its version alone (m1/models/tiny.py
    # CORPUS_VERSIONS), so setting or changing this needs a version bump.
    corpus_loop: Mapping[str, Any] | None = None


SEED_KINDS: dict[str, SeedKindSpec] = {}  # name -> spec, in registration order (mutated in place)
# The package whose import registers M1's own seed kinds. It sits above this module, so it is imported by name on
# the first look-up (as m1/models/tiny.py finds its corpora): m1/config.py can then check `kind: weaver` without
# importing upward.
SHIPPED_SEED_KINDS = "m1.kinds"
_shipped_loaded = False


def seed_kinds() -> dict[str, SeedKindSpec]:
    """Every registered seed kind, M1's own first."""
    global _shipped_loaded
    if not _shipped_loaded:
        _shipped_loaded = True
        importlib.import_module(SHIPPED_SEED_KINDS)
    return SEED_KINDS


def register_seed_kind(spec: SeedKindSpec) -> SeedKindSpec:
    """Add a seed kind (configs then accept `kind: <name>`; make_team runs it in the single-agent loop)."""
    if spec.name in PLAN_KINDS:
        raise ValueError(f"seed kind {spec.name!r}: already a planning kind")
    missing = [t for t in spec.tools if t not in spec.tool_code]
    if missing:
        raise ValueError(f"seed kind {spec.name!r}: tools without code: {missing}")
    add_entry(SEED_KINDS, spec.name, spec, "seed kind")
    return spec


def seed_kind(name: str) -> SeedKindSpec:
    """The spec of a registered seed kind (ValueError naming the known ones otherwise)."""
    known = seed_kinds()
    if name not in known:
        raise ValueError(f"{name!r} is not a seed kind (seed kinds: {list(known)})")
    return known[name]


def seed_kind_names() -> tuple[str, ...]:
    """The seed kinds' names, in registration order."""
    return tuple(seed_kinds())


def is_seed(kind: str) -> bool:
    """Whether agents of this kind are a seed system's policy (a team of one) rather than planning agents."""
    return kind in seed_kinds()


def agent_kinds() -> list[str]:
    """The kinds an agent may have, as configs validate them."""
    return [*PLAN_KINDS, *seed_kinds()]
