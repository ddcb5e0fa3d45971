"""Scripted models for engine tests: they count calls and see exactly what the engine sends."""
from __future__ import annotations

import hashlib

import numpy as np

from m1.models.base import Completion


class FakeChat:
    def __init__(self, name, reply):
        self.name, self.reply = name, reply  # reply(messages) -> str
        self.calls, self.batches = 0, []

    def generate(self, requests, params):
        self.calls += 1
        self.batches.append([r.messages for r in requests])
        outs = []
        for r in requests:
            text = self.reply(r.messages)
            ids = [ord(c) % 97 for c in text]
            outs.append(Completion(text=text, prompt_ids=[1, 2, 3], completion_ids=ids,
                                   logprobs=[-0.1] * len(ids)))
        return outs


class FakeVision:
    def __init__(self, name="browser", reply=None):
        self.name, self.calls, self.batches = name, 0, []
        self.reply = reply or (lambda req: f"Saw {len(req.frames)} frames from {req.timestamps[0]:.1f}s. ##Answer: A")

    def describe(self, requests, params):
        self.calls += 1
        self.batches.append(requests)
        return [Completion(text=self.reply(r)) for r in requests]


class FakeClip:
    """Embeds a frame by its mean colour and a text by a hash; deterministic and normalised."""

    name = "fakeclip"

    def __init__(self):
        self.image_calls = 0

    def encode_images(self, frames):
        self.image_calls += 1
        x = frames.reshape(len(frames), -1, 3).mean(1).astype(np.float32)
        x = np.concatenate([x, np.ones((len(x), 1), np.float32)], 1)
        return x / np.linalg.norm(x, axis=1, keepdims=True)

    def encode_texts(self, texts):
        rows = []
        for t in texts:
            h = hashlib.sha256(t.encode()).digest()
            v = np.array([h[0], h[1], h[2], 64], np.float32)
            rows.append(v / np.linalg.norm(v))
        return np.stack(rows)


def content(messages):
    return "\n".join(m["content"] if isinstance(m["content"], str) else str(m["content"]) for m in messages)


def scripted_reply(messages):
    """A well-behaved agent: plans, continues, answers A."""
    text = content(messages)
    if "##Final Answer" in text:
        return "##Final Answer: A ##Reason Summary: agents agreed"
    if "##tool call" in text:
        return "##tool call: continue()"
    if "##Answer" in text:
        return "##Answer: A ##Reason: the browser said A"
    return "##key info: the white square\n##tool use: <Global Sampling>, <Rough Browser>"
