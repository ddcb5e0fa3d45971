"""The two small protocols every backend implements, and the records they exchange.

Calls are batched: the episode engine gathers the requests of all agents of all episodes in
flight and sends each model one list per phase.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import numpy as np


@dataclass
class SamplingParams:
    max_new_tokens: int = 256
    temperature: float = 0.0  # 0 means greedy
    top_p: float = 1.0
    seed: int | None = None
    logprobs: bool = True  # return per-token log-probs when the backend can


@dataclass
class ChatRequest:
    """A chat in OpenAI message form: [{"role": ..., "content": str}, ...]."""

    messages: list[dict[str, Any]]


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
