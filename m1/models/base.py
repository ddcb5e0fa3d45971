"""The two small protocols every backend implements, and the records they exchange.

Calls are batched: the episode engine gathers the requests of all agents of all episodes in
flight and sends each model one list per phase.
"""
from __future__ import annotations

import threading
import weakref
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import numpy as np

from m1.evidence import ChatEvidence


@dataclass
class SamplingParams:
    max_new_tokens: int = 256
    temperature: float = 0.0  # 0 means greedy
    top_p: float = 1.0
    seed: int | None = None
    logprobs: bool = True  # return per-token log-probs when the backend can


@dataclass
class ChatRequest:
    """A chat in OpenAI message form: [{"role": ..., "content": str}, ...].

    Multimodal chats (the seed kinds' policies, m1/team/single.py): a content may be a list of parts,
    {"type": "text", "text": ...} or {"type": "image", "time": seconds, "frame": index}; the k-th image part's
    pixels are `images[k]` (H, W, 3 uint8). Parts stay JSON-safe, so the messages can be traced as they are.
    Only models with `accepts_images = True` are sent images; others get `text_only(messages)`."""

    messages: list[dict[str, Any]]
    images: list[np.ndarray] | None = None
    seed: int | None = None  # this request's sampling seed; None: derived from the call's (request_seeds)


def mix_seed(seed: int, index: int) -> int:
    """A seed for item `index` of a call seeded `seed` (splitmix64, kept below 2**31 for every server's API): calls
    with neighbouring seeds get unrelated request seeds (with seed + index, request 1 of call s and request 0 of
    call s + 1 drew the same noise)."""
    x = (int(seed) * 0x9E3779B97F4A7C15 + int(index) + 1) & 0xFFFFFFFFFFFFFFFF
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    return (x ^ (x >> 31)) % (2 ** 31 - 1)


def request_seeds(requests: list, params: SamplingParams) -> list[int | None]:
    """The seed each request of one call samples with: its own `seed` when set, else `mix_seed(call seed, index)`.

    Every backend uses this one rule, so K copies of a prompt in one call draw K different samples; a caller that
    splits a call (learner ranks, batches) stamps the seeds first, so the samples do not depend on the split."""
    own = [getattr(r, "seed", None) for r in requests]
    return [s if s is not None else (None if params.seed is None else mix_seed(params.seed, i))
            for i, s in enumerate(own)]


def with_seeds(requests: list[ChatRequest], params: SamplingParams) -> list[ChatRequest]:
    """The requests with their seeds stamped (see `request_seeds`), before the call is split."""
    from dataclasses import replace

    return [replace(r, seed=s) for r, s in zip(requests, request_seeds(requests, params))]


def text_only(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Messages with every list content flattened to a string; an image part becomes its description in brackets when
    it carries one (`seed_system.captioner`; the seed kinds label each frame with its time just before), else a
    placeholder naming its time: how a text-only chat model is shown the frames of a seed-kind conversation."""
    return [{**m, "content": "".join(map(_flat, m["content"])) if isinstance(m.get("content"), list)
             else m.get("content")} for m in messages]


def _flat(part: Any) -> str:
    if isinstance(part, dict) and part.get("type") == "image":  # a described frame: its description
        return f"[{part['caption']}]" if part.get("caption") else f"[frame at {float(part.get('time', 0.0)):.1f}s]"
    return str(part.get("text", "")) if isinstance(part, dict) else str(part)


def part_starts(content: list[Any]) -> list[int]:
    """Where each part of a list content starts in its `text_only` flattening (evidence counts characters there)."""
    starts, at = [], 0
    for part in content:
        starts.append(at)
        at += len(_flat(part))
    return starts


def image_frames(messages: list[dict[str, Any]]) -> list[int]:
    """The video frame index of every image part of `messages`, in order: with the video's path this is all a
    learner needs to rebuild a prompt's pixels, so samples and traces never carry them."""
    return [int(part["frame"]) for m in messages if isinstance(m.get("content"), list)
            for part in m["content"] if isinstance(part, dict) and part.get("type") == "image"]


PROMPT_MEMO_TOKENS = 1 << 20  # token ids remembered per tokenizer (8 MB, plus their texts)


class _PromptMemo:
    def __init__(self):
        self.ids: OrderedDict[str, np.ndarray] = OrderedDict()
        self.tokens = 0


_memos: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # tokenizer -> _PromptMemo
_memo_lock = threading.Lock()


def prompt_ids(tokenizer, text: str) -> list[int]:
    """`tokenizer(text, add_special_tokens=False)["input_ids"]` of a rendered prompt, remembered per tokenizer.

    The team's prompt budget, the learner's length check and the model each need the ids of the same prompt, and
    tokenizing is most of what preparing one costs (~1.5 ms per thousand tokens; rendering is ~60x cheaper): keyed
    by the exact text, a prompt is tokenized once. Least recently used texts go past PROMPT_MEMO_TOKENS."""
    with _memo_lock:
        try:
            memo = _memos.get(tokenizer)
        except TypeError:  # a tokenizer that cannot be weakly referenced: no memo
            memo = None
        else:
            if memo is None:
                memo = _memos[tokenizer] = _PromptMemo()
            if text in memo.ids:
                memo.ids.move_to_end(text)
                return memo.ids[text].tolist()
    ids = list(tokenizer(text, add_special_tokens=False)["input_ids"])
    if memo is not None:
        with _memo_lock:
            if text not in memo.ids:
                memo.ids[text] = np.asarray(ids, np.int64)
                memo.tokens += len(ids)
            while memo.tokens > PROMPT_MEMO_TOKENS:
                memo.tokens -= len(memo.ids.popitem(last=False)[1])
    return ids


@dataclass
class VisionRequest:
    """Frames (T, H, W, 3 uint8 RGB) with their times in seconds, and a text prompt."""

    frames: np.ndarray
    timestamps: list[float]
    prompt: str
    system: str | None = None


@dataclass
class Completion:
    text: str
    prompt_ids: list[int] | None = None
    completion_ids: list[int] | None = None
    logprobs: list[float] | None = None
    finish_reason: str = "stop"
    meta: dict[str, Any] = field(default_factory=dict)
    # where the reply reads its request's messages (a rule teacher knows; a sampled model says nothing)
    evidence: tuple[ChatEvidence, ...] = ()


@runtime_checkable
class ChatModel(Protocol):
    name: str

    def generate(self, requests: list[ChatRequest], params: SamplingParams) -> list[Completion]:
        ...


@runtime_checkable
class VisionModel(Protocol):
    name: str

    def describe(self, requests: list[VisionRequest], params: SamplingParams) -> list[Completion]:
        ...


@runtime_checkable
class ClipModel(Protocol):
    """Image/text embedder for the retrieval tools. Both methods return L2-normalised rows."""

    name: str

    def encode_images(self, frames: np.ndarray) -> np.ndarray:
        ...

    def encode_texts(self, texts: list[str]) -> np.ndarray:
        ...


class ModelError(RuntimeError):
    """A model could not be loaded or called; the message names the model and the cause."""


class ServerUnavailable(ModelError):
    """A served model (an OpenAI-compatible endpoint) that stopped answering: connection refused, timeouts or 5xx
    until its retries ran out. Inference may record the questions in flight as error rows and go on
    (m1/team/engine.py `TeamEngine.run`); anything else stops on it like any ModelError."""
