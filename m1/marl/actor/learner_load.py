"""Loading one agent's learner model: the precision and dtype training wants, the chat model (text, or a Qwen2-VL /
Qwen2.5-VL vision-language model with its processor), the policy (a peft LoRA adapter on it, or the model itself)
and the reference (LoRA: the same model with the adapter disabled; full fine-tuning: a frozen copy, none at beta 0).
"""
from __future__ import annotations

import copy
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any

from m1.attention_loss import check_heads
from m1.config import ModelSpec
from m1.marl.config import LearnerConfig
from m1.marl.actor.distributed import resolve_ds_config
from m1.marl.rollout.episodes import derive_seed
from m1.models.hf import HFChatModel, HFVisionModel, resolve_device

VL_MODEL_TYPES = ("qwen2_5_vl", "qwen2_vl")  # vision-language models the learner feeds pixel_values/image_grid_thw


@dataclass
class LoadedPolicy:
    """What `load_policy` built for one learner."""

    chat: Any  # HFChatModel / HFVisionModel whose model is the policy: the team generates with the trained weights
    policy: Any
    ref: Any | None  # full fine-tuning at beta > 0: the frozen copy; else None (LoRA: the adapter disabled)
    vl: bool  # a vision-language policy (its prompts carry images)
    bf16: bool  # bf16 autocast (or DeepSpeed's bf16) in training
    weights_dtype: str  # what the weights were loaded in
    ds_cfg: dict[str, Any] | None  # the resolved DeepSpeed config, with learner.deepspeed
    context_length: int | None  # the model's own, before generation caps it


def load_policy(agent: str, model_key: str, spec: ModelSpec, cfg: LearnerConfig, beta: float,
                seed: int) -> LoadedPolicy:
    """Load `spec` as agent `agent`'s policy under `cfg` (`beta > 0` with full fine-tuning keeps a reference copy).
    The global torch seed is set from (seed, agent) first, so a LoRA adapter starts the same on every run."""
    import torch

    torch.manual_seed(derive_seed(seed, "learner", agent))  # LoRA init; a no-op for exactness when resuming
    device = resolve_device(spec.device)
    bf16 = cfg.precision == "bf16" or (cfg.precision == "auto" and device.startswith("cuda"))
    ds_cfg = None
    if cfg.deepspeed:
        ds_cfg = resolve_ds_config(cfg.deepspeed, micro_batch_size=cfg.micro_batch_size,
                                   max_grad_norm=cfg.max_grad_norm, bf16=bf16)
        bf16 = bool(ds_cfg.get("bf16", {}).get("enabled"))
    # Which dtype the weights load in. LoRA: the frozen base in bf16, the adapter in fp32 (peft upcasts it).
    # Full fine-tuning under DeepSpeed: bf16 weights, fp32 master partitions inside the ZeRO optimizer. Full
    # fine-tuning in plain torch: fp32 weights, since the paper's lr 1e-7 would round away in bf16 weights.
    weights_dtype = "bfloat16" if bf16 and (cfg.finetune == "lora" or ds_cfg) else "float32"
    chat = _chat_model(agent, model_key, spec.model_copy(update={"dtype": weights_dtype}))
    vl = spec.interface == "vision"
    context_length = chat.context_length
    base = chat.model
    if cfg.gradient_checkpointing:
        base.gradient_checkpointing_enable()
    ref = None
    if cfg.finetune == "lora":
        from peft import LoraConfig, get_peft_model

        lora = cfg.lora
        policy = get_peft_model(base, LoraConfig(r=lora.r, lora_alpha=lora.alpha, lora_dropout=lora.dropout,
                                                 target_modules=list(lora.target_modules), task_type="CAUSAL_LM"))
    else:
        policy = base
        if beta > 0:  # a frozen copy; bf16 when training in bf16 (it is only ever run forward)
            ref = copy.deepcopy(base).eval().requires_grad_(False)
            if bf16:
                ref.to(torch.bfloat16)
    _check_attention(agent, policy, cfg, vl)
    chat.model = policy
    return LoadedPolicy(chat=chat, policy=policy, ref=ref, vl=vl, bf16=bf16, weights_dtype=weights_dtype,
                        ds_cfg=ds_cfg, context_length=context_length)


def _chat_model(agent: str, model_key: str, spec: ModelSpec):
    """The HF chat model of `spec`; a vision-language policy loads through HFVisionModel
    (AutoModelForImageTextToText with its processor) and must be of a type whose image inputs the learner feeds."""
    if spec.interface == "vision":
        if spec.backend != "hf":
            raise ValueError(f"agent {agent!r}: model {model_key!r} has kind 'vision' and backend "
                             f"{spec.backend!r}; a vision-language learner needs backend 'hf'")
        chat = HFVisionModel(spec, model_key)
        model_type = getattr(chat.model.config, "model_type", None)
        if model_type not in VL_MODEL_TYPES:
            raise ValueError(f"agent {agent!r}: model {model_key!r} is a {model_type!r} model; the learner "
                             f"trains vision-language models of type {list(VL_MODEL_TYPES)} (image_grid_thw "
                             "inputs)")
    else:
        chat = HFChatModel(spec, model_key)
    chat.name = model_key
    return chat


def _check_attention(agent: str, policy, cfg: LearnerConfig, vl: bool) -> None:
    """learner.attention needs a text student that has the heads it names (the settings alone are checked in
    LearnerConfig)."""
    if not cfg.attention.on:
        return
    if vl:
        raise ValueError(f"agent {agent!r}: learner.attention is for text students (a vision-language "
                         "model's rotary positions are multimodal); set its weight to 0")
    check_heads(policy, cfg.attention, f"agent {agent!r}: learner.attention")


def reference(policy, ref, finetune: str):
    """`with reference(...) as model:` the reference for the block's duration: LoRA's base model with the adapter
    disabled, else the frozen copy `ref` (None at beta 0)."""
    return _AdapterOff(policy) if finetune == "lora" else nullcontext(ref)


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
