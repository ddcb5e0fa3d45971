"""One agent's learner: policy, reference and optimizer. The groups that hold one learner per agent
(`LocalLearners`, `RayLearners`) live in m1/marl/groups.py.

Learners (`AgentLearner`) hold the policy (LoRA adapter through peft, or the full model), the reference (LoRA: the
same model with the adapter disabled; full: a frozen copy; none when beta = 0), and an AdamW optimizer, optionally
inside a DeepSpeed ZeRO-2 engine. Different agents may have different architectures and tokenizers: each learner
tokenises and scores its own samples.

Old log-probs: with `grpo.old_logprobs: policy` (default) the surrogate uses `logp.detach()` — one update per
rollout batch, TRL's on-policy case, ratio exactly 1 with the gradient of logp. `rollout` uses the sampler's
log-probs instead, `sampler` weights each token by a truncated importance weight (the modes and the loss types are
registries in m1/marl/grpo.py, the policy objectives in m1/marl/objectives.py). Whenever the samples carry the
sampler's log-probs, `logp_gap` logs the mean |recomputed - sampled| log-prob, which should be ~0.

Vision-language policies (a seed kind's `kind: vision` Qwen2-VL / Qwen2.5-VL model, backend hf): a sample's prompt ids
keep the processor's image-pad tokens, and the forward pass gets the `pixel_values` / `image_grid_thw` of its frames,
decoded again from the sample's video and frame indices (samples and traces never hold pixels). The model then
places its own multimodal rotary positions, so such prompts take the joint pass (no prompt sharing) and are never
cut: a prompt over `max_prompt_tokens` is an error. Policy, reference and sampler all score with the same images.

Gradient accumulation: an agent's samples of one step are split into micro-batches of `learner.micro_batch_size`;
each micro-batch loss is weighted so the accumulated gradient equals that of the whole step's batch (`grpo` and
`dr_grpo`: weight = micro size / step size; token-mean losses: normalised by the step's token count, as TRL's
`dapo`). One optimizer step per agent per training step.
"""
from __future__ import annotations

import copy
import json
import random
import time
from contextlib import nullcontext
from pathlib import Path
from typing import Any, NamedTuple

from m1.attention_loss import HeadScores, check_heads, evidence_attention_loss, supervised_layers
from m1.config import ModelSpec
from m1.evidence import chat_token_evidence
from m1.marl.config import GRPOSettings, LearnerConfig
from m1.marl.distributed import deepspeed_engine, resolve_ds_config
from m1.marl.grpo import LOSSES, OLD_LOGPROBS, token_logprobs
from m1.marl.objectives import LOSS_TOTALS, grpo_loss
from m1.marl.rollout import Sample, derive_seed
from m1.models.base import ChatRequest, image_frames, prompt_ids, text_only
from m1.models.hf import HFChatModel, HFVisionModel, resolve_device
from m1.video import VideoPool

VL_MODEL_TYPES = ("qwen2_5_vl", "qwen2_vl")  # vision-language models the learner feeds pixel_values/image_grid_thw
ZERO_SHARD = "zero-rank{rank}.pt"  # one rank's ZeRO-2 optimizer state in a learner's checkpoint folder


class StepSize(NamedTuple):
    """What a micro-batch's loss is weighted against: the whole step's samples and loss tokens (every sample counts,
    run or not), prompt tokens (a prompt's first token has nothing to predict it) and the tokens run (per-token
    diagnostics are means over those)."""

    samples: int
    tokens: int
    prompt_tokens: int
    run_tokens: int
    evidence_rows: int = 0  # SFT's attention loss: the evidence rows of the step's completions (as cut)


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
    """Policy, reference and optimizer of one agent; also a ChatModel (`name`, `generate`) for the team."""

    def __init__(self, agent: str, model_key: str, spec: ModelSpec, cfg: LearnerConfig, grpo: GRPOSettings,
                 seed: int = 0, rank: int = 0, world: int = 1):
        import torch

        self.agent, self.name, self.cfg, self.grpo = agent, model_key, cfg, grpo
        self.rank, self.world = rank, world
        if world > 1 and not cfg.deepspeed:
            raise ValueError(f"agent {agent!r}: a learner on {world} GPUs is one ZeRO-2 group; set learner.deepspeed "
                             "(configs/deepspeed/zero2.json)")
        torch.manual_seed(derive_seed(seed, "learner", agent))  # LoRA init; a no-op for exactness when resuming
        device = resolve_device(spec.device)
        self.bf16 = cfg.precision == "bf16" or (cfg.precision == "auto" and device.startswith("cuda"))
        ds_cfg = None
        if cfg.deepspeed:
            ds_cfg = resolve_ds_config(cfg.deepspeed, micro_batch_size=cfg.micro_batch_size,
                                       max_grad_norm=cfg.max_grad_norm, bf16=self.bf16)
            self.bf16 = bool(ds_cfg.get("bf16", {}).get("enabled"))
        # Which dtype the weights load in. LoRA: the frozen base in bf16, the adapter in fp32 (peft upcasts it).
        # Full fine-tuning under DeepSpeed: bf16 weights, fp32 master partitions inside the ZeRO optimizer. Full
        # fine-tuning in plain torch: fp32 weights, since the paper's lr 1e-7 would round away in bf16 weights.
        self.weights_dtype = "bfloat16" if self.bf16 and (cfg.finetune == "lora" or ds_cfg) else "float32"
        # a vision-language policy loads through HFVisionModel (AutoModelForImageTextToText with its processor)
        self.vl = spec.kind == "vision"
        self.accepts_images = self.vl  # the team sends it frames, not placeholders
        self._videos = None  # a VideoPool, opened on the first multimodal sample
        if self.vl:
            if spec.backend != "hf":
                raise ValueError(f"agent {agent!r}: model {model_key!r} has kind 'vision' and backend "
                                 f"{spec.backend!r}; a vision-language learner needs backend 'hf'")
            self.chat = HFVisionModel(spec.model_copy(update={"dtype": self.weights_dtype}), model_key)
            model_type = getattr(self.chat.model.config, "model_type", None)
            if model_type not in VL_MODEL_TYPES:
                raise ValueError(f"agent {agent!r}: model {model_key!r} is a {model_type!r} model; the learner "
                                 f"trains vision-language models of type {list(VL_MODEL_TYPES)} (image_grid_thw "
                                 "inputs)")
        else:
            self.chat = HFChatModel(spec.model_copy(update={"dtype": self.weights_dtype}), model_key)
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
            self.ref = None
            if grpo.beta > 0:  # a frozen copy; bf16 when training in bf16 (it is only ever run forward)
                self.ref = copy.deepcopy(base).eval().requires_grad_(False)
                if self.bf16:
                    self.ref.to(torch.bfloat16)
        self.policy = policy
        self._check_attention()
        self.chat.model = policy  # the team generates with the weights being trained
        self.params = [p for p in policy.parameters() if p.requires_grad]
        if not self.params:
            raise ValueError(f"agent {agent!r}: the model has no trainable parameters")
        # On a GPU the fused kernel: the default multi-tensor path makes full-size temporaries of the (ZeRO-flattened)
        # fp32 state at each step, 11.5 GiB for a 3B model, which decided whether a 3B full fine-tune fits on an A100
        fused = {"fused": True} if str(self.device).startswith("cuda") else {}
        self.optimizer = torch.optim.AdamW(self.params, lr=cfg.learning_rate(), betas=tuple(cfg.betas),
                                           eps=cfg.eps, weight_decay=cfg.weight_decay, **fused)
        self.engine = None
        if ds_cfg is not None:
            self.engine, self.optimizer = deepspeed_engine(policy, self.optimizer, ds_cfg)
        self.updates = 0

    def _check_attention(self) -> None:
        """learner.attention needs a text student that has the heads it names (the settings alone are checked in
        LearnerConfig)."""
        if not self.cfg.attention.on:
            return
        if self.vl:
            raise ValueError(f"agent {self.agent!r}: learner.attention is for text students (a vision-language "
                             "model's rotary positions are multimodal); set its weight to 0")
        check_heads(self.policy, self.cfg.attention, f"agent {self.agent!r}: learner.attention")

    # -------------------------------------------------------------- generation (ChatModel protocol)
    def generate(self, requests, params):
        """Sample with the current weights, under the same length caps the update uses.

        Completions stop at `max_completion_tokens`; a prompt over `max_prompt_tokens` is an error, never cut (the
        team trims to its `limits.max_prompt_tokens`, which may not exceed this cap, m1/team/budget.py), so the token
        ids a sample carries are exactly the context and the tokens that get trained: sampler and learner score the
        same conditional.
        """
        self.policy.eval()  # no dropout while sampling
        return self.generate_with(self.chat, requests, params)

    def generate_with(self, chat, requests, params):
        """`generate` on `chat`, this learner's chat model or a copy of it at older weights (asynchronous rollouts on
        the hf engine, m1/marl/rollout_engines.py HFSamplers)."""
        from dataclasses import replace

        if not self.vl:  # a vision-language prompt's length is checked where its image tokens are known (_rows)
            for i, r in enumerate(requests):
                n = len(prompt_ids(chat.tokenizer, chat.render(r)))  # tokenized once for budget, check, model
                if n > self.cfg.max_prompt_tokens:
                    raise ValueError(f"agent {self.agent!r}: prompt {i} of this call is {n} tokens, over "
                                     f"learner.max_prompt_tokens={self.cfg.max_prompt_tokens}; prompts are never cut: "
                                     "set the team's limits.max_prompt_tokens at or below it so the team trims them")
        params = replace(params, max_new_tokens=min(params.max_new_tokens, self.cfg.max_completion_tokens))
        cap = self.cfg.max_prompt_tokens + params.max_new_tokens
        chat.context_length = cap if self._context_length is None else min(self._context_length, cap)
        with self._autocast():
            return chat.generate(requests, params)

    def _autocast(self):
        import torch

        if self.bf16 and self.engine is None and str(self.device).startswith("cuda"):
            return torch.autocast("cuda", dtype=torch.bfloat16)
        return nullcontext()

    def sft_sample(self, ex) -> Sample:
        """An SFT example (m1/marl/sft.py) as this learner's `Sample`: its own chat rendering and tokenizer; the
        target ends with end-of-turn."""
        tok = self.tokenizer
        if self.vl:  # the frames stay images: the prompt ids carry their image-pad tokens
            frames = image_frames(ex.messages)
            video = getattr(ex, "video", None)
            if frames and not video:
                raise ValueError(f"agent {self.agent!r}: SFT example of question {ex.question_id!r} has "
                                 f"{len(frames)} image parts but no `video`; a vision-language student needs it "
                                 "(prepare the examples again)")
            text, _ = self.chat.render_chat(ex.messages)
            images = self._decode(video, frames) if frames else None
            prompt = self.chat.processor(text=[text], images=images, return_tensors="np")["input_ids"][0].tolist()
            completion = tok(ex.completion, add_special_tokens=False)["input_ids"] + [self.chat.eos_ids[0]]
            return Sample(agent=self.agent, question_id=ex.question_id, group=0, rollout=0, phase=ex.phase,
                          prompt_ids=prompt, completion_ids=list(completion), logprobs=None, reward=0.0,
                          advantage=0.0, temperature=1.0, video=video if frames else None, frames=frames or None)
        # a seed-kind chat carries image parts: the text model sees them as placeholders, as when it generates
        # (m1/team/single.py); plain-string CPP chats render exactly as before
        messages = text_only(ex.messages)
        text = self.chat.render(ChatRequest(messages))
        evidence = getattr(ex, "evidence", None) if self.cfg.attention.on else None
        prompt = tok(text, add_special_tokens=False, return_offsets_mapping=bool(evidence))
        reply = tok(ex.completion, add_special_tokens=False, return_offsets_mapping=bool(evidence))
        completion = reply["input_ids"] + [self.chat.eos_ids[0]]
        rows = None
        if evidence:
            try:
                rows = chat_token_evidence(text, [m.get("content") or "" for m in messages],
                                           prompt["offset_mapping"], ex.completion, reply["offset_mapping"],
                                           evidence, tail=1)
            except ValueError as exc:
                raise ValueError(f"agent {self.agent!r}: SFT example of question {ex.question_id!r} "
                                 f"({ex.phase}): {exc}") from exc
        return Sample(agent=self.agent, question_id=ex.question_id, group=0, rollout=0, phase=ex.phase,
                      prompt_ids=list(prompt["input_ids"]), completion_ids=list(completion), logprobs=None,
                      reward=0.0, advantage=0.0, temperature=1.0, evidence=rows)

    # -------------------------------------------------------------- images (vision-language policies)
    def _decode(self, video: str, frames: list[int]):
        """The frames as the team decoded them for the prompt (same reader, same indices)."""
        if self._videos is None:
            self._videos = VideoPool(max_bytes=256 << 20)
        return list(self._videos.open(video).frames(frames))

    def vision_inputs(self, samples: list[Sample]) -> dict[str, Any] | None:
        """The `pixel_values` / `image_grid_thw` of the samples' prompts, in row order (the model fills the
        image-pad tokens of the batch in that order); None for a text learner or prompts without images.

        Checks each prompt's image-pad count against its images, so a prompt cut short or a frame list that does
        not belong to it is an error rather than a silently misplaced image."""
        import torch

        if not self.vl:
            return None
        images, counts = [], []
        for s in samples:
            if s.frames and not s.video:
                raise ValueError(f"agent {self.agent!r}: sample of question {s.question_id!r} has frames but no video")
            got = self._decode(s.video, s.frames) if s.frames else []
            images += got
            counts.append(len(got))
        if not images:
            return None
        inputs = self.chat.image_inputs(images)
        config = self.chat.model.config
        pad_id = config.image_token_id
        merge = self.chat.processor.image_processor.merge_size ** 2
        per_image = (inputs["image_grid_thw"].prod(-1) // merge).tolist()
        start = 0
        for s, n in zip(samples, counts):
            want = int(sum(per_image[start:start + n]))
            start += n
            have = sum(t == pad_id for t in s.prompt_ids)
            if have != want:
                raise ValueError(f"agent {self.agent!r}: sample of question {s.question_id!r} ({s.phase}) has {have} "
                                 f"image-pad tokens but its {n} frames make {want}")
        inputs["image_grid_thw"] = inputs["image_grid_thw"].to(torch.long)
        return inputs

    # -------------------------------------------------------------- scoring
    def _rows(self, samples: list[Sample]) -> list[tuple[list[int], list[int]]]:
        """(prompt, completion) ids; completions cut to `learner.max_completion_tokens` (the rest is not trained).

        A prompt is never cut (a cut loses its head: the system prompt, the question and its options): one longer
        than `learner.max_prompt_tokens` is an error naming the agent, question and phase (the team's prompt budget,
        m1/team/budget.py, keeps rollouts within it)."""
        p_max, c_max = self.cfg.max_prompt_tokens, self.cfg.max_completion_tokens
        for s in samples:
            if len(s.prompt_ids) > p_max:
                raise ValueError(f"agent {self.agent!r}: a prompt of {len(s.prompt_ids)} tokens (question "
                                 f"{s.question_id!r}, {s.phase}) exceeds learner.max_prompt_tokens={p_max}; prompts "
                                 "are never cut: raise it, or keep the team's limits.max_prompt_tokens within it")
        return [(s.prompt_ids, s.completion_ids[:c_max]) for s in samples]

    def completion_logprobs(self, model, rows: list[tuple[list[int], list[int]]], temperature: float | list[float],
                            vision: dict[str, Any] | None = None):
        """Log-probs [B, C] of each completion token given its prompt, and the mask [B, C] of real tokens.

        Prompts are left-padded and completions right-padded so all completions start at one column; positions
        count real tokens only (as `generate` does with left padding), so the values match the sampler's.
        GRPO's K completions of a question share one prompt: when rows repeat prompts (and `share_prompt_forward`
        is on), each distinct prompt is run once and its key/value cache is reused by its completions.
        `vision` (from `vision_inputs` of the same rows) feeds the images of multimodal prompts.
        """
        if vision is not None or self.vl:
            return self._joint_logprobs(model, rows, temperature, vision)
        prompts = list(dict.fromkeys(tuple(p) for p, _ in rows))
        longest = max(len(c) for _, c in rows)
        if (not self.cfg.prompt_grad and model.training and longest > 0 and min(len(p) for p in prompts) > 1
                and self._can_share_prompt(model)):
            return self._detached_prompt_logprobs(model, rows, [list(p) for p in prompts], temperature)
        if (self.cfg.share_prompt_forward and len(prompts) < len(rows) and longest > 0
                and self._can_share_prompt(model)):
            return self._shared_prompt_logprobs(model, rows, [list(p) for p in prompts], temperature)
        return self._joint_logprobs(model, rows, temperature)

    def _joint_logprobs(self, model, rows: list[tuple[list[int], list[int]]], temperature: float | list[float],
                        vision: dict[str, Any] | None = None):
        """One forward over prompt + completion for every row (no sharing). A vision-language model is given no
        position ids: it derives its multimodal rotary positions from the ids, the image grids and the mask, as
        `generate` does."""
        input_ids, attention, cmask, p_len, c_len = self._padded_rows(rows)
        if self.vl and vision is not None:
            # Only the prompts' image pads take image features and 3D positions. A sampled reply may hold an image-
            # or video-pad token too (a random policy does): the sampler embedded it as text, so here it is hidden
            # from the placement (`placed`) while the text embeddings come from the true ids.
            config = self.chat.model.config
            placed = input_ids.clone()
            reply = placed[:, p_len:]
            reply[(reply == config.image_token_id) | (reply == config.video_token_id)] = self.tokenizer.pad_token_id
            types = (placed == config.image_token_id).int() + 2 * (placed == config.video_token_id).int()
            embeds = getattr(model, "module", model).get_input_embeddings()(input_ids)
            out = model(input_ids=placed, inputs_embeds=embeds, attention_mask=attention, mm_token_type_ids=types,
                        logits_to_keep=c_len + 1, use_cache=False, **vision)
        elif self.vl:  # no images: the model's own (text) positions
            out = model(input_ids=input_ids, attention_mask=attention, logits_to_keep=c_len + 1, use_cache=False)
        else:
            positions = (attention.cumsum(-1) - 1).clamp(min=0)
            out = model(input_ids=input_ids, attention_mask=attention, position_ids=positions,
                        logits_to_keep=c_len + 1, use_cache=False)
        logits = out.logits[:, :-1]  # the logits at column P-1+t score completion token t
        logp = token_logprobs(logits, input_ids[:, p_len:], temperature)
        return logp, cmask

    def _padded_rows(self, rows: list[tuple[list[int], list[int]]]):
        """(input ids, attention mask, completion mask [B, C], P, C) of rows joined as prompt + completion, prompts
        left-padded and completions right-padded to the longest, so every completion starts at column P."""
        import torch

        pad = self.tokenizer.pad_token_id
        p_len = max(len(p) for p, _ in rows)
        c_len = max(len(c) for _, c in rows)
        ids, attn, cmask = [], [], []
        for p, c in rows:
            lp, rc = p_len - len(p), c_len - len(c)
            ids.append([pad] * lp + p + c + [pad] * rc)
            attn.append([0] * lp + [1] * (len(p) + len(c)) + [0] * rc)
            cmask.append([1.0] * len(c) + [0.0] * rc)
        return (torch.tensor(ids, device=self.device), torch.tensor(attn, device=self.device),
                torch.tensor(cmask, device=self.device), p_len, c_len)

    def _sequence_logprobs(self, model, rows: list[tuple[list[int], list[int]]]):
        """For `learner.prompt_loss`: one forward over prompt + completion with every position's logits. Returns the
        completion's log-probs and mask [B, C] (as `completion_logprobs` at temperature 1) and the prompt's [B, P-1]
        (token j of a left-padded prompt scored from the logits at j-1; a row's first token is not scored)."""
        if self.vl:
            raise ValueError(f"agent {self.agent!r}: learner.prompt_loss is for text students; a vision-language "
                             "prompt's image-pad tokens are not text to predict (set it to 0)")
        input_ids, attention, cmask, p_len, _ = self._padded_rows(rows)
        positions = (attention.cumsum(-1) - 1).clamp(min=0)
        out = model(input_ids=input_ids, attention_mask=attention, position_ids=positions, use_cache=False)
        logp = token_logprobs(out.logits[:, :-1], input_ids[:, 1:], 1.0)  # column j scores token j+1
        # prompt token j (j >= 1) is scored at column j-1 when both it and the token before it are real
        p_mask = (attention[:, 1:p_len] * attention[:, :p_len - 1]).float()
        return logp[:, p_len - 1:], cmask, logp[:, :p_len - 1], p_mask

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
                                temperature: float | list[float]):
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

    def _detached_prompt_logprobs(self, model, rows: list[tuple[list[int], list[int]]], prompts: list[list[int]],
                                  temperature: float | list[float]):
        """Log-probs for `learner.prompt_grad: false`: each distinct prompt but its last token runs once without
        gradient; the completion pass (the prompt's last token, then completion tokens 0..C-2) runs on that cache
        with gradient, so every completion token is scored by a pass that has one, while the prompt's keys and
        values are constants. Same values as the joint pass, a different (cheaper) gradient."""
        import torch

        pad = self.tokenizer.pad_token_id
        which = {tuple(p): i for i, p in enumerate(prompts)}
        group = torch.tensor([which[tuple(p)] for p, _ in rows], device=self.device)
        heads = [p[:-1] for p in prompts]
        h_len = max(len(h) for h in heads)
        c_len = max(len(c) for _, c in rows)
        h_ids = torch.tensor([[pad] * (h_len - len(h)) + h for h in heads], device=self.device)
        h_attn = torch.tensor([[0] * (h_len - len(h)) + [1] * len(h) for h in heads], device=self.device)
        with torch.no_grad():
            out = model(input_ids=h_ids, attention_mask=h_attn, position_ids=(h_attn.cumsum(-1) - 1).clamp(min=0),
                        logits_to_keep=1, use_cache=True)
        cache = out.past_key_values
        cache.batch_select_indices(group)
        last = [prompts[which[tuple(p)]][-1] for p, _ in rows]
        c_ids = torch.tensor([c + [pad] * (c_len - len(c)) for _, c in rows], device=self.device)
        c_attn = torch.tensor([[1] * len(c) + [0] * (c_len - len(c)) for _, c in rows], device=self.device)
        step_ids = torch.cat([torch.tensor(last, device=self.device)[:, None], c_ids[:, :-1]], dim=1)
        attention = torch.cat([h_attn[group], torch.ones_like(c_attn[:, :1]), c_attn[:, :-1]], dim=1)
        positions = (attention.cumsum(-1) - 1).clamp(min=0)[:, h_len:]
        out = model(input_ids=step_ids, attention_mask=attention, position_ids=positions, past_key_values=cache,
                    use_cache=True)
        return token_logprobs(out.logits, c_ids, temperature), c_attn.float()

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
        """One optimizer step on all `samples` of this agent (GRPO, or cross-entropy for `objective="sft"`).

        In a learner group of W ranks every rank is handed the whole step and trains on its contiguous share of the
        step's length-sorted micro-batches (`_micro_batches`; a question's K rollouts share their prompt's forward).
        The objective's loss (`_grpo_loss`, `_sft_loss`) is weighted against the whole step, times W here as
        DeepSpeed averages the ranks' gradients; ranks with fewer micro-batches run zero-weight ones so all ranks
        enter the same number of gradient reductions. The stats returned are the whole step's, on every rank.
        """
        loss_of = {"grpo": self._grpo_loss, "sft": self._sft_loss}.get(objective)
        if loss_of is None:
            raise ValueError(f"objective must be 'grpo' or 'sft', got {objective!r}")
        t0 = time.perf_counter()
        self._set_lr(lr)
        if not samples:
            return {"samples": 0.0, "lr": lr}
        self.policy.train()
        rows = self._rows(samples)
        skip_zero = objective == "grpo" and self.grpo.beta == 0 and self.cfg.skip_zero_advantage
        run = [i for i, s in enumerate(samples) if not (skip_zero and s.advantage == 0)]
        step = StepSize(samples=len(samples), tokens=sum(len(c) for _, c in rows),
                        prompt_tokens=sum(len(p) - 1 for p, _ in rows), run_tokens=sum(len(rows[i][1]) for i in run),
                        evidence_rows=sum(len(_evidence_rows(s, r)) for s, r in zip(samples, rows)))
        totals: dict[str, float] = {}  # sums over the step's tokens or samples
        peaks: dict[str, float] = {}  # maxima over the step
        loss_sum = 0.0
        for micro, micro_rows, weight in self._micro_batches([samples[i] for i in run], [rows[i] for i in run],
                                                             (samples[:1], rows[:1])):
            loss, stats = loss_of(micro, micro_rows, step)
            if weight:  # a zero-weight micro-batch only keeps the ranks' reductions in step
                _accumulate(totals, peaks, stats)
            loss = loss * (weight * self.world)
            self._backward(loss)
            loss_sum += float(loss.detach()) / self.world
        grad_norm = self._step()
        self.updates += 1
        if self.world > 1:
            loss_sum, totals, peaks = _sum_over_ranks(loss_sum, totals, peaks)
        return {"loss": loss_sum, "grad_norm": grad_norm, "lr": lr, "samples": float(step.samples),
                "tokens": float(step.tokens), "samples_run": float(len(run)), "seconds": time.perf_counter() - t0,
                **totals, **peaks}

    def _scoring(self, micro: list[Sample]):
        """The images and temperature of a micro-batch: the same for policy, reference and (sampler) old log-probs,
        and each sample scored at the temperature it was sampled with."""
        temps = [s.temperature for s in micro]
        return self.vision_inputs(micro), temps[0] if len(set(temps)) == 1 else temps

    def _sft_loss(self, micro: list[Sample], micro_rows: list, step: StepSize):
        """Cross-entropy of the completions as a token mean over the whole step (so micro-batch losses sum to the
        step's); `learner.prompt_loss` adds the prompt's own step token mean with that weight, `learner.attention`
        the evidence attention loss (`_attention_loss`). Either takes one forward over the whole sequence: the
        attention rows need the prompt's keys from the pass that has gradient."""
        vision, temperature = self._scoring(micro)
        prompt_loss, att = self.cfg.prompt_loss > 0, self.cfg.attention
        heads = HeadScores(self.policy, supervised_layers(att)) if att.on else nullcontext()
        with self._autocast(), heads:
            if prompt_loss or att.on:
                logp, mask, p_logp, p_mask = self._sequence_logprobs(self._forward_model(), micro_rows)
            else:
                logp, mask = self.completion_logprobs(self._forward_model(), micro_rows, temperature, vision)
        loss = -(logp * mask).sum() / max(step.tokens, 1)
        stats = {"nll": float(-(logp.detach() * mask).sum()) * (1.0 / max(step.tokens, 1))}
        if prompt_loss:
            loss = loss - self.cfg.prompt_loss * (p_logp * p_mask).sum() / max(step.prompt_tokens, 1)
            stats["prompt_nll"] = float(-(p_logp.detach() * p_mask).sum()) * (1.0 / max(step.prompt_tokens, 1))
        if att.on:
            with self._autocast():
                shown, shown_stats = self._attention_loss(heads, micro, micro_rows, step)
            loss = loss + shown
            stats.update(shown_stats)
        return loss, stats

    def _attention_loss(self, heads: HeadScores, micro: list[Sample], micro_rows: list, step: StepSize):
        """The evidence attention loss of a micro-batch whose whole-sequence pass `heads` captured, weighted against
        the step like the cross-entropy: the reading term by the micro-batch's share of the step's evidence rows,
        the structural terms by its share of the step's completion tokens. Rows move from a sample's own positions
        to the padded batch's (prompts are left-padded to the longest). Returns (loss, stats weighted alike)."""
        p_len = max(len(p) for p, _ in micro_rows)
        rows = [[(q + p_len - len(p), tuple(e + p_len - len(p) for e in ev)) for q, ev in _evidence_rows(s, (p, c))]
                for s, (p, c) in zip(micro, micro_rows)]
        _, attention, *_ = self._padded_rows(micro_rows)
        shown = evidence_attention_loss(heads, self.cfg.attention, rows, attention)
        if shown is None:
            return 0.0, {}
        read = sum(len(r) for r in rows) / max(step.evidence_rows, 1)
        tokens = sum(len(c) for _, c in micro_rows) / max(step.tokens, 1)
        share = {"read": read, "prev": tokens, "prev2": tokens}
        loss = self.cfg.attention.weight * sum(part * share[k] for k, part in shown.parts.items())
        of = {"attn_read": read, "attn_evidence_mass": read, "attn_prev": tokens, "attn_prev2": tokens}
        stats = {k: v * of[k] for k, v in shown.metrics.items()}
        stats["attn_loss"] = float(loss.detach())
        return loss, stats

    def _grpo_loss(self, micro: list[Sample], micro_rows: list, step: StepSize):
        """`grpo_loss` of one micro-batch with the configured objective (m1/marl/objectives.py), loss type and
        old-log-prob mode (m1/marl/grpo.py), weighted against the whole step: a token-level loss is normalised by the
        step's token count, any other by the micro-batch's share of the step's samples. Per-token stats are means
        over the tokens run; `logp_gap` is the mean |recomputed - sampled| log-prob, which should be ~0 on-policy."""
        import torch

        g = self.grpo
        vision, temperature = self._scoring(micro)
        with self._autocast():
            logp, mask = self.completion_logprobs(self._forward_model(), micro_rows, temperature, vision)
        ref = None
        if g.beta > 0:
            with torch.no_grad(), self._autocast(), self._reference() as ref_model:
                ref, _ = self.completion_logprobs(ref_model, micro_rows, temperature, vision)
        given = [s.logprobs for s in micro]
        sampled = self._padded(given, logp.shape[1]) if all(x is not None for x in given) else None
        old, is_weight, mode_stats = OLD_LOGPROBS[g.old_logprobs or "policy"](logp, mask, sampled, g)
        per_token = 1.0 / max(step.run_tokens, 1)
        stats = {k: v if k.endswith("_max") else v * per_token for k, v in mode_stats.items()}
        adv = torch.tensor([s.advantage for s in micro], device=self.device, dtype=torch.float32)
        loss, loss_stats = grpo_loss(logp, old, ref, adv, mask, g, num_items_in_batch=step.tokens, is_weight=is_weight,
                                     max_completion_length=self.cfg.max_completion_tokens)
        if not LOSSES[g.loss_type].token_level:
            loss = loss * (len(micro) / step.samples)
        share = float(mask.sum()) / max(step.run_tokens, 1)  # the objective's metrics and kl are token means
        stats.update({k: v * share for k, v in loss_stats.items() if k not in LOSS_TOTALS})
        if sampled is not None:
            stats["logp_gap"] = float(((logp.detach() - sampled).abs() * mask).sum()) * per_token
        return loss, stats

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
        if self.rank == 0:  # the weights are whole on every rank of a ZeRO-2 group: one copy is written
            weights = folder / ("adapter" if self.cfg.finetune == "lora" else "model")
            self.policy.save_pretrained(weights)
            self._processor().save_pretrained(weights)
        if self.engine is not None:
            # each rank its own ZeRO shard (fp32 master and Adam moments of its partition), straight from the ZeRO
            # optimizer: DeepSpeed's save_checkpoint would also write the whole bf16 weights again (2 bytes per
            # parameter more), and its load reads every rank's shard on every rank
            torch.save(self.optimizer.state_dict(), folder / ZERO_SHARD.format(rank=self.rank))
        else:
            torch.save(self.optimizer.state_dict(), folder / "optimizer.pt")
        if self.rank == 0:
            state: dict[str, Any] = {"agent": self.agent, "model_key": self.name, "updates": self.updates,
                                     "finetune": self.cfg.finetune, "world": self.world}
            if self.engine is not None:  # the engine's own counters (not in the shards)
                state["engine_steps"] = [self.engine.global_steps, self.engine.global_samples,
                                         self.engine.skipped_steps]
            (folder / "learner.json").write_text(json.dumps(state, indent=2))
        if include_rng:
            torch.save(_rng_state(), folder / self._rng_file())

    def export_weights(self, folder: str | Path) -> None:
        """The weights as a rollout engine loads them: the peft adapter folder (LoRA) or a whole HF model folder."""
        if self.rank == 0:
            self.policy.save_pretrained(folder)
            self._processor().save_pretrained(folder)

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

    def _processor(self):
        """What a saved folder needs to be loaded again: the tokenizer, or a VL model's whole processor (its image
        and video processors too)."""
        return self.chat.processor if self.vl else self.tokenizer

    def _rng_file(self) -> str:
        return "rng.pt" if self.rank == 0 else f"rng-rank{self.rank}.pt"

    def load(self, folder: str | Path, include_rng: bool = False) -> None:
        import torch

        folder = Path(folder)
        state = json.loads((folder / "learner.json").read_text())
        if state["finetune"] != self.cfg.finetune:
            raise ValueError(f"{folder}: checkpoint is a {state['finetune']} run, the config says "
                             f"{self.cfg.finetune}")
        if state.get("world", 1) != self.world:
            raise ValueError(f"{folder}: agent {self.agent!r} was trained on {state.get('world', 1)} GPUs and is now "
                             f"given {self.world}; its ZeRO optimizer shards fit that many ranks only (set "
                             f"learner.gpus back to {state.get('world', 1)} to resume)")
        if self.cfg.finetune == "lora":
            from peft import set_peft_model_state_dict

            set_peft_model_state_dict(self.policy, read_safetensors(folder / "adapter", "adapter_model"))
        else:
            _load_full(self.policy, read_safetensors(folder / "model", "model"), folder / "model")
        if self.engine is not None:
            self._load_zero_shard(folder, state)
        else:
            self.optimizer.load_state_dict(torch.load(folder / "optimizer.pt", weights_only=False))
        self.updates = int(state["updates"])
        if include_rng:
            _set_rng_state(torch.load(folder / self._rng_file(), weights_only=False))

    def _load_zero_shard(self, folder: Path, state: dict[str, Any]) -> None:
        """This rank's ZeRO shard into the ZeRO optimizer: Adam moments and the fp32 master of its partition (the
        bf16 weights were read from model/ or adapter/ already, once). A checkpoint written by DeepSpeed's own
        save_checkpoint (before the shards) still loads, through DeepSpeed."""
        import torch

        shard = folder / ZERO_SHARD.format(rank=self.rank)
        if not shard.is_file() and (folder / "deepspeed").is_dir():
            self.engine.load_checkpoint(str(folder / "deepspeed"), tag="state", load_module_strict=False)
            return
        if not shard.is_file():
            raise FileNotFoundError(f"{folder}: no ZeRO optimizer shard {shard.name} for rank {self.rank}")
        mine = torch.load(shard, map_location="cpu", weights_only=False)
        listed: list[Any] = [None] * self.world  # the ZeRO optimizer picks its own rank's entry
        listed[self.rank] = mine
        self.optimizer.load_state_dict(listed, load_optimizer_states=True, load_from_fp32_weights=True)
        steps = state.get("engine_steps")
        if steps:
            self.engine.global_steps, self.engine.global_samples, self.engine.skipped_steps = steps


def _evidence_rows(sample: Sample, row: tuple[list[int], list[int]]) -> list[tuple[int, tuple[int, ...]]]:
    """The sample's evidence rows whose predicted token is still in the row (completions may have been cut)."""
    length = len(row[0]) + len(row[1])
    return [(q, ev) for q, ev in sample.evidence or () if q + 1 < length]


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
