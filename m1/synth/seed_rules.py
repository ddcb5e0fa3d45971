"""The seed kinds' rule-based policies on M1-Synth: what the teacher is to CPP, for Weaver, VideoZoomer and SAGE
(and any seed kind whose spec has `rules`).

Each kind's rules are in its module (SeedKindSpec `rules`: m1/kinds/weaver.py, ...), written against the chat as
m1/kinds/rules.py reads it. What they cannot do there is see: this module gives them M1-Synth's senses, the synth
vision model's pixel reader (m1/synth/vision.py) over the frames in the chat, as a VLM policy would look at them,
and the world's words for the objects a question names. Their replies are in the kind's syntax, so they go through
the same parsers as a real model's.

`TeacherChatModel` (backend `synth`) hands a seed-kind chat to `write` here, so a config names these policies the
way it names the teacher: `{interface: chat, backend: synth}`.
"""
from __future__ import annotations

import re

import numpy as np

from m1.evidence import ChatEvidence
from m1.kinds.rules import TIME, Chat, Cue, Reading, read_chat
from m1.models.base import SamplingParams
from m1.registry import seed_kind
from m1.synth.vision import _Answerer
from m1.synth.world import COLOURS, SHAPES

_OBJ = re.compile(r"\b(?:the|a|an) (" + "|".join(COLOURS) + r") (" + "|".join(SHAPES) + r")\b")


class SynthSenses:
    """How a rule policy sees on M1-Synth (m1/kinds/rules.py Senses)."""

    def look(self, chat: Chat, positions: list[int] | None) -> Reading:
        """The chat's frames (all, or those at `positions`), sorted by time, one per time, read by the synth vision
        model's pixel reader."""
        pos = range(len(chat.times)) if positions is None else positions
        by_time: dict[float, int] = {}
        for k in pos:
            if k < len(chat.images):
                by_time.setdefault(chat.times[k], k)
        if not by_time:
            return Reading(None, False)
        ts = sorted(by_time)
        frames = np.stack([np.asarray(chat.images[by_time[t]], np.uint8) for t in ts])
        reader = _Answerer(frames, ts, chat.question)
        out = reader.completion(SamplingParams(max_new_tokens=64))
        m = re.search(r"##Timestamp: (\[[^\]]*\])", out.text)
        a = re.search(r"##Answer: (.+)$", out.text, re.M)
        answer = m.group(1) if m else (a.group(1).strip() if a else None)
        if answer is not None and answer.lower() in ("not seen", "not found"):
            answer = None
        return Reading(answer, bool(out.meta.get("seen")), reader.notes, reader.options, reader.of, reader.note_times)

    def cue(self, text: str) -> Cue:
        """(kind of question, objects it names, a stated time) from the question's wording."""
        q = text.lower()
        objs = [f"{c} {s}" for c, s in _OBJ.findall(q)]
        t = TIME.search(q)
        if t and "[start" not in q:
            return "timestamp", objs, int(t.group(1)) * 60 + int(t.group(2))
        for word, name in (("right after", "order"), ("how many", "counting"), ("relative to", "spatial"),
                           ("when does", "grounding"), ("which way", "motion"), ("near the end", "late"),
                           ("background", "background"), ("where in the frame", "position")):
            if word in q:
                return name, objs, None
        return "other", objs, None


SENSES = SynthSenses()


def write(messages: list[dict], images: list[np.ndarray] | None) -> tuple[str, tuple[ChatEvidence, ...]]:
    """The rule policy's reply to a seed-kind chat, and where it reads the chat (m1/evidence.py ChatEvidence: its
    text, and the places of the frames it reads off pixels)."""
    chat = read_chat(messages, images, SENSES)
    rules = seed_kind(chat.kind).rules
    if rules is None:
        raise ValueError(f"seed kind {chat.kind!r} has no rule-based policy (SeedKindSpec rules)")
    return rules(chat)
