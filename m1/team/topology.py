"""Who reads whom: the complete graph at inference, a random DAG with agent dropout in training.

An edge (a, b) means agent b sees agent a's memory. A dropped agent still plans, executes and
answers, but alone: it has no edges in or out for that step (the paper's agent dropout).
"""
from __future__ import annotations

import random

from m1.config import TopologyConfig
from m1.schema import Topology


def complete(agents: list[str]) -> Topology:
    edges = [(a, b) for a in agents for b in agents if a != b]
    return Topology(agents=list(agents), active=list(agents), edges=edges)


def random_dag(agents: list[str], edge_prob: float, dropout: float, rng: random.Random) -> Topology:
    """Order the agents at random, keep each forward edge with `edge_prob`, drop each agent
    with `dropout` (at least one agent always stays active)."""
    order = list(agents)
    rng.shuffle(order)
    active = [a for a in order if rng.random() >= dropout] or [rng.choice(order)]
    edges = [(a, b) for i, a in enumerate(order) for b in order[i + 1:]
             if a in active and b in active and rng.random() < edge_prob]
    keep = set(active)
    return Topology(agents=list(agents), active=[a for a in agents if a in keep], edges=edges)


def sample(agents: list[str], cfg: TopologyConfig, rng: random.Random) -> Topology:
    if cfg.mode == "complete":
        return complete(agents)
    return random_dag(agents, cfg.edge_prob, cfg.dropout, rng)
