"""Multi-agent GRPO trainer: one learner per agent, trained jointly on the team's own rollouts.

One training step, top to bottom (`Trainer.train_step`):

1. take the next `questions_per_step` questions (a seeded permutation per epoch; the cursor is checkpointed);
2. sample one communication DAG for the step (random edges, agent dropout);
3. run every question K times over that DAG at temperature 1 through the `Team` engine — the agents generate with
   their learners' current weights, because each learner is registered in the model hub under its agent's key;
4. score every agent in every episode (R_res + R_format + R_col), normalise each agent's rewards within its K
   rollouts of a question (GRPO advantages), and turn every generation into a sample (m1/marl/rollout.py);
5. update each agent's learner: recompute the log-probs of its completions, add the clipped GRPO surrogate and
   beta * k3 KL to the reference (m1/marl/grpo.py), accumulate gradients over micro-batches, clip, AdamW step;
6. log metrics (JSONL, TensorBoard, progress bar) and checkpoint every `checkpoint.every` steps.

Learners (`AgentLearner`) hold the policy (LoRA adapter through peft, or the full model), the reference (LoRA: the
same model with the adapter disabled; full: a frozen copy; none when beta = 0), and an AdamW optimizer, optionally
inside a DeepSpeed ZeRO-2 engine. Different agents may have different architectures and tokenizers: each learner
tokenises and scores its own samples.

Old log-probs: with `grpo.old_logprobs: policy` (default) the surrogate uses `logp.detach()` — one update per
rollout batch, TRL's on-policy case, ratio exactly 1 with the gradient of logp. `rollout` uses the sampler's
log-probs instead. Either way `logp_gap` logs the mean |recomputed - sampled| log-prob, which should be ~0.

Gradient accumulation: an agent's samples of one step are split into micro-batches of `learner.micro_batch_size`;
each micro-batch loss is weighted so the accumulated gradient equals that of the whole step's batch (`grpo` and
`dr_grpo`: weight = micro size / step size; token-mean losses: normalised by the step's token count, as TRL's
`dapo`). One optimizer step per agent per training step.

Exact resume: a checkpoint holds each agent's weights (or adapter) and optimizer state, the Python/NumPy/torch RNG
states, the step and the data cursor. Rollout randomness (DAG, sampling seeds) is derived from (seed, step), so a
resumed run repeats an uninterrupted one exactly on CPU.
"""
from __future__ import annotations

import copy
import hashlib
import json
import logging
import math
import random
import shlex
import shutil
import time
from contextlib import nullcontext
from pathlib import Path
from typing import Any, Callable

from m1.config import ModelSpec, TeamConfig
from m1.marl.config import GRPOSettings, LearnerConfig, TrainConfig, load_train_config
from m1.marl.rewards import answer_rewards
from m1.marl.rollout import (RewardFn, RolloutError, Sample, advantages_for, agent_temperature, build_samples,
                             resample_answers, run_rollouts, sample_topology, score, training_team_config)

log = logging.getLogger(__name__)

CHECKPOINT_DIR = "checkpoints"
LATEST = "latest"


def derive_seed(*parts: Any) -> int:
    """A 31-bit seed from ints/strings, stable across processes (Python's str hash is salted per process)."""
    digest = hashlib.sha256(json.dumps([str(p) for p in parts]).encode()).digest()
    return int.from_bytes(digest[:4], "little") & 0x7FFFFFFF


# ================================================================================================ one agent's learner
class AgentLearner:
    """Policy, reference and optimizer of one agent; also a ChatModel (`name`, `generate`) for the team."""

    def __init__(self, agent: str, model_key: str, spec: ModelSpec, cfg: LearnerConfig, grpo: GRPOSettings,
                 seed: int = 0):
        import torch

        from m1.models.hf import HFChatModel, resolve_device

        self.agent, self.name, self.cfg, self.grpo = agent, model_key, cfg, grpo
        torch.manual_seed(derive_seed(seed, "learner", agent))  # LoRA init; a no-op for exactness when resuming
        device = resolve_device(spec.device)
        self.bf16 = cfg.precision == "bf16" or (cfg.precision == "auto" and device.startswith("cuda"))
        # Master weights in fp32: the paper's lr 1e-7 would round away in bf16 weights.
        self.chat = HFChatModel(spec.model_copy(update={"dtype": "float32"}), model_key)
        self.chat.name = model_key
        self.tokenizer = self.chat.tokenizer
        self.device = self.chat.device
        self._context_length = self.chat.context_length
        base = self.chat.model
        if cfg.gradient_checkpointing:
            base.gradient_checkpointing_enable()
        if cfg.finetune == "lora":
            from peft import LoraConfig, get_peft_model

            lora = cfg.lora
            policy = get_peft_model(base, LoraConfig(r=lora.r, lora_alpha=lora.alpha, lora_dropout=lora.dropout,
                                                     target_modules=list(lora.target_modules),
                                                     task_type="CAUSAL_LM"))
            self.ref = None  # the reference is the same model with the adapter disabled
        else:
            policy = base
            self.ref = copy.deepcopy(base).eval().requires_grad_(False) if grpo.beta > 0 else None
        self.policy = policy
        self.chat.model = policy  # the team generates with the weights being trained
        self.params = [p for p in policy.parameters() if p.requires_grad]
        if not self.params:
            raise ValueError(f"agent {agent!r}: the model has no trainable parameters")
        self.optimizer = torch.optim.AdamW(self.params, lr=cfg.learning_rate(), betas=tuple(cfg.betas),
                                           eps=cfg.eps, weight_decay=cfg.weight_decay)
        self.engine = None
        if cfg.deepspeed:
            from m1.marl.distributed import deepspeed_engine, resolve_ds_config

            ds_cfg = resolve_ds_config(cfg.deepspeed, micro_batch_size=cfg.micro_batch_size,
                                       max_grad_norm=cfg.max_grad_norm, bf16=self.bf16)
            self.engine, self.optimizer = deepspeed_engine(policy, self.optimizer, ds_cfg)
            self.bf16 = bool(ds_cfg.get("bf16", {}).get("enabled"))
        self.updates = 0

    # -------------------------------------------------------------- generation (ChatModel protocol)
    def ready(self) -> bool:
        return True

    def generate(self, requests, params):
        """Sample with the current weights, under the same length caps the update uses.

        Prompts keep their last `max_prompt_tokens` tokens and completions stop at `max_completion_tokens` (the
        chat model truncates prompts to fit its context length), so the token ids a sample carries are exactly
        the context and the tokens that get trained: sampler and learner score the same conditional.
        """
        from dataclasses import replace

        self.policy.eval()  # no dropout while sampling
        params = replace(params, max_new_tokens=min(params.max_new_tokens, self.cfg.max_completion_tokens))
        cap = self.cfg.max_prompt_tokens + params.max_new_tokens
        self.chat.context_length = cap if self._context_length is None else min(self._context_length, cap)
        with self._autocast():
            return self.chat.generate(requests, params)

    def _autocast(self):
        import torch

        if self.bf16 and self.engine is None and str(self.device).startswith("cuda"):
            return torch.autocast("cuda", dtype=torch.bfloat16)
        return nullcontext()

    # -------------------------------------------------------------- scoring
    def _rows(self, samples: list[Sample]) -> list[tuple[list[int], list[int]]]:
        """(prompt, completion) ids cut to the configured lengths: prompts keep their end, completions their start."""
        p_max, c_max = self.cfg.max_prompt_tokens, self.cfg.max_completion_tokens
        return [(s.prompt_ids[-p_max:], s.completion_ids[:c_max]) for s in samples]

    def completion_logprobs(self, model, rows: list[tuple[list[int], list[int]]], temperature: float):
        """Log-probs [B, C] of each completion token given its prompt, and the mask [B, C] of real tokens.

        Prompts are left-padded and completions right-padded so all completions start at one column; positions
        count real tokens only (as `generate` does with left padding), so the values match the sampler's.
        GRPO's K completions of a question share one prompt: when rows repeat prompts (and `share_prompt_forward`
        is on), each distinct prompt is run once and its key/value cache is reused by its completions.
        """
        prompts = list(dict.fromkeys(tuple(p) for p, _ in rows))
        longest = max(len(c) for _, c in rows)
        if (self.cfg.share_prompt_forward and len(prompts) < len(rows) and longest > 0
                and self._can_share_prompt(model)):
            return self._shared_prompt_logprobs(model, rows, [list(p) for p in prompts], temperature)
        return self._joint_logprobs(model, rows, temperature)

    def _joint_logprobs(self, model, rows: list[tuple[list[int], list[int]]], temperature: float):
        """One forward over prompt + completion for every row (no sharing)."""
        import torch

        from m1.marl.grpo import token_logprobs

        pad = self.tokenizer.pad_token_id
        p_len = max(len(p) for p, _ in rows)
        c_len = max(len(c) for _, c in rows)
        ids, attn, cmask = [], [], []
        for p, c in rows:
            lp, rc = p_len - len(p), c_len - len(c)
            ids.append([pad] * lp + p + c + [pad] * rc)
            attn.append([0] * lp + [1] * (len(p) + len(c)) + [0] * rc)
            cmask.append([1.0] * len(c) + [0.0] * rc)
        input_ids = torch.tensor(ids, device=self.device)
        attention = torch.tensor(attn, device=self.device)
        positions = (attention.cumsum(-1) - 1).clamp(min=0)
        out = model(input_ids=input_ids, attention_mask=attention, position_ids=positions,
                    logits_to_keep=c_len + 1, use_cache=False)
        logits = out.logits[:, :-1]  # the logits at column P-1+t score completion token t
        logp = token_logprobs(logits, input_ids[:, p_len:], temperature)
        return logp, torch.tensor(cmask, device=self.device)

    def _can_share_prompt(self, model) -> bool:
        """Whether a prompt's cache can be carried into a second forward with gradient intact.

        Not through a DeepSpeed engine: each engine forward hooks its outputs to run the engine's backward
        prologue (ZeRO `enter_backward`, callback queueing), so with the prompt pass's cache feeding the completion
        pass the prologue runs twice in one backward. On one CPU rank (ZeRO-2, fp32) the gradients still match the
        joint pass, but multi-rank reduction under a doubled prologue is untested, so the engine keeps the joint
        pass. Not with gradient checkpointing in training (the layers drop the cache), nor with sliding-window
        layers (their cache is cut to the window).
        """
        if self.engine is not None and model is self.engine:
            return False
        if self.cfg.gradient_checkpointing and model.training:
            return False
        base = model.get_base_model() if hasattr(model, "get_base_model") else model
        config = base.config
        layer_types = getattr(config, "layer_types", None)
        if layer_types is not None:
            return all(t == "full_attention" for t in layer_types)
        return not getattr(config, "use_sliding_window", False)

    def _shared_prompt_logprobs(self, model, rows: list[tuple[list[int], list[int]]], prompts: list[list[int]],
                                temperature: float):
        """`_joint_logprobs` computed with one forward per distinct prompt and one over the completions.

        Pass 1 runs the U distinct prompts (left-padded) with a cache, under the caller's grad mode, so gradient
        reaches the prompt's keys and values exactly as in the joint pass; its last column scores completion
        token 0. The cache is then gathered to the B rows (the gather's backward sums the K rows' gradients back
        into their shared prompt). Pass 2 runs completion tokens 0..C-2 (right-padded) on that cache, with the
        attention mask [prompt mask, completion mask] and positions continuing after each prompt's real tokens;
        its logits score tokens 1..C-1.
        """
        import torch
        from transformers.cache_utils import DynamicCache, DynamicLayer

        from m1.marl.grpo import token_logprobs

        pad = self.tokenizer.pad_token_id
        which = {tuple(p): i for i, p in enumerate(prompts)}
        group = torch.tensor([which[tuple(p)] for p, _ in rows], device=self.device)
        p_len = max(len(p) for p in prompts)
        c_len = max(len(c) for _, c in rows)
        p_ids = torch.tensor([[pad] * (p_len - len(p)) + p for p in prompts], device=self.device)
        p_attn = torch.tensor([[0] * (p_len - len(p)) + [1] * len(p) for p in prompts], device=self.device)
        c_ids = torch.tensor([c + [pad] * (c_len - len(c)) for _, c in rows], device=self.device)
        c_attn = torch.tensor([[1] * len(c) + [0] * (c_len - len(c)) for _, c in rows], device=self.device)

        out = model(input_ids=p_ids, attention_mask=p_attn, position_ids=(p_attn.cumsum(-1) - 1).clamp(min=0),
                    logits_to_keep=1, use_cache=True)
        first = token_logprobs(out.logits[group], c_ids[:, :1], temperature)  # [B, 1]
        if c_len == 1:
            return first, c_attn.float()
        cache = out.past_key_values
        if not isinstance(cache, DynamicCache) or any(type(layer) is not DynamicLayer or
                                                      layer.get_seq_length() != p_len for layer in cache.layers):
            raise RuntimeError(f"agent {self.agent!r}: the prompt pass returned {type(cache).__name__} "
                               f"({[type(layer).__name__ for layer in getattr(cache, 'layers', [])][:3]}...), "
                               f"not a full-attention DynamicCache of {p_len} tokens; set "
                               "learner.share_prompt_forward: false for this model")
        cache.batch_select_indices(group)
        attention = torch.cat([p_attn[group], c_attn[:, :-1]], dim=1)
        positions = (attention.cumsum(-1) - 1).clamp(min=0)[:, p_len:]
        out = model(input_ids=c_ids[:, :-1], attention_mask=attention, position_ids=positions,
                    past_key_values=cache, use_cache=True)
        rest = token_logprobs(out.logits, c_ids[:, 1:], temperature)  # [B, C-1]
        return torch.cat([first, rest], dim=1), c_attn.float()

    def _padded(self, values: list[list[float] | None], width: int):
        import torch

        rows = []
        for v in values:
            if v is None:
                raise ValueError(f"agent {self.agent!r}: grpo.old_logprobs=rollout needs the sampler's log-probs")
            v = list(v[:width])
            rows.append(v + [0.0] * (width - len(v)))
        return torch.tensor(rows, device=self.device, dtype=torch.float32)

    # -------------------------------------------------------------- one optimizer step
    def update(self, samples: list[Sample], lr: float, objective: str = "grpo") -> dict[str, float]:
        """One optimizer step on all `samples` of this agent (GRPO, or cross-entropy for `objective="sft"`)."""
        import torch

        from m1.marl.grpo import grpo_loss

        if objective not in ("grpo", "sft"):
            raise ValueError(f"objective must be 'grpo' or 'sft', got {objective!r}")
        t0 = time.perf_counter()
        self._set_lr(lr)
        if not samples:
            return {"samples": 0.0, "lr": lr}
        temps = {s.temperature for s in samples}
        if len(temps) != 1:
            raise ValueError(f"agent {self.agent!r}: samples of one step mix temperatures {sorted(temps)}")
        temperature = temps.pop()
        self.policy.train()
        rows = self._rows(samples)
        n_samples = len(samples)
        n_tokens = sum(len(c) for _, c in rows)
        mb = self.cfg.micro_batch_size
        g = self.grpo
        token_level = g.loss_type in ("bnpo", "token-mean", "dapo")
        totals: dict[str, float] = {}

        def add(key: str, value: float, weight: float) -> None:
            totals[key] = totals.get(key, 0.0) + value * weight

        loss_sum = 0.0
        for start in range(0, n_samples, mb):
            micro, micro_rows = samples[start:start + mb], rows[start:start + mb]
            with self._autocast():
                logp, mask = self.completion_logprobs(self._forward_model(), micro_rows, temperature)
            tokens = float(mask.sum())
            if objective == "sft":
                loss = -(logp * mask).sum() / max(n_tokens, 1)  # token mean over the whole step
                add("nll", float(-(logp.detach() * mask).sum()), 1.0 / max(n_tokens, 1))
            else:
                ref = None
                if g.beta > 0:
                    with torch.no_grad(), self._autocast(), self._reference() as ref_model:
                        ref, _ = self.completion_logprobs(ref_model, micro_rows, temperature)
                old = None
                if g.old_logprobs == "rollout":
                    old = self._padded([s.logprobs for s in micro], logp.shape[1])
                adv = torch.tensor([s.advantage for s in micro], device=self.device, dtype=torch.float32)
                if token_level:
                    loss, stats = grpo_loss(logp, old, ref, adv, mask, beta=g.beta, clip_eps_low=g.clip_eps_low,
                                            clip_eps_high=g.clip_eps_high, loss_type="dapo",
                                            num_items_in_batch=n_tokens)
                else:
                    loss, stats = grpo_loss(logp, old, ref, adv, mask, beta=g.beta, clip_eps_low=g.clip_eps_low,
                                            clip_eps_high=g.clip_eps_high, loss_type=g.loss_type,
                                            max_completion_length=self.cfg.max_completion_tokens)
                    loss = loss * (len(micro) / n_samples)
                for key in ("kl", "clip_frac", "ratio_mean"):
                    if key in stats:
                        add(key, stats[key], tokens / max(n_tokens, 1))
                gap = [s.logprobs for s in micro]
                if all(x is not None for x in gap):
                    sampled = self._padded(gap, logp.shape[1])
                    add("logp_gap", float(((logp.detach() - sampled).abs() * mask).sum()), 1.0 / max(n_tokens, 1))
            self._backward(loss)
            loss_sum += float(loss.detach())
        grad_norm = self._step()
        self.updates += 1
        return {"loss": loss_sum, "grad_norm": grad_norm, "lr": lr, "samples": float(n_samples),
                "tokens": float(n_tokens), "seconds": time.perf_counter() - t0, **totals}

    def _forward_model(self):
        return self.engine if self.engine is not None else self.policy

    def _reference(self):
        if self.cfg.finetune == "lora":
            return _AdapterOff(self.policy)
        return nullcontext(self.ref)

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
        """Weights (HF folder, or the peft adapter folder), optimizer state, and optionally this process's RNG."""
        import torch

        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        weights = folder / ("adapter" if self.cfg.finetune == "lora" else "model")
        self.policy.save_pretrained(weights)
        self.tokenizer.save_pretrained(weights)
        if self.engine is not None:
            self.engine.save_checkpoint(str(folder / "deepspeed"), tag="state", exclude_frozen_parameters=True)
        else:
            torch.save(self.optimizer.state_dict(), folder / "optimizer.pt")
        state: dict[str, Any] = {"agent": self.agent, "model_key": self.name, "updates": self.updates,
                                 "finetune": self.cfg.finetune}
        (folder / "learner.json").write_text(json.dumps(state, indent=2))
        if include_rng:
            torch.save(_rng_state(), folder / "rng.pt")

    def load(self, folder: str | Path, include_rng: bool = False) -> None:
        import torch

        folder = Path(folder)
        state = json.loads((folder / "learner.json").read_text())
        if state["finetune"] != self.cfg.finetune:
            raise ValueError(f"{folder}: checkpoint is a {state['finetune']} run, the config says "
                             f"{self.cfg.finetune}")
        if self.cfg.finetune == "lora":
            from peft import set_peft_model_state_dict

            set_peft_model_state_dict(self.policy, read_safetensors(folder / "adapter", "adapter_model"))
        else:
            _load_full(self.policy, read_safetensors(folder / "model", "model"), folder / "model")
        if self.engine is not None:
            self.engine.load_checkpoint(str(folder / "deepspeed"), tag="state", load_module_strict=False)
        else:
            self.optimizer.load_state_dict(torch.load(folder / "optimizer.pt", weights_only=False))
        self.updates = int(state["updates"])
        if include_rng:
            _set_rng_state(torch.load(folder / "rng.pt", weights_only=False))


class _AdapterOff:
    """`with _AdapterOff(peft_model) as ref:` — the base model (LoRA reference) for the block's duration."""

    def __init__(self, model):
        self.model, self._ctx = model, None

    def __enter__(self):
        self._ctx = self.model.disable_adapter()
        self._ctx.__enter__()
        return self.model

    def __exit__(self, *exc):
        return self._ctx.__exit__(*exc)


def read_safetensors(folder: Path, stem: str) -> dict[str, Any]:
    """All tensors of a (possibly sharded) safetensors checkpoint in `folder`."""
    from safetensors.torch import load_file

    single = folder / f"{stem}.safetensors"
    if single.is_file():
        return load_file(single)
    index = folder / f"{stem}.safetensors.index.json"
    if not index.is_file():
        raise FileNotFoundError(f"{folder}: neither {single.name} nor {index.name}")
    out: dict[str, Any] = {}
    for shard in sorted(set(json.loads(index.read_text())["weight_map"].values())):
        out.update(load_file(folder / shard))
    return out


def _load_full(model, state: dict[str, Any], where: Path) -> None:
    missing, unexpected = model.load_state_dict(state, strict=False)
    tied = set(getattr(model, "_tied_weights_keys", None) or [])
    if isinstance(getattr(model, "_tied_weights_keys", None), dict):
        tied = set(model._tied_weights_keys)
    missing = [k for k in missing if k not in tied]
    if missing or unexpected:
        raise ValueError(f"{where}: weights do not match the model (missing {missing[:5]}, "
                         f"unexpected {unexpected[:5]})")


def _rng_state() -> dict[str, Any]:
    import numpy as np
    import torch

    return {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else []}


def _set_rng_state(state: dict[str, Any]) -> None:
    import numpy as np
    import torch

    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if state.get("cuda") and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def seed_everything(seed: int) -> None:
    import numpy as np
    import torch

    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


# ================================================================================================ learner groups
class LocalLearners:
    """All learners in this process (one device per agent, or all on CPU)."""

    saves_own_rng = False  # they share the process RNG, which the trainer checkpoints

    def __init__(self, specs: dict[str, tuple[str, ModelSpec]], learner_cfg: LearnerConfig, grpo: GRPOSettings,
                 seed: int):
        self.learners = {agent: AgentLearner(agent, key, spec, learner_cfg, grpo, seed)
                         for agent, (key, spec) in specs.items()}

    def chat_models(self) -> dict[str, AgentLearner]:
        return dict(self.learners)

    def update(self, samples: dict[str, list[Sample]], lr: float, objective: str = "grpo") -> dict[str, dict]:
        return {a: learner.update(samples.get(a, []), lr, objective) for a, learner in self.learners.items()}

    def save(self, folder: Path) -> None:
        for agent, learner in self.learners.items():
            learner.save(Path(folder) / agent)

    def load(self, folder: Path) -> None:
        for agent, learner in self.learners.items():
            learner.load(Path(folder) / agent)

    def parameters(self, agent: str) -> dict[str, Any]:
        return self.learners[agent].parameters()

    def shutdown(self) -> None:
        pass


def build_learners(specs: dict[str, tuple[str, ModelSpec]], learner_cfg: LearnerConfig, grpo: GRPOSettings,
                   seed: int, placement: str = "local", ray_cfg=None):
    if placement == "ray":
        from m1.marl.distributed import RayLearners

        return RayLearners(specs, learner_cfg, grpo, seed, ray_cfg)
    return LocalLearners(specs, learner_cfg, grpo, seed)


# ================================================================================================ metrics
class MetricsLog:
    """metrics.jsonl (one line per step), TensorBoard scalars when available, and a tqdm bar."""

    def __init__(self, out_dir: Path, total: int, start: int, tensorboard: bool, progress: bool):
        self.path = out_dir / "metrics.jsonl"
        out_dir.mkdir(parents=True, exist_ok=True)
        if self.path.exists():  # keep only steps up to the checkpoint we resume from (drop a killed run's tail)
            kept = []
            for i, line in enumerate(self.path.read_text().splitlines(), 1):
                if not line.strip():
                    continue
                try:
                    step = json.loads(line).get("step", 0)
                except json.JSONDecodeError:
                    log.warning("%s:%d: dropping a torn line left by a killed run", self.path, i)
                    continue
                if step <= start:
                    kept.append(line)
            self.path.write_text("".join(line + "\n" for line in kept))
        self.writer = None
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter

                self.writer = SummaryWriter(str(out_dir / "tensorboard"))
            except ImportError:
                log.warning("tensorboard is not installed: metrics go to %s only", self.path)
        self.bar = None
        if progress:
            from tqdm.auto import tqdm

            self.bar = tqdm(total=total, initial=start, desc="train", unit="step", dynamic_ncols=True)

    def write(self, row: dict[str, Any]) -> None:
        clean = {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in row.items()}
        with self.path.open("a") as f:
            f.write(json.dumps(clean) + "\n")
        if self.writer is not None:
            for k, v in row.items():
                if isinstance(v, (int, float)) and k != "step" and math.isfinite(v):
                    self.writer.add_scalar(k, v, row["step"])
            self.writer.flush()
        if self.bar is not None:
            self.bar.update(1)
            self.bar.set_postfix(loss=f"{row.get('loss', float('nan')):.4f}",
                                 reward=f"{row.get('reward/mean', float('nan')):.3f}")

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
        if self.bar is not None:
            self.bar.close()


# ================================================================================================ data
class QuestionStream:
    """Items (questions; SFT examples) in a fresh seeded order every epoch; `cursor` counts items handed out."""

    def __init__(self, questions: list, seed: int, shuffle: bool = True):
        if not questions:
            raise ValueError("no training questions")
        self.questions, self.seed, self.shuffle = list(questions), seed, shuffle
        self.cursor = 0
        self._order: tuple[int, list[int]] | None = None

    def _epoch_order(self, epoch: int) -> list[int]:
        import numpy as np

        if self._order is None or self._order[0] != epoch:
            n = len(self.questions)
            order = (np.random.default_rng([self.seed, epoch]).permutation(n).tolist() if self.shuffle
                     else list(range(n)))
            self._order = (epoch, order)
        return self._order[1]

    def take(self, n: int) -> list:
        out = []
        for _ in range(n):
            epoch, i = divmod(self.cursor, len(self.questions))
            out.append(self.questions[self._epoch_order(epoch)[i]])
            self.cursor += 1
        return out

    @property
    def epoch(self) -> float:
        return self.cursor / len(self.questions)


def load_questions(path: str | None, video_dir: str | None) -> list:
    from m1.run import read_questions

    if not path:
        raise ValueError("data.questions: no questions file given")
    qs, issues = read_questions(Path(path), Path(video_dir) if video_dir else None)
    for msg in issues:
        log.warning("skipped question: %s", msg)
    if not qs:
        raise ValueError(f"{path}: no usable questions ({len(issues)} skipped)")
    return qs


def build_judge(cfg: TrainConfig):
    from m1.marl.judge import LLMJudge, RubricJudge

    j = cfg.judge
    if j.kind == "none":
        return None
    if j.kind == "rubric":
        return RubricJudge(tool_call_limit=cfg.rewards.tool_call_limit)
    from m1.models.hub import ModelHub

    model = ModelHub({"judge": j.model}).chat("judge")
    cache = j.cache_dir or str(Path(cfg.out_dir) / "judge_cache")
    return LLMJudge(model, cache_dir=cache, rate_per_minute=j.rate_per_minute,
                    tool_call_limit=cfg.rewards.tool_call_limit)


# ================================================================================================ the trainer
class Trainer:
    """Multi-agent GRPO over a team. `train()` runs to `cfg.steps`, resuming from out_dir's newest checkpoint."""

    def __init__(self, cfg: TrainConfig, questions: list | None = None, hub=None, reward_fn: RewardFn | None = None,
                 judge=None):
        from m1.models.hub import ModelHub
        from m1.video import VideoPool

        self.cfg = cfg
        seed_everything(cfg.seed)
        self.team_cfg = training_team_config(cfg.team_config(), cfg.rollout.temperature)
        self.agents = [a.name for a in self.team_cfg.agents]
        self.trained = list(cfg.train_agents or self.agents)
        self.temperatures = {a: agent_temperature(self.team_cfg, a) for a in self.trained}
        self.hub = hub if hub is not None else ModelHub(self.team_cfg.models)
        self.hub.specs.update(self.team_cfg.models)  # split keys of agents that shared a model
        self.pool = VideoPool()
        self.data = QuestionStream(questions if questions is not None else
                                   load_questions(cfg.data.questions, cfg.data.video_dir), cfg.seed, cfg.data.shuffle)
        key_of = self.model_keys = {a.name: a.model for a in self.team_cfg.agents}
        specs = {a: (key_of[a], self.team_cfg.models[key_of[a]]) for a in self.trained}
        self.learners = build_learners(specs, cfg.learner, cfg.grpo, cfg.seed, cfg.placement, cfg.ray)
        for agent, chat in self.learners.chat_models().items():
            self.hub.register(key_of[agent], chat, kind="chat")
        self.judge = judge
        if reward_fn is None:
            from m1.marl.rewards import batch_agent_rewards

            self.judge = judge if judge is not None else build_judge(cfg)
            reward_fn = lambda eps: batch_agent_rewards(eps, cfg.rewards, self.judge)  # noqa: E731
        self.reward_fn = reward_fn
        self.out = Path(cfg.out_dir)
        self.step = 0
        self.history: list[dict[str, Any]] = []
        if cfg.checkpoint.resume:
            latest = find_latest_checkpoint(self.out)
            if latest is not None:
                self.load_checkpoint(latest)
        if cfg.average.include_start and self.step == 0:
            self.save_start()

    # ------------------------------------------------------------------ the loop
    def train(self, stop_after: int | None = None) -> list[dict[str, Any]]:
        """Train until `cfg.steps` (or `stop_after` more steps, e.g. to simulate a killed run)."""
        cfg = self.cfg
        last = cfg.steps if stop_after is None else min(cfg.steps, self.step + stop_after)
        logger = MetricsLog(self.out, cfg.steps, self.step, cfg.log.tensorboard, cfg.log.progress)
        try:
            while self.step < last:
                row = self.train_step()
                logger.write(row)
                self.history.append(row)
                if self.step % cfg.checkpoint.every == 0 or self.step == cfg.steps:
                    self.save_checkpoint()
        finally:
            logger.close()
        if self.step == cfg.steps and cfg.average.checkpoints:
            self.write_average()
        return self.history

    def train_step(self) -> dict[str, Any]:
        cfg, step = self.cfg, self.step
        t0 = time.perf_counter()

        # 1-2. this step's questions and its communication DAG (agent dropout)
        questions = self.data.take(cfg.rollout.questions_per_step)
        topology = sample_topology(self.agents, cfg.rollout.topology, cfg.rollout.edge_prob, cfg.rollout.dropout,
                                   random.Random(derive_seed(cfg.seed, step, "topology")))

        # 3. K episodes per question, generated with the current weights
        team = self._team(step)
        batch = run_rollouts(team, questions, cfg.rollout.num_generations, topology, cfg.rollout.rotate_options)
        greedy = None  # grpo.baseline greedy: each question once more, greedily, as the baseline (not trained on)
        if cfg.grpo.baseline == "greedy":
            greedy = run_rollouts(self._team(step, greedy=True), questions, 1, topology)
        t_rollout = time.perf_counter()

        # 4. rewards -> per-agent group advantages -> one sample per generation
        rewards = score(batch, self.trained, self.reward_fn)
        base = score(greedy, self.trained, self.reward_fn) if greedy is not None else None
        advantages = advantages_for(rewards, cfg.grpo.scale_rewards, base)
        answer_adv = None
        if cfg.rollout.credit == "phase":  # answers: the advantage of their own outcome only
            if not batch.outcomes:
                raise RolloutError("rollout.credit 'phase' needs rewards with an `outcome` part (RewardBreakdown); "
                                   "this reward function returns plain numbers")
            answer_adv = advantages_for(batch.outcomes, cfg.grpo.scale_rewards,
                                        greedy.outcomes if greedy is not None else None)
        answer_groups = []
        if cfg.rollout.answer_samples:  # answers: M more per answer prompt, credited within that prompt's answers
            answer_groups = resample_answers(
                batch, self.trained, lambda a: self.hub.chat(self.model_keys[a]), cfg.rollout.answer_samples,
                self.temperatures, self.team_cfg.limits.answer_tokens, derive_seed(cfg.seed, step, "answers"),
                lambda pairs: answer_rewards(pairs, cfg.rewards, self.judge), cfg.grpo.scale_rewards)
        samples = build_samples(batch, advantages, self.temperatures, answer_adv, answer_groups,
                                cfg.rollout.train_phases)
        t_reward = time.perf_counter()

        # 5. one optimizer step per agent
        stats = self.learners.update(samples, self.lr_at(step), "grpo")
        self.step += 1
        t_end = time.perf_counter()

        # 6. metrics
        row = self._metrics(batch, rewards, advantages, stats, topology, answer_groups,
                            {"rollout": t_rollout - t0, "reward": t_reward - t_rollout, "update": t_end - t_reward,
                             "step": t_end - t0})
        if greedy is not None:  # the greedy team on this step's questions: what evaluation measures
            flat = [r for a in base for g in base[a] for r in g if not math.isnan(r)]
            row["greedy/reward"] = sum(flat) / len(flat) if flat else float("nan")
            if all(hasattr(v, "team_res") for per in greedy.breakdowns for v in per.values()):
                from m1.marl.rewards import summarize

                row.update({f"greedy/{k.split('/', 1)[1]}": v for k, v in summarize(greedy.breakdowns).items()
                            if k in ("reward/res", "reward/team_res")})
        return row

    def _team(self, step: int, greedy: bool = False):
        """One team for the whole run (so CLIP embeddings and decoded frames are reused), reseeded
        from (seed, step) so rollouts repeat exactly after a resume; `greedy`: its copy decoding greedily."""
        from m1.team.cpp import Team

        name = "_greedy_team" if greedy else "_team_obj"
        if getattr(self, name, None) is None:
            cfg = self.team_cfg.greedy() if greedy else self.team_cfg
            setattr(self, name, Team(cfg, hub=self.hub, pool=self.pool))
        team = getattr(self, name)
        team.reseed(derive_seed(self.cfg.seed, step, "greedy" if greedy else "sampling"))
        return team

    def lr_at(self, step: int) -> float:
        return self.cfg.learner.lr_at(step, self.cfg.steps)

    def _metrics(self, batch, rewards, advantages, stats, topology, answer_groups, seconds) -> dict[str, Any]:
        import torch

        row: dict[str, Any] = {"step": self.step, "epoch": self.data.epoch, "lr": self.lr_at(self.step - 1)}
        losses = [s["loss"] for s in stats.values() if "loss" in s]
        row["loss"] = sum(losses) / len(losses) if losses else float("nan")
        all_r = [r for a in rewards for g in rewards[a] for r in g if not math.isnan(r)]
        row["reward/mean"] = sum(all_r) / len(all_r) if all_r else float("nan")
        for agent, st in stats.items():
            for k, v in st.items():
                row[f"{agent}/{k}"] = v
            adv = advantages[agent]
            row[f"{agent}/adv_abs_mean"] = float(torch.as_tensor(adv).abs().mean()) if adv.numel() else 0.0
            flat = [r for g in rewards[agent] for r in g if not math.isnan(r)]
            row[f"{agent}/reward"] = sum(flat) / len(flat) if flat else float("nan")
        if batch.breakdowns and all(hasattr(v, "res") for per in batch.breakdowns for v in per.values()):
            from m1.marl.rewards import summarize

            row.update(summarize(batch.breakdowns))
        if answer_groups:  # how often the resampled answers disagreed (only those groups carry signal)
            row["answer_groups/reward"] = sum(sum(x.rewards) for x in answer_groups) / sum(
                len(x.rewards) for x in answer_groups)
            row["answer_groups/mixed"] = sum(max(x.rewards) > min(x.rewards) for x in answer_groups) / len(
                answer_groups)
        row["topology/active"] = len(topology.active)
        row["topology/edges"] = len(topology.edges)
        row["episodes/failed"] = sum(e.error is not None for e in batch.flat)
        row.update({f"time/{k}": v for k, v in seconds.items()})
        return row

    # ------------------------------------------------------------------ checkpoints
    def save_checkpoint(self) -> Path:
        return save_checkpoint(self.out, self.step, self.learners, self._state(), self.cfg.checkpoint.keep_last)

    def save_start(self) -> None:
        """The weights before the first update, for average.include_start (written once, atomically)."""
        from m1.marl.average import START_DIR

        final = self.out / START_DIR
        if (final / "agents").is_dir():
            return
        tmp = self.out / f".{START_DIR}.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        self.learners.save(tmp / "agents")
        tmp.rename(final)

    def write_average(self) -> Path:
        """<out>/average: the mean of the newest `average.checkpoints` checkpoints (and the start), unless the
        folder already holds exactly those members."""
        from m1.marl.average import AVERAGE_DIR, START_DIR, write_average

        avg = self.cfg.average
        done = finished_checkpoints(self.out)
        members = done[-avg.checkpoints:]
        if len(members) < avg.checkpoints or members[-1].name != f"step-{self.cfg.steps:06d}":
            raise FileNotFoundError(f"{self.out / CHECKPOINT_DIR}: average.checkpoints={avg.checkpoints} needs that "
                                    f"many checkpoints ending at step {self.cfg.steps}; found "
                                    f"{[p.name for p in done]}")
        names = ([START_DIR] if avg.include_start else []) + [p.name for p in members]
        info = self.out / AVERAGE_DIR / "average.json"
        if info.is_file() and json.loads(info.read_text()).get("members") == names:
            return info.parent
        folder = write_average(self.out, members, self.trained, self.cfg.learner.finetune, avg.include_start)
        log.info("averaged %s into %s", names, folder)
        return folder

    def _state(self) -> dict[str, Any]:
        return {"step": self.step, "cursor": self.data.cursor, "seed": self.cfg.seed, "agents": self.trained,
                "name": self.cfg.name, "config": self.cfg.model_dump(mode="json")}

    def load_checkpoint(self, folder: Path) -> None:
        state = load_checkpoint(folder, self.learners, self.trained, self.cfg.seed)
        self.step, self.data.cursor = int(state["step"]), int(state["cursor"])
        log.info("resumed from %s (step %d)", folder, self.step)

    def close(self) -> None:
        self.learners.shutdown()



def save_checkpoint(out_dir: Path, step: int, learners, state: dict[str, Any], keep_last: int) -> Path:
    """Write <out>/checkpoints/step-NNNNNN atomically (temp folder, then rename); keep the newest `keep_last`.

    Holds every learner's weights/adapter and optimizer, the process RNG states and `state` (step, data cursor...).
    """
    import torch

    root = Path(out_dir) / CHECKPOINT_DIR
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"step-{step:06d}"
    tmp = root / f".{final.name}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    learners.save(tmp / "agents")
    torch.save(_rng_state(), tmp / "rng.pt")
    (tmp / "trainer_state.json").write_text(json.dumps(state, indent=2))
    shutil.rmtree(final, ignore_errors=True)
    tmp.rename(final)
    (root / LATEST).write_text(final.name)
    done = sorted(p for p in root.glob("step-*") if p.is_dir())
    for old in done[:-keep_last]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def load_checkpoint(folder: Path, learners, agents: list[str], seed: int) -> dict[str, Any]:
    """Restore learners and RNG states from a checkpoint folder; returns its saved state."""
    import torch

    state = json.loads((folder / "trainer_state.json").read_text())
    if sorted(state["agents"]) != sorted(agents):
        raise ValueError(f"{folder}: checkpoint trains agents {state['agents']}, the config {agents}")
    if state["seed"] != seed:
        raise ValueError(f"{folder}: checkpoint seed {state['seed']} differs from the config's {seed}")
    learners.load(folder / "agents")
    _set_rng_state(torch.load(folder / "rng.pt", weights_only=False))
    return state

def finished_checkpoints(out_dir: Path) -> list[Path]:
    """The complete checkpoint folders of a run, oldest first."""
    return sorted(p for p in (Path(out_dir) / CHECKPOINT_DIR).glob("step-*") if (p / "trainer_state.json").is_file())


def find_latest_checkpoint(out_dir: Path) -> Path | None:
    root = Path(out_dir) / CHECKPOINT_DIR
    marker = root / LATEST
    if marker.is_file():
        cand = root / marker.read_text().strip()
        if (cand / "trainer_state.json").is_file():
            return cand
    done = finished_checkpoints(out_dir)
    return done[-1] if done else None


def trained_agent_overrides(team: TeamConfig, agents: list[str], root: Path,
                            finetune: str) -> tuple[list[str], list[str]]:
    """(overrides, notes): team-config overrides (`m1 infer --set ...`) that seat the trained agents of `root` (a
    checkpoint or the averaged folder), full weights replacing the model's source and a LoRA adapter going on top of
    it; and a note for each agent whose model key other agents share: it needs a model entry of its own."""
    sets, notes = [], []
    for agent in agents:
        key = next(a.model for a in team.agents if a.name == agent)
        shared = [a.name for a in team.agents if a.model == key and a.name != agent]
        folder = Path(root) / "agents" / agent / ("adapter" if finetune == "lora" else "model")
        if shared:
            notes.append(f"{agent} shares model {key!r} with {shared}: give it its own model entry for {folder}")
        elif finetune == "lora":
            sets.append(f"models.{key}.adapter={folder}")
        else:
            sets += [f"models.{key}.tiny=null", f"models.{key}.path={folder}"]
    return sets, notes


def infer_command(cfg, agents: list[str], root: Path) -> str:
    """The `m1 infer` call that answers with the trained agents of `root` (printed when training ends): the run's
    team with its `team_overrides` (the weights training started from) and the trained agents seated."""
    team = cfg.team_config()
    ref = cfg.team if isinstance(cfg.team, str) else "TEAM.yaml"  # an inline team has no name to pass
    sets, notes = trained_agent_overrides(team, agents, root, cfg.learner.finetune)
    command = " ".join(["m1 infer VIDEOS --team", shlex.quote(ref)]
                       + [f"--set {shlex.quote(s)}" for s in list(cfg.team_overrides) + sets])
    return command + "".join(f" ({n})" for n in notes)


def train_main(config_path: str | Path, overrides: list[str] | None = None,
               progress: Callable[[str], None] = print) -> list[dict[str, Any]]:
    """`m1 train --config PATH --set key=value ...`: load the config, train, return the per-step metrics."""
    cfg = load_train_config(config_path, overrides)
    trainer = Trainer(cfg)
    start = trainer.step
    if start:
        progress(f"resuming {cfg.name} from step {start} in {cfg.out_dir}")
    try:
        rows = trainer.train()
    finally:
        trainer.close()
    if rows:
        progress(f"{cfg.name}: {len(rows)} steps, last loss {rows[-1]['loss']:.5f}, "
                 f"mean reward {rows[-1]['reward/mean']:.3f}; metrics in {Path(cfg.out_dir) / 'metrics.jsonl'}")
    else:
        progress(f"{cfg.name}: already at step {start} of {cfg.steps}; nothing to do")
    from m1.marl.average import AVERAGE_DIR

    root = find_latest_checkpoint(Path(cfg.out_dir))
    if cfg.average.checkpoints:
        root = Path(cfg.out_dir) / AVERAGE_DIR
        progress(f"{cfg.name}: the weights to use (average of {cfg.average.checkpoints} checkpoints"
                 f"{' and the start' if cfg.average.include_start else ''}) are in {root}")
    if root is not None:
        progress("answer with the trained agents: " + infer_command(cfg, trainer.trained, root))
    return rows
