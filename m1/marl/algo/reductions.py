"""GRPO's tensor primitives as small pure functions: token log-probs, the k3 KL, the loss reductions
(`grpo.loss_type`) and the old log-probs of the ratio (`grpo.old_logprobs`). The policy objectives and `grpo_loss`,
which composes them, are in m1/marl/algo/objectives.py; the advantage estimators in m1/marl/algo/advantages.py.

Reference numerics: TRL 1.16.0 ``GRPOTrainer`` (parity is tested in ``tests/marl/test_grpo.py`` by running TRL's own
``_compute_loss``). Choices:

- k3 KL to the reference, not clamped (TRL; verl and OpenRLHF clamp to [-10, 10]);
- loss aggregation named as in TRL (``grpo``, ``bnpo``, ``dr_grpo``, ``dapo``) plus ``token-mean`` (verl's name for
  TRL's ``bnpo``). Gradient accumulation is left to the caller: TRL divides ``grpo``/``bnpo``/``dr_grpo`` by the
  number of micro-batches per optimizer step, while ``dapo`` is already normalised by the whole step's token
  count (``num_items_in_batch``) and must not be divided again.

Adding a loss or an old-log-prob mode: the loss types (``LOSSES``) and the ``grpo.old_logprobs`` modes
(``OLD_LOGPROBS``) are registries, and the config accepts exactly their names. A new one is one function under
``@register_loss(name, token_level=...)`` or ``@register_old_logprobs(name)`` plus a test of its values; the
learner (m1/marl/actor/learner.py) needs no change. tests/marl/test_loss_registry.py registers a toy loss from outside
m1/ and trains one step with it.

torch is imported inside the functions so that importing this module stays cheap.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from m1.registry import add_entry

if TYPE_CHECKING:
    import torch

    Tensor = torch.Tensor

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
        add_entry(LOSSES, name, LossType(fn, token_level), "loss_type")
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
        add_entry(OLD_LOGPROBS, name, fn, "old_logprobs mode")
        return fn

    return add


def default_old_logprobs(engine: str, max_staleness: int) -> str:
    """The mode a run with `grpo.old_logprobs` unset uses: an engine's numerics, or weights up to `max_staleness`
    updates old, call for the sampler's log-probs (`sampler`); else the policy's own (`policy`)."""
    return "sampler" if engine == "vllm" or max_staleness > 0 else "policy"


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
    "LOSSES",
    "OLD_LOGPROBS",
    "LossType",
    "aggregate",
    "default_old_logprobs",
    "kl_k3",
    "register_loss",
    "register_old_logprobs",
    "token_logprobs",
)
