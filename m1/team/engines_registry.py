"""Which engine runs a team, by its kind: the one registry `make_team` (m1 infer, eval, serve, training) and the
trainer's `team_kind` (m1/marl/team_training.py) both read, so a new kind is one row here.

A team's kind is its agents' kind: m1/config.py makes a team's agents share one (`cpp` for the paper's agents) and
refuses a seed-kind agent (weaver, zoomer, sage, ...) with teammates.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from m1.config import TeamConfig
from m1.contracts import Team
from m1.registry import CPP, PLAN_KINDS, add_entry, is_seed, seed_kind_names
from m1.models.hub import ModelHub
from m1.team.cpp import Team as CppTeam
from m1.team.single import SingleAgentTeam
from m1.video import VideoPool


@dataclass(frozen=True)
class KindSpec:
    """A team kind: its name and the engine class that runs it (built as engine(cfg, hub=..., pool=...))."""

    name: str
    engine: Callable[..., Team]


# every seed kind runs in the single-agent loop (kind_of also finds one registered after this module loaded)
TEAM_KINDS: dict[str, KindSpec] = {CPP: KindSpec(CPP, CppTeam),
                                   **{k: KindSpec(k, SingleAgentTeam) for k in seed_kind_names()}}


def register_kind(spec: KindSpec) -> KindSpec:
    """Add a team kind whose agents plan with the registered tools (configs then accept `kind: <name>`); a seed
    kind is a SeedKindSpec instead (m1/registry.py register_seed_kind), run by the single-agent loop."""
    if is_seed(spec.name):
        raise ValueError(f"team kind {spec.name!r} is a seed kind, registered with register_seed_kind")
    if add_entry(TEAM_KINDS, spec.name, spec, "team kind"):
        PLAN_KINDS.append(spec.name)
    return spec


def kind_of(cfg: TeamConfig) -> KindSpec:
    """The team's kind: its agents' (config validation makes them share one)."""
    name = cfg.agents[0].kind
    if name not in TEAM_KINDS and is_seed(name):  # a seed kind registered after this module loaded
        return KindSpec(name, SingleAgentTeam)
    return TEAM_KINDS[name]


def make_team(cfg: TeamConfig, hub: ModelHub | None = None, pool: VideoPool | None = None) -> Team:
    """The engine a team config asks for: the CPP Team for `kind: cpp` agents, the single-agent tool loop
    (m1/team/single.py) for an agent of a seed kind (Weaver, VideoZoomer, SAGE, ...)."""
    shared = {k: v for k, v in (("hub", hub), ("pool", pool)) if v is not None}
    return kind_of(cfg).engine(cfg, **shared)
