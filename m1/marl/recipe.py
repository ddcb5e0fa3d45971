"""Training-step options of issue #39 ("MARL that beats SFT"): the topology schedule, dynamic sampling, plan entropy.

- `step_topology`: the step's communication DAG under `rollout.complete_share` / `rollout.anneal_share`, drawn
  from (seed, step) alone so a resumed run repeats it; at their defaults it is exactly the DAG the trainer always
  drew.
- `informative_groups` / `merge_batches`: dynamic sampling (DAPO; verl `filter_groups`, OpenRLHF
  `dynamic_filtering`). A group is one agent's K rollouts of one question; when its rewards all tie its GRPO
  advantages are all 0, so it only dilutes the step's loss. The trainer drops such groups and refills the step
  from the data cursor (m1/marl/trainer.py).
- `plan_entropy`: how spread the parsed plans (their tool sequences) are within each question family, a measure of
  how much the plan phase still explores (`rollout.plan_temperature` raises it).
"""
from __future__ import annotations

import math
import random
from collections import Counter, defaultdict
from collections.abc import Sequence

from m1.marl.learner import derive_seed
from m1.marl.rollout import RolloutBatch, sample_topology
from m1.schema import Topology


def topology_settings(rollout, step: int, steps: int) -> tuple[str, float, float]:
    """(mode, edge_prob, dropout) of step `step` (0-based) of `steps` under the rollout config's schedule.

    `anneal_share` s > 0 scales dropout and 1 - edge_prob by 1 - step / (s * steps): the DAG grows toward the
    complete graph, which every step from s * steps on uses (what evaluation runs)."""
    mode, edge_prob, dropout = rollout.topology, rollout.edge_prob, rollout.dropout
    if mode == "random" and rollout.anneal_share:
        left = max(0.0, 1.0 - step / (rollout.anneal_share * steps))
        if left == 0.0:
            return "complete", 1.0, 0.0
        edge_prob, dropout = 1.0 - (1.0 - edge_prob) * left, dropout * left
    return mode, edge_prob, dropout


def step_topology(agents: list[str], rollout, seed: int, step: int, steps: int, complete: bool = False) -> Topology:
    """The DAG of one training step. `complete`: always the complete graph (a seed-kind team of one).

    With `complete_share` p, a draw from (seed, step) alone picks the complete graph with probability p; the
    random DAG itself is drawn from its own (seed, step) stream as before, so switching the option on does not
    change which DAG a non-complete step gets."""
    mode, edge_prob, dropout = ("complete", 1.0, 0.0) if complete else topology_settings(rollout, step, steps)
    if mode == "random" and rollout.complete_share:
        if random.Random(derive_seed(seed, step, "complete_share")).random() < rollout.complete_share:
            mode = "complete"
    return sample_topology(agents, mode, edge_prob, dropout, random.Random(derive_seed(seed, step, "topology")))


# ------------------------------------------------------------------------------------------------ dynamic sampling
def _spread(values: Sequence[float]) -> bool:
    finite = [v for v in values if not math.isnan(v)]
    return len(finite) >= 2 and max(finite) > min(finite)


def informative_groups(rewards: dict[str, list[list[float]]],
                       outcomes: dict[str, list[list[float]]] | None = None) -> dict[str, list[bool | None]]:
    """Per agent and question: True when the group carries GRPO signal (two or more finite rewards that differ,
    or, with `outcomes` (credit: phase), outcomes that differ), False when it ties, None when the agent has no
    reward there at all (not its focus question under credit agent, or every episode failed)."""
    out: dict[str, list[bool | None]] = {}
    for agent, rows in rewards.items():
        flags: list[bool | None] = []
        for g, row in enumerate(rows):
            if all(math.isnan(v) for v in row):
                flags.append(None)
                continue
            flags.append(_spread(row) or (outcomes is not None and _spread(outcomes[agent][g])))
        out[agent] = flags
    return out


def merge_batches(parts: Sequence[tuple[RolloutBatch, Sequence[int]]]) -> RolloutBatch:
    """One batch of the kept questions (`(batch, question indices)` per round, in order), with their episodes,
    rewards, outcomes, breakdowns and focus agents; the topology is the step's (every round shares it)."""
    if not parts:
        raise ValueError("merge_batches: no rounds to merge")
    first = parts[0][0]
    merged = RolloutBatch(questions=[], episodes=[], topology=first.topology,
                          rewards={a: [] for a in first.rewards}, outcomes={a: [] for a in first.outcomes},
                          focus=[] if first.focus is not None else None)
    for batch, keep in parts:
        k = len(batch.episodes[0]) if batch.episodes else 0
        for g in keep:
            merged.questions.append(batch.questions[g])
            merged.episodes.append(batch.episodes[g])
            merged.breakdowns.extend(batch.breakdowns[g * k:(g + 1) * k])
            for a in merged.rewards:
                merged.rewards[a].append(batch.rewards[a][g])
            for a in merged.outcomes:
                merged.outcomes[a].append(batch.outcomes[a][g])
            if merged.focus is not None:
                merged.focus.append(batch.focus[g])
    return merged


# ------------------------------------------------------------------------------------------------ plan entropy
def family_of(question) -> str:
    """A question's family: the synth family in its metadata, else its task (as traces and reports name it)."""
    return str(question.meta.get("family") or question.task)


def entropy(counts: Counter) -> float:
    """Shannon entropy (nats) of the distribution the counts describe."""
    n = sum(counts.values())
    return -sum(c / n * math.log(c / n) for c in counts.values() if c) if n else 0.0


def plan_entropy(batches: Sequence[RolloutBatch], agents: Sequence[str], tools: Sequence[str]) -> dict[str, float]:
    """`plans/entropy/<family>`: the entropy of the parsed plans (tool sequences) the `agents` wrote in the step's
    episodes of that family, and `plans/entropy`, its mean over families. 0 when every plan is the same."""
    from m1.agents.parsers import parse_plan

    plans: dict[str, Counter] = defaultdict(Counter)
    for batch in batches:
        for ep in batch.flat:
            fam = family_of(ep.question)
            for gen in ep.generations:
                if gen.phase == "plan" and gen.agent in agents:
                    plans[fam][tuple(parse_plan(gen.completion, tools, question=ep.question).plan.tools)] += 1
    row = {f"plans/entropy/{fam}": entropy(c) for fam, c in sorted(plans.items())}
    if row:
        row["plans/entropy"] = sum(row.values()) / len(row)
    return row
