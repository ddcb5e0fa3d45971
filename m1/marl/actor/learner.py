"""One trained agent: the Sampler the team generates with (m1/marl/actor/sampler.py) and the Actor that updates the
same weights. The groups that hold one learner per agent (`LocalLearners`, `RayLearners`) live in
m1/marl/actor/groups.py.

The Actor holds the policy (LoRA adapter through peft, or the full model) and the reference (LoRA: the same model with
the adapter disabled; full: a frozen copy; none when beta = 0); its update runs a registered loss family
(m1/marl/actor/losses.py) over the step's micro-batches and hands the gradients to its optimizer step
(m1/marl/actor/optimizer.py: AdamW, optionally inside a DeepSpeed ZeRO-2 engine). Different agents may have
different architectures and tokenizers: each actor tokenises and scores its own samples (m1/marl/actor/scorer.py:
token rows, the images of vision-language prompts, every log-prob pass). Loading the model, policy and reference is
m1/marl/actor/learner_load.py; the actor's state on disk and the reload probe are m1/marl/actor/learner_io.py.

Old log-probs: with `grpo.old_logprobs: policy` (default) the surrogate uses `logp.detach()` — one update per
rollout batch, TRL's on-policy case, ratio exactly 1 with the gradient of logp. `rollout` uses the sampler's
log-probs instead, `sampler` weights each token by a truncated importance weight (the modes and the loss types are
registries in m1/marl/algo/reductions.py, the policy objectives in m1/marl/algo/objectives.py). Whenever the samples
carry the sampler's log-probs, `logp_gap` logs the mean |recomputed - sampled| log-prob, which should be ~0.

Gradient accumulation: an agent's samples of one step are split into micro-batches of `learner.micro_batch_size`;
each micro-batch loss is weighted so the accumulated gradient equals that of the whole step's batch (`grpo` and
`dr_grpo`: weight = micro size / step size; token-mean losses: normalised by the step's token count, as TRL's
`dapo`). One optimizer step per agent per training step.
"""
from __future__ import annotations

import time
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any

from m1.config import ModelSpec
from m1.marl.config import GRPOSettings, LearnerConfig
from m1.marl.actor.learner_load import LoadedPolicy, load_policy, reference
from m1.marl.actor.losses import LOSS_FAMILIES, StepSize, evidence_rows
from m1.marl.actor.optimizer import PolicyOptimizer
from m1.marl.rollout.episodes import Sample
from m1.marl.actor.sampler import Sampler
from m1.marl.actor.scorer import Scorer


def _accumulate(totals: dict[str, float], peaks: dict[str, float], stats: dict[str, float]) -> None:
    """Add a micro-batch's stats (already weighted against the step) to the step's: summed, or maxed for keys
    ending in `_max`."""
    for k, v in stats.items():
        if k.endswith("_max"):
            peaks[k] = max(peaks.get(k, v), v)
        else:
            totals[k] = totals.get(k, 0.0) + v


# ================================================================================================ one trained agent
@dataclass
class AgentLearner:
    """One trained agent as a pair on the same weights: `sampler`, the chat model the team generates with, and
    `actor`, which scores and updates them. `AgentLearner.build` loads both."""

    sampler: Sampler
    actor: Actor

    @classmethod
    def build(cls, agent: str, model_key: str, spec: ModelSpec, cfg: LearnerConfig, grpo: GRPOSettings,
              seed: int = 0, rank: int = 0, world: int = 1) -> AgentLearner:
        """Load `spec` as agent `agent`'s policy (rank `rank` of a ZeRO-2 group of `world`) and wrap it twice."""
        if world > 1 and not cfg.deepspeed:
            raise ValueError(f"agent {agent!r}: a learner on {world} GPUs is one ZeRO-2 group; set learner.deepspeed "
                             "(configs/deepspeed/zero2.json)")
        loaded = load_policy(agent, model_key, spec, cfg, grpo.beta, seed)
        actor = Actor(agent, model_key, loaded, cfg, grpo, rank, world)
        sampler = Sampler(agent, model_key, loaded.chat, loaded.policy, cfg, loaded.vl, loaded.context_length,
                          actor.autocast)
        return cls(sampler=sampler, actor=actor)


class Actor:
    """The update side of one agent: `compute_logprobs` of token rows at its current weights, and `update`, one
    optimizer step on the agent's samples of a training step under a registered loss family."""

    def __init__(self, agent: str, model_key: str, loaded: LoadedPolicy, cfg: LearnerConfig, grpo: GRPOSettings,
                 rank: int = 0, world: int = 1):
        self.agent, self.name, self.cfg, self.grpo = agent, model_key, cfg, grpo
        self.rank, self.world = rank, world
        self.policy, self.ref = loaded.policy, loaded.ref
        self.vl, self.bf16, self.weights_dtype = loaded.vl, loaded.bf16, loaded.weights_dtype
        self.tokenizer, self.device = loaded.chat.tokenizer, loaded.chat.device
        self.scorer = Scorer(agent, loaded.chat, cfg, self.vl)
        self.optim = PolicyOptimizer(agent, self.policy, cfg, self.device, loaded.ds_cfg)
        self.engine = self.scorer.engine = self.optim.engine
        self.updates = 0

    def autocast(self):
        import torch

        if self.bf16 and self.engine is None and str(self.device).startswith("cuda"):
            return torch.autocast("cuda", dtype=torch.bfloat16)
        return nullcontext()

    def compute_logprobs(self, rows: list[tuple[list[int], list[int]]], temperature: float | list[float],
                         vision: dict[str, Any] | None = None, model=None):
        """Log-probs [B, C] of each completion token given its prompt, and the mask [B, C], under `model` (default:
        the policy as the update runs it, through the DeepSpeed engine when there is one;
        `Scorer.completion_logprobs`)."""
        return self.scorer.completion_logprobs(self.forward_model() if model is None else model, rows, temperature,
                                               vision)

    def update(self, samples: list[Sample], lr: float, family: str = "grpo") -> dict[str, float]:
        """One optimizer step on all `samples` of this agent under the loss family `family` (m1/marl/actor/losses.py
        LOSS_FAMILIES: grpo, sft, or a registered one).

        In a learner group of W ranks every rank is handed the whole step and trains on its contiguous share of the
        step's length-sorted micro-batches (`_micro_batches`; a question's K rollouts share their prompt's forward).
        The family's loss is weighted against the whole step, times W here as
        DeepSpeed averages the ranks' gradients; ranks with fewer micro-batches run zero-weight ones so all ranks
        enter the same number of gradient reductions. The stats returned are the whole step's, on every rank.
        """
        if family not in LOSS_FAMILIES:
            raise ValueError(f"unknown loss family {family!r}; registered: {sorted(LOSS_FAMILIES)}")
        loss_family = LOSS_FAMILIES[family]
        t0 = time.perf_counter()
        self.optim.set_lr(lr)
        if not samples:
            return {"samples": 0.0, "lr": lr}
        self.policy.train()
        rows = self.scorer.rows(samples)
        needed = loss_family.carries_gradient if self.grpo.beta == 0 and self.cfg.skip_zero_advantage else None
        run = [i for i, s in enumerate(samples) if needed is None or needed(s, self.grpo)]
        step = StepSize(samples=len(samples), tokens=sum(len(c) for _, c in rows),
                        prompt_tokens=sum(len(p) - 1 for p, _ in rows), run_tokens=sum(len(rows[i][1]) for i in run),
                        evidence_rows=sum(len(evidence_rows(s, r)) for s, r in zip(samples, rows)))
        totals: dict[str, float] = {}  # sums over the step's tokens or samples
        peaks: dict[str, float] = {}  # maxima over the step
        loss_sum = 0.0
        for micro, micro_rows, weight in self._micro_batches([samples[i] for i in run], [rows[i] for i in run],
                                                             (samples[:1], rows[:1])):
            loss, stats = loss_family.loss(self, micro, micro_rows, step)
            if weight:  # a zero-weight micro-batch only keeps the ranks' reductions in step
                _accumulate(totals, peaks, stats)
            loss = loss * (weight * self.world)
            self.optim.backward(loss)
            loss_sum += float(loss.detach()) / self.world
        grad_norm = self.optim.step()
        self.weights_changed()
        self.updates += 1
        if self.world > 1:
            loss_sum, totals, peaks = _sum_over_ranks(loss_sum, totals, peaks)
        return {"loss": loss_sum, "grad_norm": grad_norm, "lr": lr, "samples": float(step.samples),
                "tokens": float(step.tokens), "samples_run": float(len(run)), "seconds": time.perf_counter() - t0,
                **totals, **peaks}

    def scoring(self, micro: list[Sample]):
        """The images and temperature of a micro-batch: the same for policy, reference and (sampler) old log-probs,
        and each sample scored at the temperature it was sampled with."""
        temps = [s.temperature for s in micro]
        return self.scorer.vision_inputs(micro), temps[0] if len(set(temps)) == 1 else temps

    def _micro_batches(self, samples: list[Sample], rows: list, pad: tuple[list[Sample], list]):
        """(samples, rows, weight) of each micro-batch this rank runs (weight 1.0 for real ones).

        The step's samples are sorted by length (identical prompts stay adjacent, so they still share their prompt
        pass) and cut into micro-batches of at most `micro_batch_size` rows and `micro_batch_tokens` padded tokens
        (each distinct prompt counted once, as the shared prompt pass runs it, plus every completion).
        Every rank of a learner group is handed the whole step, so each plans the same micro-batches, runs its
        contiguous share of them, then zero-weight micro-batches of `pad` (one sample of the step) up to the largest
        share: all ranks enter the same number of gradient reductions. A rank (or step) with nothing to run gets one,
        so every parameter gets a (zero) gradient and the optimizer step is the one a zero loss gives."""
        mb, budget = self.cfg.micro_batch_size, self.cfg.micro_batch_tokens
        order = sorted(range(len(samples)), key=lambda i: (len(rows[i][0]), rows[i][0], len(rows[i][1])))
        planned: list[list[int]] = []
        distinct = p_max = c_max = 0  # of the micro-batch being filled
        for i in order:
            prompt, completion = rows[i]
            cur = planned[-1] if planned else None
            new_prompt = cur is None or rows[cur[-1]][0] != prompt
            u = distinct + new_prompt if cur else 1
            p_len, c_len = max(p_max, len(prompt)), max(c_max, len(completion))
            # padded tokens: each distinct prompt once (the shared prompt pass), every completion
            if (cur is None or len(cur) >= mb
                    or (budget is not None and u * p_len + (len(cur) + 1) * c_len > budget)):
                planned.append([i])
                distinct, p_max, c_max = 1, len(prompt), len(completion)
            else:
                cur.append(i)
                distinct, p_max, c_max = u, p_len, c_len
        share = -(-len(planned) // self.world)
        mine = planned[self.rank * share:(self.rank + 1) * share]
        out = [([samples[i] for i in idx], [rows[i] for i in idx], 1.0) for idx in mine]
        while len(out) < max(share, 1):
            out.append((pad[0], pad[1], 0.0))
        return out

    def forward_model(self):
        return self.engine if self.engine is not None else self.policy

    def reference_model(self):
        return reference(self.policy, self.ref, self.cfg.finetune)

    def parameters(self) -> dict[str, Any]:
        """Trainable parameters by name, detached CPU copies (tests, Ray)."""
        return {n: p.detach().cpu().clone() for n, p in self.policy.named_parameters() if p.requires_grad}

    def weights_changed(self) -> None:
        """Tell the chat model's prefix cache its prompt keys are stale (m1/models/sampler.py). Its own check sees
        in-place writes to the parameters, not those through `.data` (DeepSpeed copies its updated partitions that
        way)."""
        if getattr(self.scorer.chat, "sampler", None) is not None:
            self.scorer.chat.sampler.cache.clear()


def _sum_over_ranks(loss: float, totals: dict[str, float],
                    peaks: dict[str, float]) -> tuple[float, dict[str, float], dict[str, float]]:
    """The step's loss and weighted stats summed, and its peak stats maxed, over the ranks of this process group."""
    import torch.distributed as dist

    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, (loss, totals, peaks))
    sums: dict[str, float] = {}
    maxima: dict[str, float] = {}
    for _, part, top in gathered:
        for k, v in part.items():
            sums[k] = sums.get(k, 0.0) + v
        for k, v in top.items():
            maxima[k] = max(maxima.get(k, v), v)
    return sum(x for x, _, _ in gathered), sums, maxima
