"""The GRPO loss: a registered policy objective (`grpo.objective`), its importance weight, the k3 KL, one reduction.

A policy objective receives the policy's log-probs, the old log-probs, the advantages and the mask (all [B, T],
advantages [B, 1] or [B, T]) and its own settings (the `grpo` fields it names in `settings`, nothing else), and
returns its per-token loss ([B, T], or [B, 1] for one value per sequence) and its metrics (masked token means, which
the learner logs per agent). `grpo_loss` then weights it by the sampler's importance weight, adds ``beta * k3 KL``
per token and reduces with the `grpo.loss_type` rule (m1/marl/algo/reductions.py `LOSSES`), so every objective is
aggregated, accumulated over micro-batches and logged alike. Shipped (numerics equal TRL 1.16.0's `_compute_loss`,
tested by running it in tests/marl/test_objectives.py and tests/marl/test_grpo.py):

- `clip` (the default; PPO / GRPO): ``-min(r A, clip(r, 1 - eps, 1 + eps) A)`` per token, r = exp(logp - old),
  eps = `clip_eps_low`; `delta` caps the unclipped r (INTELLECT-2's two-sided clip, TRL's `delta`);
- `clip_higher` (DAPO): the same with the upper bound 1 + `clip_eps_high`, so low-probability tokens can grow;
- `gspo` (GSPO, Zheng et al. 2025): one ratio per sequence, ``s = exp(mean_t (logp - old))`` over its masked
  tokens (the length-normalised sequence log-ratio), clipped as above; the paper averages sequences (`loss_type:
  grpo`);
- `cispo` (MiniMax-M1): ``-sg(min(r, 1 + clip_eps_high)) A logp``: the importance weight is clipped and carries
  no gradient, so every token keeps its gradient; no lower bound (as MiniMax-M1 ran it and TRL implements it).

Each entry states the settings it reads, requires and refuses (m1/marl/entries.py); the config's validator reads
them from the entry. A new objective is `register_objective(PolicyObjective(name=..., loss=...))`; `grpo.objective`
accepts any registered name and the learner needs no change. torch is imported inside the functions.
"""
from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from m1.marl.entries import Entry, Rule
from m1.registry import add_entry
from m1.marl.algo.reductions import LOSSES, aggregate, kl_k3

if TYPE_CHECKING:
    import torch

    Tensor = torch.Tensor

# The stats of `grpo_loss` that are not masked token means: a count and the reduced losses.
LOSS_TOTALS = ("num_tokens", "policy_loss", "loss")


@dataclass(frozen=True, kw_only=True)
class PolicyObjective(Entry):
    """A registered `grpo.objective`: `loss(logp, old_logp, advantages, mask, settings) -> (per_token, metrics)`."""

    loss: Callable[..., tuple["torch.Tensor", dict[str, float]]]


OBJECTIVES: dict[str, PolicyObjective] = {}


def register_objective(objective: PolicyObjective) -> PolicyObjective:
    """Make `objective` selectable as `grpo.objective: <name>`."""
    add_entry(OBJECTIVES, objective.name, objective, "policy objective")
    return objective


def masked_mean(x: "Tensor", mask: "Tensor") -> float:
    """The mean of `x` ([B, T] or [B, 1], broadcast) over the mask's tokens."""
    x = x.expand_as(mask)
    return float((x * mask).sum() / mask.sum().clamp(min=1.0))


# --------------------------------------------------------------------------------------------- shipped objectives


def clipped_surrogate(log_w: "Tensor", advantages: "Tensor", mask: "Tensor", eps_low: float, eps_high: float,
                      delta: float | None) -> tuple["Tensor", dict[str, float]]:
    """``-min(r A, clip(r, 1 - eps_low, 1 + eps_high) A)`` with ``r = exp(log_w)`` ([B, T] or [B, 1]), r capped at
    `delta` in the unclipped term when given. Metrics: the mean ratio and the share of tokens whose gradient the
    clip removes (`clip_frac`, TRL's "region" ratio), below and above."""
    import torch

    if eps_low < 0 or eps_high < 0:
        raise ValueError(f"clip eps must be >= 0, got low={eps_low} high={eps_high}")
    ratio = torch.exp(log_w)
    clipped = torch.clamp(ratio, 1 - eps_low, 1 + eps_high)
    unclipped = ratio if delta is None else torch.clamp(ratio, max=delta)
    per_token = -torch.min(unclipped * advantages, clipped * advantages)
    low = ((ratio < 1 - eps_low) & (advantages < 0)).to(log_w.dtype)
    high = ((ratio > 1 + eps_high) & (advantages > 0)).to(log_w.dtype)
    return per_token, {
        "ratio_mean": masked_mean(ratio.detach(), mask),
        "clip_frac_low": masked_mean(low, mask),
        "clip_frac_high": masked_mean(high, mask),
        "clip_frac": masked_mean(torch.maximum(low, high), mask),
    }


def _clip(logp, old_logp, advantages, mask, s):
    return clipped_surrogate(logp - old_logp, advantages, mask, s.clip_eps_low, s.clip_eps_low, s.delta)


def _clip_higher(logp, old_logp, advantages, mask, s):
    return clipped_surrogate(logp - old_logp, advantages, mask, s.clip_eps_low, s.clip_eps_high, s.delta)


def _gspo(logp, old_logp, advantages, mask, s):
    """One importance ratio per sequence, from the mean of its tokens' log-ratios; [B, 1]."""
    log_w = (((logp - old_logp) * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).unsqueeze(-1)
    eps_high = s.clip_eps_low if s.clip_eps_high is None else s.clip_eps_high
    return clipped_surrogate(log_w, advantages, mask, s.clip_eps_low, eps_high, s.delta)


def _cispo(logp, old_logp, advantages, mask, s):
    """The clipped importance weight, without gradient, times the advantage and the log-prob. `clip_frac` counts
    the tokens with A > 0 whose weight the cap lowered (TRL's `cispo_clip_ratio`); none loses its gradient."""
    import torch

    ratio = torch.exp(logp - old_logp)
    cap = 1 + s.clip_eps_high
    weight = torch.clamp(ratio, max=cap).detach()
    capped = ((ratio > cap) & (advantages > 0)).to(logp.dtype)
    return -weight * advantages * logp, {"ratio_mean": masked_mean(ratio.detach(), mask),
                                         "clip_frac": masked_mean(capped, mask)}


def _given(setting: str, why: str) -> Rule:
    return Rule(f"grpo.{setting}", lambda v: v is not None, why)


CLIP = register_objective(PolicyObjective(name="clip", loss=_clip, settings=("clip_eps_low", "delta")))
CLIP_HIGHER = register_objective(PolicyObjective(
    name="clip_higher", loss=_clip_higher, settings=("clip_eps_low", "clip_eps_high", "delta"),
    requires=(_given("clip_eps_high", "the ratio is clipped above at 1 + clip_eps_high; set it (DAPO: 0.28)"),)))
GSPO = register_objective(PolicyObjective(
    name="gspo", loss=_gspo, settings=("clip_eps_low", "clip_eps_high", "delta"),
    requires=(Rule("grpo.loss_type", lambda v: v == "grpo",
                   "GSPO averages one term per sequence (the paper's mean over the group); the other reductions "
                   "weight a sequence by its length. Set grpo.loss_type: grpo"),),
    refuses=(Rule("grpo.old_logprobs", lambda v: v == "sampler",
                  "its importance weight is per token, GSPO's ratio per sequence; use old_logprobs: rollout (the "
                  "sequence ratio then corrects for the sampler)"),)))
CISPO = register_objective(PolicyObjective(
    name="cispo", loss=_cispo, settings=("clip_eps_high",),
    requires=(_given("clip_eps_high", "the importance weight is capped at 1 + clip_eps_high; set it"),
              Rule("grpo.loss_type", lambda v: LOSSES[v].token_level,
                   "MiniMax-M1 normalises by the batch's tokens; set grpo.loss_type: dapo (or bnpo, token-mean)"))))


# --------------------------------------------------------------------------------------------- the whole loss


def _check_inputs(logp, old_logp, advantages, mask):
    if logp.dim() != 2:
        raise ValueError(f"logp must be [B, T], got {tuple(logp.shape)}")
    if mask.shape != logp.shape:
        raise ValueError(f"mask {tuple(mask.shape)} must match logp {tuple(logp.shape)}")
    if old_logp is not None and old_logp.shape != logp.shape:
        raise ValueError(f"old_logp {tuple(old_logp.shape)} must match logp {tuple(logp.shape)}")
    B, T = logp.shape
    if advantages.dim() == 1:
        if advantages.shape[0] != B:
            raise ValueError(f"advantages {tuple(advantages.shape)} must have one value per sequence (B={B})")
        return advantages.unsqueeze(1)
    if advantages.dim() == 2 and advantages.shape[0] == B and advantages.shape[1] in (1, T):
        return advantages
    raise ValueError(f"advantages must be [B], [B, 1] or [B, T] with B={B}, T={T}; got {tuple(advantages.shape)}")


def grpo_loss(
    logp: "torch.Tensor",
    old_logp: "torch.Tensor | None",
    ref_logp: "torch.Tensor | None",
    advantages: "torch.Tensor",
    mask: "torch.Tensor",
    grpo: Any,
    *,
    max_completion_length: int | None = None,
    num_items_in_batch: Any = None,
    is_weight: "torch.Tensor | None" = None,
) -> tuple["torch.Tensor", dict[str, float]]:
    """The GRPO loss of one batch under the `grpo` settings (a GRPOSettings, or any object with `objective`,
    `beta`, `loss_type` and the objective's own settings): the objective's per-token loss, times `is_weight`,
    ``+ beta * k3 KL`` per token (as TRL, so the KL is weighted exactly like the policy term), then the
    `loss_type` reduction.

    ``logp``/``old_logp``/``ref_logp``/``mask`` are ``[B, T]`` (mask 1 on the agent's own generated tokens, 0 on
    prompt, padding, tool outputs and text other agents wrote to the shared memory); ``advantages`` is ``[B]`` (or
    ``[B, T]``). ``old_logp=None`` means on-policy (``logp.detach()``: ratio 1 with the gradient of logp).
    ``ref_logp`` may be None only at ``beta == 0``. ``is_weight`` [B, T] (no gradient) is the truncated importance
    weight of an engine whose numerics differ from the trainer's (TRL's vLLM correction). Returns the scalar loss
    and float stats: the objective's metrics and ``kl`` (whenever ``ref_logp`` is given), masked token means;
    ``num_tokens``, ``policy_loss`` (the reduced policy term alone) and ``loss`` (`LOSS_TOTALS`).
    """
    beta = grpo.beta
    if beta < 0:
        raise ValueError(f"grpo_loss: beta must be >= 0, got {beta}")
    if beta != 0 and ref_logp is None:
        raise ValueError(f"grpo_loss: beta={beta} needs ref_logp (reference-model log-probs)")
    if grpo.objective not in OBJECTIVES:
        raise ValueError(f"unknown objective {grpo.objective!r}; choose one of {sorted(OBJECTIVES)}")
    objective = OBJECTIVES[grpo.objective]
    mask = mask.to(logp.dtype)
    adv = _check_inputs(logp, old_logp, advantages, mask).to(logp.dtype)
    old = logp.detach() if old_logp is None else old_logp
    per_token, metrics = objective.loss(logp, old, adv, mask, objective.own_settings(grpo))
    stats = {**metrics, "num_tokens": float(mask.sum())}
    agg = functools.partial(aggregate, mask=mask, loss_type=grpo.loss_type,
                            max_completion_length=max_completion_length, num_items_in_batch=num_items_in_batch)
    if is_weight is not None:
        per_token = per_token * is_weight.detach()
    stats["policy_loss"] = float(agg(per_token.detach()))
    if ref_logp is not None:
        kl = kl_k3(logp, ref_logp)
        stats["kl"] = masked_mean(kl.detach(), mask)
        if beta != 0:
            per_token = per_token + beta * kl
    loss = agg(per_token)
    stats["loss"] = float(loss.detach())
    return loss, stats


__all__: Sequence[str] = (
    "LOSS_TOTALS", "OBJECTIVES", "PolicyObjective", "clipped_surrogate", "grpo_loss", "masked_mean",
    "register_objective",
)
