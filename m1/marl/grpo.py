"""Multi-agent GRPO numerics as small pure tensor functions.

Reference numerics: TRL 1.16.0 ``GRPOTrainer`` (parity is tested in ``tests/marl/test_grpo.py`` by running TRL's own
``_compute_loss``). Choices:

- advantage ``A = (r - mean_g) / (std_g + 1e-4)`` with Bessel-corrected std over the K rollouts of one question
  for one agent; groups with fewer than two scored samples, or no spread, give ``A = 0`` exactly; NaN rewards
  (e.g. an agent dropped from a rollout by the random topology) are left out of the group statistics and get 0;
- token-level importance ratio, clipped ``[1 - eps_low, 1 + eps_high]`` (clip-higher when ``eps_high`` is set);
- k3 KL to the reference, not clamped (TRL; verl and OpenRLHF clamp to [-10, 10]);
- loss aggregation named as in TRL (``grpo``, ``bnpo``, ``dr_grpo``, ``dapo``) plus ``token-mean`` (verl's name for
  TRL's ``bnpo``). Gradient accumulation is left to the caller: TRL divides ``grpo``/``bnpo``/``dr_grpo`` by the
  number of micro-batches per optimizer step, while ``dapo`` is already normalised by the whole step's token
  count (``num_items_in_batch``) and must not be divided again.

Adding a loss or an old-log-prob mode: the loss types (``LOSSES``) and the ``grpo.old_logprobs`` modes
(``OLD_LOGPROBS``) are registries, and the config accepts exactly their names. A new one is one function under
``@register_loss(name, token_level=...)`` or ``@register_old_logprobs(name)`` plus a test of its values; the
learner (m1/marl/learner.py) needs no change. tests/marl/test_loss_registry.py registers a toy loss from outside m1/ and
trains one step with it.

torch is imported inside the functions so that importing this module stays cheap.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any


if TYPE_CHECKING:
    import torch

    Tensor = torch.Tensor

ADV_EPS = 1e-4  # TRL adds this to the group std


# --------------------------------------------------------------------------------------------- advantages


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
    hi = torch.where(present, r, torch.full_like(r, -math.inf)).amax(dim=-1, keepdim=True)
    lo = torch.where(present, r, torch.full_like(r, math.inf)).amin(dim=-1, keepdim=True)
    informative = (count > 1) & (hi > lo)
    adv = torch.where(present & informative, adv, torch.zeros_like(adv))
    return adv.squeeze(0) if squeeze else adv


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


def multi_agent_advantages(
    rewards: Mapping[str, Any], eps: float = ADV_EPS, scale: bool = True
) -> dict[str, "torch.Tensor"]:
    """Per-agent advantages: each agent's ``[G, K]`` rewards are normalised within its own groups only."""
    if not isinstance(rewards, Mapping):
        raise ValueError(f"multi_agent_advantages: expected a mapping agent -> rewards, got {type(rewards).__name__}")
    return {agent: group_advantages(r, eps=eps, scale=scale) for agent, r in rewards.items()}


# --------------------------------------------------------------------------------------------- log-probs


def token_logprobs(logits: "torch.Tensor", tokens: "torch.Tensor",
                   temperature: float | Sequence[float] = 1.0) -> "torch.Tensor":
    """``log_softmax(logits / temperature)`` gathered at ``tokens``, in float32.

    ``logits`` is ``[B, T, V]`` already aligned with ``tokens`` ``[B, T]`` (logits at position t score token t).
    Computed as ``x_tok - logsumexp(x)`` one sequence at a time so only a ``[T, V]`` float32 copy exists at once.
    Temperature must equal the sampling temperature for old/new/ref log-probs to be comparable; a sequence gives
    each row its own (agents of a team may sample at different temperatures).
    """
    import torch

    temps = [temperature] * tokens.shape[0] if isinstance(temperature, (int, float)) else list(temperature)
    bad = [t for t in temps if not (t > 0 and math.isfinite(t))]
    if bad:
        raise ValueError(f"token_logprobs: temperature must be a positive finite number, got {bad[0]}")
    if logits.dim() != 3 or tokens.dim() != 2 or logits.shape[:2] != tokens.shape:
        raise ValueError(
            f"token_logprobs: expected logits [B, T, V] and tokens [B, T], got {tuple(logits.shape)} and "
            f"{tuple(tokens.shape)}"
        )
    if len(temps) != tokens.shape[0]:
        raise ValueError(f"token_logprobs: {len(temps)} temperatures for {tokens.shape[0]} rows")
    index = tokens.long().unsqueeze(-1)
    rows = []
    for row_logits, row_index, t in zip(logits, index, temps, strict=True):
        x = row_logits.float()
        if t != 1.0:
            x = x / t
        rows.append(torch.gather(x, -1, row_index).squeeze(-1) - torch.logsumexp(x, dim=-1))
    if not rows:
        return logits.new_zeros(tokens.shape, dtype=torch.float32)
    return torch.stack(rows)


# --------------------------------------------------------------------------------------------- KL


def kl_k3(logp: "torch.Tensor", ref_logp: "torch.Tensor") -> "torch.Tensor":
    """Per-token k3 estimator of KL(pi || pi_ref): ``exp(ref - logp) - (ref - logp) - 1`` (>= 0, unclamped as TRL)."""
    if logp.shape != ref_logp.shape:
        raise ValueError(f"kl_k3: logp {tuple(logp.shape)} and ref_logp {tuple(ref_logp.shape)} differ in shape")
    delta = ref_logp - logp
    return delta.exp() - delta - 1


# --------------------------------------------------------------------------------------------- loss types


@dataclass(frozen=True)
class LossType:
    """A registered ``loss_type``: how per-token losses reduce to a scalar, and whether that reduction is a token
    mean (``token_level``). A token-level loss is normalised by ``num_items_in_batch`` when given, so a caller
    accumulating micro-batches passes the step's token count and sums their losses; any other loss is a mean over
    its own micro-batch, which the caller weights by the micro-batch's share of the step's samples."""

    aggregate: Callable[..., "torch.Tensor"]
    token_level: bool = False


LOSSES: dict[str, LossType] = {}


def register_loss(name: str, *, token_level: bool = False):
    """Decorator: register ``fn(per_token, mask, *, max_completion_length, num_items_in_batch)`` as ``loss_type``
    ``name`` (``grpo.loss_type`` in a config accepts exactly the registered names)."""

    def add(fn: Callable[..., "torch.Tensor"]) -> Callable[..., "torch.Tensor"]:
        if name in LOSSES:
            raise ValueError(f"loss_type {name!r} is already registered")
        LOSSES[name] = LossType(fn, token_level)
        return fn

    return add


@register_loss("grpo")
def _agg_grpo(per_token: "Tensor", mask: "Tensor", **_: Any) -> "Tensor":
    """Mean over each sequence's masked tokens, then mean over all sequences (empty ones count as 0, as TRL)."""
    return ((per_token * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).mean()


@register_loss("dr_grpo")
def _agg_dr_grpo(per_token: "Tensor", mask: "Tensor", *, max_completion_length: int | None = None, **_: Any):
    """Sum over masked tokens / (B * max_completion_length): a constant normaliser, no length bias."""
    if max_completion_length is None or max_completion_length <= 0:
        raise ValueError(f"loss_type 'dr_grpo' needs max_completion_length > 0, got {max_completion_length}")
    return (per_token * mask).sum() / (per_token.size(0) * max_completion_length)


@register_loss("dapo", token_level=True)
@register_loss("bnpo", token_level=True)
@register_loss("token-mean", token_level=True)
def _agg_token_mean(per_token: "Tensor", mask: "Tensor", *, num_items_in_batch: Any = None, **_: Any):
    """Sum over masked tokens / tokens of the whole (accumulated, global) batch.

    ``num_items_in_batch`` is the number of loss tokens in one optimizer step (all micro-batches, all ranks)
    divided by the number of data-parallel ranks, which is the normaliser TRL's ``dapo`` ends up using; summing the
    micro-batch losses and averaging over ranks then gives a true global token mean. ``None`` means this micro-batch
    is the whole step: the token mean of this batch (TRL ``bnpo``, verl ``token-mean``). The three names are one
    loss here; TRL's ``bnpo`` ignores ``num_items_in_batch`` and leaves accumulation to its caller.
    """
    import torch

    if num_items_in_batch is None:
        normalizer = mask.sum()
    else:
        normalizer = torch.as_tensor(num_items_in_batch, dtype=per_token.dtype, device=per_token.device)
    return (per_token * mask).sum() / normalizer.clamp(min=1.0)


def aggregate(
    per_token: "torch.Tensor",
    mask: "torch.Tensor",
    loss_type: str = "grpo",
    *,
    max_completion_length: int | None = None,
    num_items_in_batch: Any = None,
) -> "torch.Tensor":
    """Reduce a per-token quantity ``[B, T]`` (or ``[B, 1]``) to a scalar with the ``loss_type`` rule."""
    if loss_type not in LOSSES:
        raise ValueError(f"unknown loss_type {loss_type!r}; choose one of {sorted(LOSSES)}")
    return LOSSES[loss_type].aggregate(
        per_token, mask, max_completion_length=max_completion_length, num_items_in_batch=num_items_in_batch
    )


# --------------------------------------------------------------------------------------------- policy loss


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


def _masked_mean(x: "Tensor", mask: "Tensor") -> float:
    x = x.expand_as(mask)
    return float((x * mask).sum() / mask.sum().clamp(min=1.0))


def _clipped_objective(
    logp,
    old_logp,
    advantages,
    mask,
    clip_eps_low: float,
    clip_eps_high: float | None,
    delta: float | None,
    importance_sampling_level: str,
):
    """Per-token ``-min(r A, clip(r) A)``, the raw ratio and the clip stats of ``grpo_loss``."""
    import torch

    if clip_eps_low < 0 or (clip_eps_high is not None and clip_eps_high < 0):
        raise ValueError(f"clip eps must be >= 0, got low={clip_eps_low} high={clip_eps_high}")
    eps_high = clip_eps_low if clip_eps_high is None else clip_eps_high
    adv = _check_inputs(logp, old_logp, advantages, mask).to(logp.dtype)
    if old_logp is None:  # single update per generation: ratio is 1 but keeps the gradient of logp
        old_logp = logp.detach()
    log_ratio = logp - old_logp
    if importance_sampling_level == "token":
        log_w = log_ratio
    elif importance_sampling_level == "sequence":  # GSPO: one ratio per sequence from the mean log-ratio
        log_w = ((log_ratio * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).unsqueeze(-1)
    else:
        raise ValueError(f"importance_sampling_level must be 'token' or 'sequence', got {importance_sampling_level!r}")
    ratio = torch.exp(log_w)
    clipped = torch.clamp(ratio, 1 - clip_eps_low, 1 + eps_high)
    unclipped = ratio if delta is None else torch.clamp(ratio, max=delta)  # optional cap on the ratio (TRL delta)
    per_token = -torch.min(unclipped * adv, clipped * adv)
    low = ((ratio < 1 - clip_eps_low) & (adv < 0)).to(logp.dtype)
    high = ((ratio > 1 + eps_high) & (adv > 0)).to(logp.dtype)
    stats = {
        "ratio_mean": _masked_mean(ratio.detach(), mask),
        "clip_frac_low": _masked_mean(low, mask),
        "clip_frac_high": _masked_mean(high, mask),
        "clip_frac": _masked_mean(torch.maximum(low, high), mask),
        "num_tokens": float(mask.sum()),
    }
    return per_token, ratio, stats


def grpo_loss(
    logp: "torch.Tensor",
    old_logp: "torch.Tensor | None",
    ref_logp: "torch.Tensor | None",
    advantages: "torch.Tensor",
    mask: "torch.Tensor",
    beta: float = 0.0,
    clip_eps_low: float = 0.2,
    clip_eps_high: float | None = None,
    loss_type: str = "grpo",
    max_completion_length: int | None = None,
    *,
    num_items_in_batch: Any = None,
    delta: float | None = None,
    importance_sampling_level: str = "token",
    is_weight: "torch.Tensor | None" = None,
) -> tuple["torch.Tensor", dict[str, float]]:
    """The GRPO objective: per-token clipped surrogate ``-min(r A, clip(r, 1-eps_low, 1+eps_high) A)``
    ``+ beta * k3 KL``, then one ``loss_type`` aggregation (a name registered in ``LOSSES``).

    ``logp``/``old_logp``/``ref_logp``/``mask`` are ``[B, T]`` (mask 1 on the agent's own generated tokens, 0 on
    prompt, padding, tool outputs and text other agents wrote to the shared memory); ``advantages`` is ``[B]`` (or
    ``[B, T]``). ``old_logp=None`` means on-policy (``logp.detach()``). ``clip_eps_high`` defaults to
    ``clip_eps_low``; set it higher for DAPO clip-higher. As in TRL the KL is added per token before aggregation, so
    it is weighted exactly like the policy term; ``ref_logp`` may be ``None`` only when ``beta == 0``. ``is_weight``
    [B, T] (no gradient) multiplies the policy term per token before the KL is added: the truncated importance weight
    that corrects for completions sampled by an engine whose numerics differ from the trainer's (TRL's vLLM
    correction). Returns the scalar loss and float stats: ``ratio_mean``, ``clip_frac`` (tokens whose gradient the
    clip removes, TRL's "region" ratio), ``clip_frac_low``, ``clip_frac_high``, ``num_tokens``, ``policy_loss`` (the
    aggregated policy term alone), ``kl`` (masked token mean of k3, whenever ``ref_logp`` is given) and ``loss``.
    """
    if beta < 0:
        raise ValueError(f"grpo_loss: beta must be >= 0, got {beta}")
    if beta != 0 and ref_logp is None:
        raise ValueError(f"grpo_loss: beta={beta} needs ref_logp (reference-model log-probs)")
    mask = mask.to(logp.dtype)
    per_token, _, stats = _clipped_objective(
        logp, old_logp, advantages, mask, clip_eps_low, clip_eps_high, delta, importance_sampling_level
    )
    agg = functools.partial(
        aggregate,
        mask=mask,
        loss_type=loss_type,
        max_completion_length=max_completion_length,
        num_items_in_batch=num_items_in_batch,
    )
    if is_weight is not None:
        per_token = per_token * is_weight.detach()
    stats["policy_loss"] = float(agg(per_token.detach()))
    if ref_logp is not None:
        kl = kl_k3(logp, ref_logp)
        stats["kl"] = _masked_mean(kl.detach(), mask)
        if beta != 0:
            per_token = per_token + beta * kl
    loss = agg(per_token)
    stats["loss"] = float(loss.detach())
    return loss, stats


# --------------------------------------------------------------------------------------------- old log-probs


OldLogprobs = Callable[..., tuple["torch.Tensor | None", "torch.Tensor | None", dict[str, float]]]
OLD_LOGPROBS: dict[str, OldLogprobs] = {}


def register_old_logprobs(name: str):
    """Decorator: register ``fn(logp, mask, sampled, grpo) -> (old, is_weight, stats)`` as ``grpo.old_logprobs``
    mode ``name`` (a config accepts exactly the registered names).

    ``logp``/``mask`` are the policy's [B, T] log-probs and loss mask, ``sampled`` the sampler's log-probs padded to
    [B, T] (None when a sample has none), ``grpo`` the run's GRPOSettings. ``old`` and ``is_weight`` go to
    ``grpo_loss`` (None: on-policy, unweighted); ``stats`` are sums over the batch's masked tokens, which the learner
    turns into token means over the step, except keys ending in ``_max``, maxima over the step.
    """

    def add(fn: OldLogprobs) -> OldLogprobs:
        if name in OLD_LOGPROBS:
            raise ValueError(f"old_logprobs mode {name!r} is already registered")
        OLD_LOGPROBS[name] = fn
        return fn

    return add


def _sampled(sampled: "Tensor | None", mode: str) -> "Tensor":
    if sampled is None:
        raise ValueError(f"grpo.old_logprobs={mode} needs the sampler's log-probs (a sample has none)")
    return sampled


@register_old_logprobs("policy")
def _old_policy(logp, mask, sampled, grpo):
    """``logp.detach()``: one update per rollout batch (TRL's on-policy case), ratio exactly 1."""
    return None, None, {}


@register_old_logprobs("rollout")
def _old_rollout(logp, mask, sampled, grpo):
    """The sampler's log-probs: the ratio corrects for generation lagging the weights."""
    return _sampled(sampled, "rollout"), None, {}


@register_old_logprobs("sampler")
def _old_sampler(logp, mask, sampled, grpo):
    """On-policy ratio, and each token's policy term weighted by ``min(exp(logp - sampled), is_cap)``: the
    truncated importance weight from the sampling engine's numerics to the trainer's."""
    import torch

    raw = torch.exp((logp.detach().float() - _sampled(sampled, "sampler")) * mask)  # 1 on padding
    stats = {"is/ratio_mean": float((raw * mask).sum()),
             "is/truncated": float(((raw > grpo.is_cap).float() * mask).sum()),
             "is/ratio_max": float((raw * mask).max()) if float(mask.sum()) else 0.0}
    return None, raw.clamp(max=grpo.is_cap), stats


__all__: Sequence[str] = (
    "ADV_EPS",
    "LOSSES",
    "OLD_LOGPROBS",
    "LossType",
    "aggregate",
    "grpo_loss",
    "group_advantages",
    "kl_k3",
    "multi_agent_advantages",
    "register_loss",
    "register_old_logprobs",
    "token_logprobs",
)
