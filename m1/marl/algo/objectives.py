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
- `clip_cov` and `kl_cov` (Cui et al. 2025, as verl's policy-loss modes): entropy kept from collapsing by
  treating the few tokens whose log-prob and advantage covary most (the ones whose update lowers entropy most)
  apart: Clip-Cov cuts their gradient from `clip`, KL-Cov holds them near the old policy with ``|logp - old|``.

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


def covariance(logp, advantages, mask):
    """Per token, ``(A - mean A) (logp - mean logp)`` over the mask's tokens (logp without gradient): how much a
    step on that token lowers the policy's entropy (Cui et al. 2025, "The Entropy Mechanism of RL for Reasoning
    Language Models": the entropy change is minus the covariance of log-prob and advantage)."""
    a = advantages.expand_as(mask)
    lp = logp.detach()
    mean_a = (a * mask).sum() / mask.sum().clamp(min=1.0)
    mean_lp = (lp * mask).sum() / mask.sum().clamp(min=1.0)
    return (a - mean_a) * (lp - mean_lp)


def _clip_cov(logp, old_logp, advantages, mask, s):
    """PPO's clip, and the gradient cut from a few tokens whose covariance lies in `cov_bounds` (the paper's
    Clip-Cov): a `cov_ratio` share of the loss tokens (at least one), drawn at random among the tokens in the band
    that the clip left alone. The draw is seeded by the micro-batch's shape and token count, so a resumed run, or
    another machine, cuts the same tokens. The band and the share are per micro-batch (verl: per mini-batch)."""
    import torch

    per_token, metrics = clipped_surrogate(logp - old_logp, advantages, mask, s.clip_eps_low, s.clip_eps_low, s.delta)
    ratio = torch.exp(logp - old_logp).detach()
    clipped = ((ratio < 1 - s.clip_eps_low) & (advantages < 0)) | ((ratio > 1 + s.clip_eps_low) & (advantages > 0))
    cov = covariance(logp, advantages, mask)
    low, high = s.cov_bounds
    band = torch.nonzero(((cov > low) & (cov < high) & (mask > 0) & ~clipped).flatten()).flatten().cpu()
    n = max(int((s.cov_ratio or 2e-4) * float(mask.sum())), 1)
    seed = (logp.shape[0] * 1_000_003 + logp.shape[1]) * 1_000_003 + int(mask.sum())
    pick = band[torch.randperm(len(band), generator=torch.Generator().manual_seed(seed))[:n]]
    keep = torch.ones(logp.numel(), dtype=logp.dtype)
    keep[pick] = 0.0
    keep = keep.view_as(logp).to(logp.device)
    cut = (1.0 - keep) * mask
    # the cut tokens keep their loss value, without its gradient
    per_token = per_token.expand_as(mask) * keep + (per_token.expand_as(mask) * (1.0 - keep)).detach()
    return per_token, {**metrics, "cov_mean": masked_mean(cov, mask), "cov_cut_frac": masked_mean(cut, mask)}


def _kl_cov(logp, old_logp, advantages, mask, s):
    """The unclipped surrogate ``-r A``, plus ``kl_cov_coef |logp - old|`` on the `cov_ratio` share of the loss
    tokens with the largest covariance (the paper's KL-Cov: those tokens are held near the old policy). The penalty
    needs old log-probs other than the policy's own (its gradient is 0 where logp = old)."""
    import torch

    ratio = torch.exp(logp - old_logp)
    per_token = -ratio * advantages
    cov = covariance(logp, advantages, mask)
    n = min(max(int((s.cov_ratio or 2e-3) * float(mask.sum())), 1), int(mask.sum()))
    top = torch.zeros(logp.numel(), dtype=logp.dtype, device=logp.device)
    if n:
        top[torch.topk(cov.masked_fill(mask == 0, float("-inf")).flatten(), n).indices] = 1.0
    top = top.view_as(logp)
    per_token = per_token.expand_as(mask) + top * s.kl_cov_coef * (logp - old_logp).abs()
    return per_token, {"ratio_mean": masked_mean(ratio.detach(), mask),
                       "cov_mean": masked_mean(cov, mask),
                       "cov_penalised_frac": masked_mean(top, mask)}


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
CLIP_COV = register_objective(PolicyObjective(
    name="clip_cov", loss=_clip_cov, settings=("clip_eps_low", "delta", "cov_ratio", "cov_bounds")))
KL_COV = register_objective(PolicyObjective(
    name="kl_cov", loss=_kl_cov, settings=("cov_ratio", "kl_cov_coef"),
    requires=(Rule("grpo.old_logprobs", lambda v: v == "rollout",
                   "its penalty |logp - old| has no gradient where old is the policy's own log-prob (policy, "
                   "sampler); set grpo.old_logprobs: rollout"),)))

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
