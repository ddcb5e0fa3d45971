"""One trained agent's chat model for rollouts: it generates with its learner's policy (or a copy of it at older
weights) under the length caps the update uses, so a sample's token ids are exactly the context and the tokens that
get trained. The learner (m1/marl/actor/learner.py) owns the weights; this object only reads them."""
from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import replace
from typing import Any

from m1.marl.config import LearnerConfig
from m1.models.base import prompt_ids


class Sampler:
    """A ChatModel (`name`, `accepts_images`, `generate`) over one learner's policy."""

    def __init__(self, agent: str, name: str, chat, policy, cfg: LearnerConfig, vl: bool,
                 context_length: int | None, autocast: Callable[[], AbstractContextManager[Any]]):
        self.agent, self.name, self.chat, self.policy, self.cfg = agent, name, chat, policy, cfg
        self.accepts_images = vl  # a vision-language policy: the team sends it frames, not placeholders
        self.tokenizer = chat.tokenizer  # the team counts its prompts' tokens with it (m1/team/budget.py)
        self._context_length, self._autocast = context_length, autocast

    def generate(self, requests, params):
        """Sample with the current weights. Completions stop at `max_completion_tokens`; a prompt over
        `max_prompt_tokens` is an error, never cut (the team trims to its `limits.max_prompt_tokens`, which may not
        exceed this cap, m1/team/budget.py), so sampler and learner score the same conditional."""
        self.policy.eval()  # no dropout while sampling
        return self.generate_with(self.chat, requests, params)

    def generate_with(self, chat, requests, params):
        """`generate` on `chat`, this sampler's chat model or a copy of it at older weights (asynchronous rollouts on
        the hf engine, m1/marl/rollout_engines.py HFSamplers)."""
        # a vision-language prompt's length is checked with its image tokens in (Scorer.rows)
        if not self.accepts_images:
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
