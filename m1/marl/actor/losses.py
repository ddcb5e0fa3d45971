"""Loss families: what one optimizer step of an agent minimises, a registry as the policy objectives are.

A family is `loss(actor, micro, micro_rows, step) -> (loss, stats)`: the loss of one micro-batch of the agent's step
(its `Sample`s and their token rows, prompt and completion ids), already weighted against the whole step (`StepSize`)
so the actor can sum micro-batches into the step's gradient, and its stats weighted alike. The actor is the agent's
`Actor` (m1/marl/actor/learner.py): a family scores tokens with `actor.compute_logprobs(rows, temperature, vision)`
(`actor.scoring(micro)` gives the images and temperatures, `actor.reference_model()` the reference,
`actor.autocast()` the precision) and reads `actor.cfg` (the learner block) and `actor.grpo`.
`Actor.update(samples, lr, family=...)` runs it. Shipped: `grpo` (the GRPO loss, m1/marl/algo) and `sft`
(cross-entropy of the completions, with the prompt loss and the evidence attention loss when configured). A new
family (DPO, distillation) is one `register_loss_family(LossFamily(...))`.
"""
from __future__ import annotations

from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any, NamedTuple

from m1.attention_loss import HeadScores, evidence_attention_loss, supervised_layers
from m1.marl.algo.objectives import LOSS_TOTALS, grpo_loss
from m1.marl.algo.reductions import LOSSES, OLD_LOGPROBS
from m1.marl.rollout.episodes import Sample
from m1.registry import add_entry


class StepSize(NamedTuple):
    """What a micro-batch's loss is weighted against: the whole step's samples and loss tokens (every sample counts,
    run or not), prompt tokens (a prompt's first token has nothing to predict it) and the tokens run (per-token
    diagnostics are means over those)."""

    samples: int
    tokens: int
    prompt_tokens: int
    run_tokens: int
    evidence_rows: int = 0  # SFT's attention loss: the evidence rows of the step's completions (as cut)


def evidence_rows(sample: Sample, row: tuple[list[int], list[int]]) -> list[tuple[int, tuple[int, ...]]]:
    """The sample's evidence rows whose predicted token is still in the row (completions may have been cut)."""
    length = len(row[0]) + len(row[1])
    return [(q, ev) for q, ev in sample.evidence or () if q + 1 < length]


def sft_loss(actor, micro: list[Sample], micro_rows: list, step: StepSize):
    """Cross-entropy of the completions as a token mean over the whole step (so micro-batch losses sum to the
    step's); `learner.prompt_loss` adds the prompt's own step token mean with that weight, `learner.attention`
    the evidence attention loss (`_attention_loss`). Either takes one forward over the whole sequence: the
    attention rows need the prompt's keys from the pass that has gradient."""
    vision, temperature = actor.scoring(micro)
    prompt_loss, att = actor.cfg.prompt_loss > 0, actor.cfg.attention
    heads = HeadScores(actor.policy, supervised_layers(att)) if att.on else nullcontext()
    with actor.autocast(), heads:
        if prompt_loss or att.on:
            logp, mask, p_logp, p_mask = actor.scorer.sequence_logprobs(actor.forward_model(), micro_rows,
                                                                       prompt=prompt_loss)
        else:
            logp, mask = actor.compute_logprobs(micro_rows, temperature, vision)
    loss = -(logp * mask).sum() / max(step.tokens, 1)
    stats = {"nll": float(-(logp.detach() * mask).sum()) * (1.0 / max(step.tokens, 1))}
    if prompt_loss:
        loss = loss - actor.cfg.prompt_loss * (p_logp * p_mask).sum() / max(step.prompt_tokens, 1)
        stats["prompt_nll"] = float(-(p_logp.detach() * p_mask).sum()) * (1.0 / max(step.prompt_tokens, 1))
    if att.on:
        with actor.autocast():
            shown, shown_stats = _attention_loss(actor, heads, micro, micro_rows, step)
        loss = loss + shown
        stats.update(shown_stats)
    return loss, stats


def _attention_loss(actor, heads: HeadScores, micro: list[Sample], micro_rows: list, step: StepSize):
    """The evidence attention loss of a micro-batch whose whole-sequence pass `heads` captured, weighted against
    the step like the cross-entropy: the reading term by the micro-batch's share of the step's evidence rows,
    the structural terms by its share of the step's completion tokens. Rows move from a sample's own positions
    to the padded batch's (prompts are left-padded to the longest). Returns (loss, stats weighted alike)."""
    p_len = max(len(p) for p, _ in micro_rows)
    rows = [[(q + p_len - len(p), tuple(e + p_len - len(p) for e in ev)) for q, ev in evidence_rows(s, (p, c))]
            for s, (p, c) in zip(micro, micro_rows)]
    _, attention, *_ = actor.scorer.padded_rows(micro_rows)
    shown = evidence_attention_loss(heads, actor.cfg.attention, rows, attention)
    if shown is None:
        return 0.0, {}
    read = sum(len(r) for r in rows) / max(step.evidence_rows, 1)
    tokens = sum(len(c) for _, c in micro_rows) / max(step.tokens, 1)
    share = {"read": read, "prev": tokens, "prev2": tokens}
    loss = actor.cfg.attention.weight * sum(part * share[k] for k, part in shown.parts.items())
    of = {"attn_read": read, "attn_evidence_mass": read, "attn_prev": tokens, "attn_prev2": tokens}
    stats = {k: v * of[k] for k, v in shown.metrics.items()}
    stats["attn_loss"] = float(loss.detach())
    return loss, stats


def grpo_loss_family(actor, micro: list[Sample], micro_rows: list, step: StepSize):
    """`grpo_loss` of one micro-batch with the configured objective (m1/marl/algo/objectives.py), loss type and
    old-log-prob mode (m1/marl/algo/reductions.py), weighted against the whole step: a token-level loss is
    normalised by the step's token count, any other by the micro-batch's share of the step's samples. Per-token
    stats are means over the tokens run; `logp_gap` is the mean |recomputed - sampled| log-prob, which should be
    ~0 on-policy."""
    import torch

    g = actor.grpo
    vision, temperature = actor.scoring(micro)
    with actor.autocast():
        logp, mask = actor.compute_logprobs(micro_rows, temperature, vision)
    ref = None
    if g.beta > 0:
        with torch.no_grad(), actor.autocast(), actor.reference_model() as ref_model:
            ref, _ = actor.compute_logprobs(micro_rows, temperature, vision, model=ref_model)
    given = [s.logprobs for s in micro]
    sampled = actor.scorer.padded(given, logp.shape[1]) if all(x is not None for x in given) else None
    old, is_weight, mode_stats = OLD_LOGPROBS[g.old_logprobs or "policy"](logp, mask, sampled, g)
    per_token = 1.0 / max(step.run_tokens, 1)
    stats = {k: v if k.endswith("_max") else v * per_token for k, v in mode_stats.items()}
    if any(s.token_advantages is not None for s in micro):  # [B, T], aligned with the completions' log-probs
        adv = actor.scorer.padded([s.token_advantages if s.token_advantages is not None
                                   else [s.advantage] * len(s.completion_ids) for s in micro], logp.shape[1])
    else:
        adv = torch.tensor([s.advantage for s in micro], device=actor.device, dtype=torch.float32)
    loss, loss_stats = grpo_loss(logp, old, ref, adv, mask, g, num_items_in_batch=step.tokens, is_weight=is_weight,
                                 max_completion_length=actor.cfg.max_completion_tokens)
    if not LOSSES[g.loss_type].token_level:
        loss = loss * (len(micro) / step.samples)
    share = float(mask.sum()) / max(step.run_tokens, 1)  # the objective's metrics and kl are token means
    stats.update({k: v * share for k, v in loss_stats.items() if k not in LOSS_TOTALS})
    if sampled is not None:
        stats["logp_gap"] = float(((logp.detach() - sampled).abs() * mask).sum()) * per_token
    if g.entropy_coef > 0:
        bonus = decision_entropy_bonus(logp, mask, [s.phase in g.entropy_phases for s in micro], step)
        loss = loss + g.entropy_coef * bonus
        stats["entropy_bonus"] = float(bonus.detach()) * g.entropy_coef
    return loss, stats


def decision_entropy_bonus(logp, mask, decides: list[bool], step: StepSize):
    """``sum sg(log p) log p / step.tokens`` over the tokens of the rows in `decides`: minimising it raises their
    entropy, since for tokens drawn from the policy E[log p grad log p] = -grad H (E[grad log p] = 0). Only the
    sampled tokens' log-probs are needed, so every scoring path gives it; off-policy samples make it approximate."""
    import torch

    rows = torch.tensor(decides, device=logp.device, dtype=logp.dtype)[:, None]
    return (logp.detach() * logp * mask * rows).sum() / max(step.tokens, 1)


def grpo_carries_gradient(sample: Sample, grpo) -> bool:
    """Whether a sample has gradient under the GRPO loss with beta 0: an advantage on some token, or a phase the
    entropy bonus reaches."""
    return not sample.zero_advantage or (grpo.entropy_coef > 0 and sample.phase in grpo.entropy_phases)


@dataclass(frozen=True)
class LossFamily:
    """A registered loss family. `carries_gradient(sample, grpo)`: with beta 0, whether a sample has any gradient
    under it, so `learner.skip_zero_advantage` may leave the others out of the forward passes; None: every sample
    has."""

    name: str
    loss: Callable[[Any, list[Sample], list, StepSize], tuple[Any, dict[str, float]]]
    carries_gradient: Callable[[Sample, Any], bool] | None = None


LOSS_FAMILIES: dict[str, LossFamily] = {}


def register_loss_family(family: LossFamily) -> LossFamily:
    """Make `family` selectable as `Actor.update(..., family=<name>)`."""
    add_entry(LOSS_FAMILIES, family.name, family, "loss family")
    return family


GRPO = register_loss_family(LossFamily(name="grpo", loss=grpo_loss_family, carries_gradient=grpo_carries_gradient))
SFT = register_loss_family(LossFamily(name="sft", loss=sft_loss))
