"""Which engine runs a team, by its kind: the one registry `make_team` (m1 infer, eval, serve, training) and the
trainer's `team_kind` (m1/marl/team_kinds.py) both read, so a new kind is one row here.

A team's kind is its agents' kind: `cpp` for a team of CPP agents, else its one seed-kind agent's (weaver, zoomer,
sage; m1/config.py refuses a seed-kind agent with teammates).
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from m1.config import TeamConfig
from m1.contracts import Team
from m1.kinds import KINDS
from m1.models.hub import ModelHub
from m1.team.cpp import Team as CppTeam
from m1.team.single import SingleAgentTeam
from m1.video import VideoPool


@dataclass(frozen=True)
class KindSpec:
    """A team kind: its name and the engine class that runs it (built as engine(cfg, hub=..., pool=...))."""

    name: str
    engine: Callable[..., Team]


TEAM_KINDS: dict[str, KindSpec] = {"cpp": KindSpec("cpp", CppTeam),
                                   **{k: KindSpec(k, SingleAgentTeam) for k in KINDS}}


def kind_of(cfg: TeamConfig) -> KindSpec:
    """The team's kind: its one seed-kind agent's, else cpp."""
    seeded = [a.kind for a in cfg.agents if a.kind != "cpp"]
    return TEAM_KINDS[seeded[0] if seeded else "cpp"]


def make_team(cfg: TeamConfig, hub: ModelHub | None = None, pool: VideoPool | None = None) -> Team:
    """The engine a team config asks for: the CPP Team for `kind: cpp` agents, the single-agent tool loop
    (m1/team/single.py) for a Weaver / VideoZoomer / SAGE agent."""
    shared = {k: v for k, v in (("hub", hub), ("pool", pool)) if v is not None}
    return kind_of(cfg).engine(cfg, **shared)
