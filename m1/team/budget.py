"""Prompt budgets: every agent call of a team fits `limits.max_prompt_tokens` of the agent's own tokens, or is refused.

Nothing is cut silently. Over budget, the prompt is trimmed where it can be: the peers' notes of a communicate or
answer prompt lose their oldest tool outputs first, one at a time, and the prompt says how many were left out
(`SharedMemory.view(leave_out=...)`); then the peers' notes go whole. The system prompt, the question, its options,
the agent's own notes and the closing instruction are never trimmed. A prompt that still does not fit is a
`PromptBudgetError` naming the agent, phase and question, or, with `limits.over_budget: drop`, the end of that
question's episode (its `error` says why; training leaves it out of its groups).

Tokens are counted as the agent's model will see them: its tokenizer over its chat template, rendered as
HFChatModel, EngineChat and the vLLM backend render it, so a team budget at or below `learner.max_prompt_tokens` is a
prompt the learner takes whole. A model with no tokenizer (the synth teacher, an OpenAI-compatible server, a learner
behind Ray) is counted by `estimate_tokens`, calibrated on Qwen's vocabulary (see there).
"""
from __future__ import annotations

import functools
import math
from collections.abc import Callable

from m1.models.base import ModelError, prompt_ids
from m1.models.tiny import QWEN_SPLIT
from m1.models.vllm_client import render_prompt

# Qwen2 / Qwen2.5 / Qwen3 share one byte-level BPE of 151,643 ranks behind one pre-tokenizer split (QWEN_SPLIT: words,
# single digits, punctuation runs, newlines). Measured once offline on 1,562 prompts of the rule-based teacher team on
# M1-Synth (all four phases, the Qwen chat template, that vocabulary; docs/prompt_budgets.md), a prompt is 1.016-1.049
# tokens per pre-token of that split, so the estimate is the pre-token count times TOKENS_PER_PIECE, plus each
# message's role markers and the opened reply: never below the real count there, at most ~3% above it.
TOKENS_PER_PIECE = 1.05
MESSAGE_TOKENS = 5  # <|im_start|>role\n ... <|im_end|>\n
REPLY_TOKENS = 7  # <|im_start|>assistant\n and Qwen3's empty think block


class PromptBudgetError(ModelError):
    """A prompt that does not fit the team's budget even with every trimmable part left out."""


def estimate_tokens(messages: list[dict]) -> int:
    """The Qwen-vocabulary token count of a chat prompt, from its pre-tokens (for a model without a tokenizer)."""
    split = _qwen_split()
    pieces = sum(len(split.findall(_text(m.get("content")))) for m in messages)
    return math.ceil(pieces * TOKENS_PER_PIECE) + MESSAGE_TOKENS * len(messages) + REPLY_TOKENS


@functools.cache
def _qwen_split():
    import regex

    return regex.compile(QWEN_SPLIT)


def _text(content) -> str:
    if isinstance(content, str):
        return content
    return "".join(p.get("text", "") for p in content or [] if isinstance(p, dict))


def token_counter(model) -> Callable[[list[dict]], int]:
    """How many prompt tokens `model` reads for a chat: its own tokenizer and chat template when it has them
    (HFChatModel, a learner's Sampler, EngineChat, the vLLM backend), else `estimate_tokens`."""
    tok = getattr(model, "tokenizer", None)
    if tok is None or getattr(tok, "chat_template", None) is None:
        return estimate_tokens

    def count(messages: list[dict]) -> int:
        return len(prompt_ids(tok, render_prompt(tok, messages)))  # remembered for the model's own tokenizing

    return count


def fit(build: Callable[[int], list[dict]], trimmable: int, count: Callable[[list[dict]], int], budget: int
        ) -> tuple[list[dict], int, int]:
    """The prompt `build(k)` with the fewest trimmed entries k (0 .. trimmable + 1, the last leaving out the whole
    trimmable part) that fits `budget` tokens: (messages, k, tokens). When none fits: (build(trimmable + 1) or
    build(0), k, tokens) with tokens > budget, for the caller to refuse."""
    first = build(0)
    n = count(first)
    if n <= budget or trimmable < 0:
        return first, 0, n
    last = trimmable + 1
    tried: dict[int, tuple[list[dict], int]] = {}

    def size(k: int) -> int:
        if k not in tried:
            msgs = build(k)
            tried[k] = (msgs, count(msgs))
        return tried[k][1]

    if size(last) > budget:
        return tried[last][0], last, tried[last][1]
    lo, hi = 1, last  # hi always fits; fewer trimmed entries make a longer prompt
    while lo < hi:
        mid = (lo + hi) // 2
        if size(mid) <= budget:
            hi = mid
        else:
            lo = mid + 1
    return tried[hi][0], hi, tried[hi][1]


def over_budget_message(agent: str, phase: str, question: str, tokens: int, budget: int, trimmed: bool,
                        limit: str | None = None, advice: str | None = None) -> str:
    """Why a prompt is refused. `limit`: the limit it is over when that is not limits.max_prompt_tokens (the room a
    model's context leaves, `context_room`); `advice`: what to do, when not raising the budget or dropping."""
    how = " even with the peers' notes left out" if trimmed else ""
    limit = limit or f"limits.max_prompt_tokens={budget}"
    advice = advice or "raise the budget, or set limits.over_budget: drop to leave such questions out"
    return (f"agent {agent!r}, phase {phase}, question {question!r}: the prompt is {tokens} tokens{how}, over "
            f"{limit} (the system prompt, question, options and own notes are never cut); {advice}")


def context_room(model, max_new_tokens: int) -> int | None:
    """The prompt tokens a model with a known context (`context_length`, the HF backends) has room for next to
    `max_new_tokens` of reply, as HFChatModel.generate counts it; None when the model states no context."""
    ctx = getattr(model, "context_length", None)
    if not isinstance(ctx, int) or ctx <= 0:
        return None
    new = max_new_tokens if max_new_tokens < ctx else max(1, ctx // 2)
    return max(1, ctx - new)
