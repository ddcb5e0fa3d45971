"""One agent's optimizer step: AdamW over the policy's trainable parameters, or DeepSpeed's ZeRO-2 engine wrapping
them. The actor (m1/marl/actor/learner.py) computes each micro-batch's loss; this object takes its backward pass and
the step's update, so the update loop never asks which of the two it drives."""
from __future__ import annotations

from typing import Any

from m1.marl.config import LearnerConfig
from m1.marl.actor.distributed import deepspeed_engine


class PolicyOptimizer:
    """The optimizer step of one policy. `engine` is the DeepSpeed engine (None in plain torch); `forward_model` is
    what the loss's forward passes run through (the engine, so its backward hooks see them, or the policy)."""

    def __init__(self, agent: str, policy, cfg: LearnerConfig, device: str, ds_cfg: dict[str, Any] | None):
        import torch

        self.cfg = cfg
        self.params = [p for p in policy.parameters() if p.requires_grad]
        if not self.params:
            raise ValueError(f"agent {agent!r}: the model has no trainable parameters")
        # On a GPU the fused kernel: the default multi-tensor path makes full-size temporaries of the (ZeRO-flattened)
        # fp32 state at each step, 11.5 GiB for a 3B model, which decided whether a 3B full fine-tune fits on an A100
        fused = {"fused": True} if str(device).startswith("cuda") else {}
        self.optimizer = torch.optim.AdamW(self.params, lr=cfg.learning_rate(), betas=tuple(cfg.betas),
                                           eps=cfg.eps, weight_decay=cfg.weight_decay, **fused)
        self.engine = None
        if ds_cfg is not None:
            self.engine, self.optimizer = deepspeed_engine(policy, self.optimizer, ds_cfg)
        self.forward_model = self.engine if self.engine is not None else policy

    def set_lr(self, lr: float) -> None:
        for group in self.optimizer.param_groups:
            group["lr"] = lr

    def backward(self, loss) -> None:
        if self.engine is not None:
            self.engine.backward(loss, scale_wrt_gas=False)  # the actor weights micro-batches itself
        else:
            loss.backward()

    def step(self) -> float:
        """Apply the accumulated gradients (clipped at `learner.max_grad_norm`) and zero them; the gradient norm."""
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
