"""The user turns every seed kind shares (each kind's system prompt and its own turn texts are in its module).

The first user turn shows the glance (uniform frames, each after a `<frame k at t s>` label, VideoZoomer's
interleaving) and then the question; every later user turn carries tool observations: a short text line per
tool and the frames it returned. Frames are image parts (m1.models.base.ChatRequest); a text-only model sees
placeholders instead.
"""
from __future__ import annotations

from collections.abc import Sequence

from m1.agents.prompts import render_question
from m1.registry import seed_kind
from m1.schema import Question

# What a captioner (`seed_system.captioner`) is asked of each frame a text policy is shown
CAPTION_PROMPT = "Describe this frame: every object you see, its colour, shape and size, and where it is."


def caption_text(reply: str) -> str:
    """A captioner's reply as one line for the policy's chat: without M1's `##Summary:` marker and line breaks."""
    text = reply.strip()
    if text.lower().startswith("##summary:"):
        text = text[len("##summary:"):]
    return " ".join(text.split())


def frame_parts(indices: Sequence[int], times: Sequence[float], start: int = 0) -> list[dict]:
    """Each frame as a `<frame k at t s>` label followed by its image part (k counts from `start`)."""
    parts: list[dict] = []
    for k, (i, t) in enumerate(zip(indices, times)):
        parts.append({"type": "text", "text": f"<frame {start + k} at {t:.1f}s>"})
        parts.append({"type": "image", "time": round(float(t), 3), "frame": int(i)})
    return parts


def first_turn(kind: str, question: Question, duration: float, indices: Sequence[int],
               times: Sequence[float]) -> list[dict]:
    """The glance and the question: the content of the first user message."""
    head = (f"The video lasts {duration:.1f} s. {len(indices)} frames sampled uniformly follow, each after its "
            f"time.")
    ask = seed_kind(kind).ask
    parts = [{"type": "text", "text": head}] + frame_parts(indices, times)
    parts.append({"type": "text", "text": "\n" + render_question(question) + "\n" + ask})
    return parts
