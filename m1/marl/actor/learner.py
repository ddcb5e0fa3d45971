"""One agent's learner: policy, reference and optimizer, and its optimizer step. The groups that hold one learner
per agent (`LocalLearners`, `RayLearners`) live in m1/marl/actor/groups.py.

Learners (`AgentLearner`) hold the policy (LoRA adapter through peft, or the full model), the reference (LoRA: the
same model with the adapter disabled; full: a frozen copy; none when beta = 0), and an AdamW optimizer, optionally
inside a DeepSpeed ZeRO-2 engine. Different agents may have different architectures and tokenizers: each learner
tokenises and scores its own samples. Three parts live beside this file: loading the model, policy and reference
(m1/marl/actor/learner_load.py), scoring samples (m1/marl/actor/scorer.py: token rows, the images of vision-language
prompts, every log-prob pass) and the learner's state on disk (m1/marl/actor/learner_io.py); this file is the update
and its losses.

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
from pathlib import Path
from typing import Any

from m1.config import ModelSpec
from m1.marl.config import GRPOSettings, LearnerConfig
from m1.marl.actor.distributed import deepspeed_engine
from m1.marl.actor.learner_io import export_learner_weights, load_learner, save_learner
from m1.marl.actor.learner_load import load_policy, reference
from m1.marl.actor.losses import LOSS_FAMILIES, StepSize, evidence_rows
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


# ================================================================================================ one agent's learner
class AgentLearner:
    """Policy, reference and optimizer of one agent, and its update; `sampler` is the chat model the team
    generates with (m1/marl/actor/sampler.py), on the same policy weights."""

    def __init__(self, agent: str, model_key: str, spec: ModelSpec, cfg: LearnerConfig, grpo: GRPOSettings,
                 seed: int = 0, rank: int = 0, world: int = 1):
        import torch

        self.agent, self.name, self.cfg, self.grpo = agent, model_key, cfg, grpo
        self.rank, self.world = rank, world
        if world > 1 and not cfg.deepspeed:
            raise ValueError(f"agent {agent!r}: a learner on {world} GPUs is one ZeRO-2 group; set learner.deepspeed "
                             "(configs/deepspeed/zero2.json)")
        loaded = load_policy(agent, model_key, spec, cfg, grpo.beta, seed)
        self.chat, self.policy, self.ref = loaded.chat, loaded.policy, loaded.ref
        self.vl, self.bf16, self.weights_dtype = loaded.vl, loaded.bf16, loaded.weights_dtype
        self.tokenizer, self.device = self.chat.tokenizer, self.chat.device
        self.scorer = Scorer(agent, self.chat, cfg, self.vl)
        self.params = [p for p in self.policy.parameters() if p.requires_grad]
        if not self.params:
            raise ValueError(f"agent {agent!r}: the model has no trainable parameters")
        # On a GPU the fused kernel: the default multi-tensor path makes full-size temporaries of the (ZeRO-flattened)
        # fp32 state at each step, 11.5 GiB for a 3B model, which decided whether a 3B full fine-tune fits on an A100
        fused = {"fused": True} if str(self.device).startswith("cuda") else {}
        self.optimizer = torch.optim.AdamW(self.params, lr=cfg.learning_rate(), betas=tuple(cfg.betas),
                                           eps=cfg.eps, weight_decay=cfg.weight_decay, **fused)
        self.engine = None
        if loaded.ds_cfg is not None:
            self.engine, self.optimizer = deepspeed_engine(self.policy, self.optimizer, loaded.ds_cfg)
        self.scorer.engine = self.engine
        self.updates = 0
        self.sampler = Sampler(agent, model_key, self.chat, self.policy, cfg, self.vl, loaded.context_length,
                               self.autocast)

    def autocast(self):
        import torch

        if self.bf16 and self.engine is None and str(self.device).startswith("cuda"):
            return torch.autocast("cuda", dtype=torch.bfloat16)
        return nullcontext()

    # -------------------------------------------------------------- scoring (m1/marl/actor/scorer.py)
    def sft_sample(self, ex) -> Sample:
        """An SFT example (m1/marl/sft.py) as this learner's `Sample` (`Scorer.sft_sample`)."""
        return self.scorer.sft_sample(ex)

    def vision_inputs(self, samples: list[Sample]) -> dict[str, Any] | None:
        """The images of the samples' prompts (`Scorer.vision_inputs`); None for a text learner."""
        return self.scorer.vision_inputs(samples)

    def completion_logprobs(self, model, rows: list[tuple[list[int], list[int]]], temperature: float | list[float],
                            vision: dict[str, Any] | None = None):
        """Log-probs [B, C] of each completion token given its prompt under `model`, and the mask [B, C]
        (`Scorer.completion_logprobs`)."""
        return self.scorer.completion_logprobs(model, rows, temperature, vision)

    # -------------------------------------------------------------- one optimizer step
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
        self._set_lr(lr)
        if not samples:
            return {"samples": 0.0, "lr": lr}
        self.policy.train()
        rows = self.scorer.rows(samples)
        skip_zero = loss_family.skips_zero_advantage and self.grpo.beta == 0 and self.cfg.skip_zero_advantage
        run = [i for i, s in enumerate(samples) if not (skip_zero and s.zero_advantage)]
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
            self._backward(loss)
            loss_sum += float(loss.detach()) / self.world
        grad_norm = self._step()
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
        return self.vision_inputs(micro), temps[0] if len(set(temps)) == 1 else temps

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

    def _set_lr(self, lr: float) -> None:
        for group in self.optimizer.param_groups:
            group["lr"] = lr

    def _backward(self, loss) -> None:
        if self.engine is not None:
            self.engine.backward(loss, scale_wrt_gas=False)  # we weight micro-batches ourselves
        else:
            loss.backward()

    def _step(self) -> float:
        import torch

        if self.engine is not None:
            self.engine.step()  # clips (gradient_clipping) and zeroes gradients
            norm = self.engine.get_global_grad_norm()
            return float(norm) if norm is not None else float("nan")
        if self.cfg.max_grad_norm is not None:
            norm = float(torch.nn.utils.clip_grad_norm_(self.params, self.cfg.max_grad_norm))
        else:
            norm = float(torch.linalg.vector_norm(torch.stack([
                torch.linalg.vector_norm(p.grad) for p in self.params if p.grad is not None])))
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return norm

    # -------------------------------------------------------------- state
    def parameters(self) -> dict[str, Any]:
        """Trainable parameters by name, detached CPU copies (tests, Ray)."""
        return {n: p.detach().cpu().clone() for n, p in self.policy.named_parameters() if p.requires_grad}

    def save(self, folder: str | Path, include_rng: bool = False) -> None:
        """Weights, optimizer state and optionally this process's RNG (m1/marl/actor/learner_io.py)."""
        save_learner(self, folder, include_rng)

    def load(self, folder: str | Path, include_rng: bool = False) -> None:
        """What `save` wrote (m1/marl/actor/learner_io.py)."""
        load_learner(self, folder, include_rng)
        self.weights_changed()

    def weights_changed(self) -> None:
        """Tell the sampler its cached prompt keys are stale (m1/models/sampler.py). Its own check sees in-place writes
        to the parameters, not those through `.data` (DeepSpeed copies its updated partitions that way)."""
        if getattr(self.chat, "sampler", None) is not None:
            self.chat.sampler.cache.clear()

    def export_weights(self, folder: str | Path) -> None:
        """The weights as a rollout engine loads them: the peft adapter folder (LoRA) or a whole HF model folder."""
        export_learner_weights(self, folder)

    def probe_logprobs(self, probe: tuple[list[int], list[int]]) -> tuple[list[float], float]:
        """The log-probs (temperature 1) of a rollout engine's reload probe at these weights, and how close the
        engine's must be after it loads them: float32 1e-3, else 0.1 (bf16 rounding), far below what a layer left
        at its old weights changes. Any rank can answer: every rank holds the whole weights (ZeRO-2 shards only
        gradients and optimizer state)."""
        import torch

        was_training = self.policy.training
        self.policy.eval()
        try:
            with torch.no_grad():
                logp, _ = self.completion_logprobs(self.policy, [probe], 1.0)
        finally:
            self.policy.train(was_training)
        dtype = next(self.policy.parameters()).dtype
        return logp[0, :len(probe[1])].tolist(), 1e-3 if dtype == torch.float32 else 0.1


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
