"""Advantage estimators: what a rollout's reward is compared with (`grpo.baseline`), one registered entry each.

An estimator receives one agent's rewards as a `[G, K]` tensor, row g the K rollouts of question g (its group; NaN
marks a missing sample: an agent dropped from a rollout, or not credited there), the reward of one greedy run of
each question `[G]` when it asks for that run (`greedy_reference`, else None), and its own settings; it returns the
`[G, K]` advantages, 0 where a sample is missing. Shipped:

- `group` (GRPO): ``(r - mean_g) / (std_g + 1e-4)`` with the Bessel-corrected std of the group, or ``r - mean_g``
  with `grpo.scale_rewards: false` (Dr. GRPO); groups of one sample or without spread give exactly 0;
- `greedy` (ours, after ReMax): ``r - r_greedy``, the reward of one untrained greedy run of the question;
- `rloo` (REINFORCE leave-one-out): ``r_i - mean_{j != i} r_j`` over the group's present samples;
- `reinforce_pp` (REINFORCE++, token level): each token's return is the sequence value discounted by `grpo.gamma`
  per generated token of the agent between it and the end of its episode (its later replies included), and the
  returns are whitened over all the agent's tokens of the step;
- `gigpo` (GiGPO's anchor-state groups, Feng et al. 2025; per reply): the episode's `group` advantage plus
  `grpo.step_weight` times a step advantage: a reply's reward against the other replies of the question's
  rollouts written from the same state (the same agent, phase and prompt: the same notes before the same
  decision), so where the K rollouts reach one state and decide differently there, the decisions are compared.

A token-level estimator also gives `tokens(samples, settings)`: one agent's samples of the step, which carry the
`[G, K]` value of `estimate` as `advantage`, in, and one list of advantages per sample (one per completion token)
out; the loss then uses those (`Sample.token_advantages`).

An estimator states in `requires` / `refuses` what it cannot be combined with (m1/marl/entries.py); the config's
validator reads them. A new one is `register_estimator(AdvantageEstimator(name=..., estimate=...))`;
`grpo.baseline` accepts any registered name. torch is imported inside the functions.
"""
from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from m1.marl.entries import Entry, Rule
from m1.registry import add_entry

if TYPE_CHECKING:
    import torch

    from m1.marl.rollout.episodes import Sample

ADV_EPS = 1e-4  # TRL adds this to the group std


# --------------------------------------------------------------------------------------------- the numerics


def _as_reward_tensor(rewards: Any) -> "torch.Tensor":
    import torch

    if isinstance(rewards, torch.Tensor):
        out = rewards.detach()
        if not out.is_floating_point():
            out = out.to(torch.float32)
        return out
    try:
        return torch.tensor(rewards, dtype=torch.float32)
    except (TypeError, ValueError) as exc:
        raise ValueError(
            f"rewards must be a tensor or a rectangular list of numbers (use NaN for missing samples), got {rewards!r}"
        ) from exc


def group_advantages(rewards: Any, eps: float = ADV_EPS, scale: bool = True) -> "torch.Tensor":
    """Group-relative advantages ``(r - mean) / (std + eps)`` along the last axis.

    ``rewards`` is ``[G, K]`` (G questions x K rollouts for one agent) or ``[K]`` (one group); the result has the
    same shape. ``std`` is Bessel-corrected as in TRL (``torch.std`` default). ``scale=False`` gives ``r - mean``
    (Dr. GRPO / TRL ``scale_rewards="none"``). NaN marks a missing sample: it is ignored in mean/std and its
    advantage is 0. A group with fewer than two samples or zero spread yields exactly 0 (TRL's std is NaN for a
    single sample and verl would return ``A = r``; a single rollout carries no relative signal, so we choose 0).
    """
    import torch

    if eps < 0:
        raise ValueError(f"group_advantages: eps must be >= 0, got {eps}")
    r = _as_reward_tensor(rewards)
    if r.dim() not in (1, 2):
        raise ValueError(f"group_advantages: rewards must have shape [K] or [G, K], got {tuple(r.shape)}")
    if r.numel() == 0:
        return r.clone()
    squeeze = r.dim() == 1
    if squeeze:
        r = r.unsqueeze(0)
    present = ~torch.isnan(r)
    count = present.sum(dim=-1, keepdim=True)
    filled = torch.where(present, r, torch.zeros_like(r))
    mean = filled.sum(dim=-1, keepdim=True) / count.clamp(min=1)
    centered = torch.where(present, r - mean, torch.zeros_like(r))
    adv = centered
    if scale:
        var = (centered**2).sum(dim=-1, keepdim=True) / (count - 1).clamp(min=1)
        adv = centered / (var.sqrt() + eps)
    # Singleton groups and groups without spread carry no signal; force exact zeros so that rounding in the mean
    # (e.g. three rewards of 0.1) cannot leak a tiny residual divided by eps into the loss.
    adv = torch.where(_informative(r, present), adv, torch.zeros_like(adv))
    return adv.squeeze(0) if squeeze else adv


def _informative(r: "torch.Tensor", present: "torch.Tensor") -> "torch.Tensor":
    """[G, K]: the present samples of groups with two or more present samples that differ."""
    import torch

    count = present.sum(dim=-1, keepdim=True)
    hi = torch.where(present, r, torch.full_like(r, -math.inf)).amax(dim=-1, keepdim=True)
    lo = torch.where(present, r, torch.full_like(r, math.inf)).amin(dim=-1, keepdim=True)
    return present & (count > 1) & (hi > lo)


def missing_as_zero(rewards: Any) -> "torch.Tensor":
    """The rewards themselves, 0 where a sample is missing: REINFORCE++'s sequence value before its tokens."""
    import torch

    return torch.nan_to_num(_as_reward_tensor(rewards), nan=0.0)


def baseline_advantages(rewards: Any, baseline: Any) -> "torch.Tensor":
    """Advantages ``r - b`` of ``[G, K]`` rewards against one baseline per group ``[G]`` (ours, after ReMax: the
    reward of the question's greedy run, so a sample is pushed up only when it beats greedy decoding). NaN in a
    reward or in its group's baseline gives 0."""
    import torch

    r, b = _as_reward_tensor(rewards), _as_reward_tensor(baseline)
    if r.dim() != 2 or b.shape != r.shape[:1]:
        raise ValueError(f"baseline_advantages: rewards must be [G, K] and the baseline [G], got "
                         f"{tuple(r.shape)} and {tuple(b.shape)}")
    adv = r - b.unsqueeze(-1)
    return torch.where(torch.isnan(adv), torch.zeros_like(adv), adv)


def rloo_advantages(rewards: Any) -> "torch.Tensor":
    """Leave-one-out advantages ``r_i - mean_{j != i} r_j`` of ``[G, K]`` rewards, over each group's present
    (non-NaN) samples: ``n / (n - 1) * (r_i - mean)`` for a group of n. A missing sample, a group of fewer than two
    present samples and a group without spread give exactly 0 (as `group_advantages`)."""
    import torch

    r = _as_reward_tensor(rewards)
    if r.dim() != 2:
        raise ValueError(f"rloo_advantages: rewards must be [G, K], got {tuple(r.shape)}")
    present = ~torch.isnan(r)
    filled = torch.where(present, r, torch.zeros_like(r))
    count = present.sum(dim=-1, keepdim=True)
    others = (filled.sum(dim=-1, keepdim=True) - filled) / (count - 1).clamp(min=1)
    return torch.where(_informative(r, present), r - others, torch.zeros_like(r))


def discounted_token_advantages(samples: Sequence["Sample"], gamma: float, eps: float = 1e-8) -> list[list[float]]:
    """REINFORCE++'s token advantages of one agent's samples: token t of a reply gets ``gamma**n * value``, n the
    agent's generated tokens after t in its episode (rollout (group, k); the value is its reply's `advantage`), and
    the returns are whitened over all the samples' tokens ``(x - mean) / sqrt(var + eps)``, var Bessel-corrected
    (verl's masked_whiten). Fewer than two tokens, or returns without spread, give zeros."""
    import torch

    later: dict[tuple[int, int], int] = {}  # tokens the episode's later replies hold, walking back from its end
    returns: list[list[float]] = [[] for _ in samples]
    for i in range(len(samples) - 1, -1, -1):
        s = samples[i]
        key, n = (s.group, s.rollout), len(s.completion_ids)
        after = later.get(key, 0)
        returns[i] = [gamma ** (after + n - 1 - t) * s.advantage for t in range(n)]
        later[key] = after + n
    flat = torch.tensor([x for r in returns for x in r], dtype=torch.float64)
    if flat.numel() < 2 or float(flat.max() - flat.min()) == 0.0:
        return [[0.0] * len(r) for r in returns]
    white = ((flat - flat.mean()) / torch.sqrt(flat.var(unbiased=True) + eps)).tolist()
    out, at = [], 0
    for r in returns:
        out.append(white[at:at + len(r)])
        at += len(r)
    return out


def anchor_state_advantages(samples: Sequence["Sample"], weight: float, scale: bool) -> list[list[float]]:
    """GiGPO's advantages of one agent's samples, one list per sample with its value on every completion token:
    the sample's episode advantage (`advantage`) plus `weight` times its step advantage, `group_advantages` of the
    rewards of the samples sharing its question, phase and prompt ids (its anchor state) across the rollouts. A
    state that one rollout alone reached, or whose rewards tie, adds 0; at a question's first decision every
    rollout shares the state, so there the step advantage repeats the episode's."""
    import torch

    states: dict[tuple[int, str, tuple[int, ...]], list[int]] = {}
    for i, s in enumerate(samples):
        states.setdefault((s.group, s.phase, tuple(s.prompt_ids)), []).append(i)
    step = [0.0] * len(samples)
    for members in states.values():  # a state is reached at most once per rollout; one reply alone gets 0
        rewards = torch.tensor([samples[i].reward for i in members], dtype=torch.float32)
        for i, a in zip(members, group_advantages(rewards, scale=scale).tolist()):
            step[i] = a
    return [[s.advantage + weight * step[i]] * len(s.completion_ids) for i, s in enumerate(samples)]


# --------------------------------------------------------------------------------------------- the registry


@dataclass(frozen=True, kw_only=True)
class AdvantageEstimator(Entry):
    """A registered `grpo.baseline`: `estimate(rewards [G, K], reference [G] | None, settings) -> [G, K]`."""

    estimate: Callable[..., "torch.Tensor"]
    greedy_reference: bool = False  # run each question once greedily (not trained on); its reward is `reference`
    tokens: Callable[..., list[list[float]]] | None = None  # token level: (one agent's samples, settings) -> per token


ESTIMATORS: dict[str, AdvantageEstimator] = {}


def register_estimator(estimator: AdvantageEstimator) -> AdvantageEstimator:
    """Make `estimator` selectable as `grpo.baseline: <name>`."""
    add_entry(ESTIMATORS, estimator.name, estimator, "advantage estimator")
    return estimator


def estimate_advantages(estimator: AdvantageEstimator, rewards: Mapping[str, Any],
                        reference: Mapping[str, Any] | None, grpo: Any) -> dict[str, "torch.Tensor"]:
    """Per-agent advantages: each agent's ``[G, K]`` rewards against its own groups only. `reference` is agent ->
    the greedy run's ``[G][1]`` rewards (its episodes, one per question), given when the estimator asks for it."""
    if not isinstance(rewards, Mapping):
        raise ValueError(f"estimate_advantages: expected a mapping agent -> rewards, got {type(rewards).__name__}")
    if estimator.greedy_reference and reference is None:
        raise ValueError(f"advantage estimator {estimator.name!r} needs the greedy run's rewards")
    settings = estimator.own_settings(grpo)
    out = {}
    for agent, r in rewards.items():
        ref = _as_reward_tensor([g[0] for g in reference[agent]]) if estimator.greedy_reference else None
        out[agent] = estimator.estimate(_as_reward_tensor(r), ref, settings)
    return out


def token_advantages(estimator: AdvantageEstimator, samples: Mapping[str, list["Sample"]],
                     grpo: Any) -> dict[str, list["Sample"]]:
    """Each agent's samples with the token-level estimator's advantages (`token_advantages`, one per completion
    token; `advantage` keeps the sequence's value). An estimator returning a list of the wrong shape is an error
    naming it."""
    from dataclasses import replace

    settings, out = estimator.own_settings(grpo), {}
    for agent, rows in samples.items():
        values = estimator.tokens(list(rows), settings)
        if len(values) != len(rows) or any(len(v) != len(s.completion_ids) for v, s in zip(values, rows)):
            raise ValueError(f"advantage estimator {estimator.name!r}: tokens() must return one list per sample, "
                             f"one value per completion token (agent {agent!r}, {len(rows)} samples)")
        out[agent] = [replace(s, token_advantages=[float(x) for x in v]) for s, v in zip(rows, values)]
    return out


def _unscaled(why: str) -> Rule:
    return Rule("grpo.scale_rewards", bool, f"{why}; set grpo.scale_rewards: false")


GROUP = register_estimator(AdvantageEstimator(
    name="group", settings=("scale_rewards",),
    estimate=lambda rewards, reference, s: group_advantages(rewards, scale=s.scale_rewards)))
GREEDY = register_estimator(AdvantageEstimator(
    name="greedy", greedy_reference=True,
    estimate=lambda rewards, reference, s: baseline_advantages(rewards, reference),
    refuses=(_unscaled("it takes rewards minus the greedy run's, unscaled"),
             Rule("rollout.dynamic_sampling", bool,
                  "dynamic sampling drops groups whose K rewards tie, but against the greedy run such a group still "
                  "has signal (rewards minus the greedy run's); use one"))))
RLOO = register_estimator(AdvantageEstimator(
    name="rloo", estimate=lambda rewards, reference, s: rloo_advantages(rewards),
    refuses=(_unscaled("it takes rewards minus the mean of the group's other samples, unscaled"),)))
REINFORCE_PP = register_estimator(AdvantageEstimator(
    name="reinforce_pp", settings=("gamma",),
    estimate=lambda rewards, reference, s: missing_as_zero(rewards),
    tokens=lambda samples, s: discounted_token_advantages(samples, s.gamma),
    refuses=(Rule("rollout.dynamic_sampling", bool,
                  "its baseline is the step's whole batch of tokens, not a question's group, so a group whose K "
                  "rewards tie still carries signal; leave dynamic sampling off"),)))

GIGPO = register_estimator(AdvantageEstimator(
    name="gigpo", settings=("scale_rewards", "step_weight"),
    estimate=lambda rewards, reference, s: group_advantages(rewards, scale=s.scale_rewards),
    tokens=lambda samples, s: anchor_state_advantages(samples, s.step_weight, s.scale_rewards)))


__all__: Sequence[str] = (
    "ADV_EPS", "ESTIMATORS", "AdvantageEstimator", "anchor_state_advantages", "baseline_advantages",
    "discounted_token_advantages",
    "estimate_advantages", "group_advantages", "register_estimator", "rloo_advantages", "token_advantages",
)
