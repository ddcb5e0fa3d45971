"""What a seed kind's rule-based policy reads and writes (SeedKindSpec `rules`): its chat, read into a `Chat`, and
the helpers the kinds' rules share. M1-Synth runs them (m1/synth/seed_rules.py) as the teacher is run for CPP.

A rule reads only its chat (never the world script): the system prompt (which kind, which tools are offered), the
question block, the tool observations, and the frames in it. It sees those frames through `Senses`, which whoever
runs the rules provides (M1-Synth: the synth vision model's pixel reader and the world's words), so that this layer
needs nothing of the synthetic world. Where a rule reads its chat's text (a stated time, the video's length, the span
a tool reported, an option), `Read` and `ReplyBuilder` record where (m1/evidence.py ChatEvidence, for SFT's attention
loss). What it reads off a frame cites that frame's place in the chat (its time label and, for a text policy, the
description that stands for its pixels): a note on the frames cites the frames it was read from.
"""
from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from m1.evidence import ChatEvidence, ReplyBuilder
from m1.models.base import part_starts, text_only
from m1.registry import seed_kind, seed_kinds

TIME = re.compile(r"\b(\d{1,2}):(\d{2})\b")  # a clock time in a question ("at 01:15")
OPTION = re.compile(r"^\s*\(?([A-H])[):.]\s*(.+?)\s*$", re.M)  # an option line ("B: a red triangle")
Cue = tuple[str, list[str], float | None]  # (kind of question, objects it names, a stated time in seconds)


@dataclass
class Reading:
    """What frames showed about the question: the answer read off them (None: nothing), whether its objects were
    seen, the reader's notes on them, the question's options, and `runs(object)`: each run of consecutive sightings
    of an object (`.first`, `.last` in seconds)."""

    answer: str | None
    seen: bool
    notes: list[str] = field(default_factory=list)
    options: list[str] = field(default_factory=list)
    runs: Callable[[str], list] = lambda name: []
    note_times: list[tuple[float, ...]] = field(default_factory=list)  # the frames (by time) each note is read from


class Senses(Protocol):
    """How a rule policy looks at its frames and reads its question's wording."""

    def look(self, chat: Chat, positions: list[int] | None) -> Reading:
        """The chat's frames (all, or those at `positions` in image order), read as a VLM policy would."""

    def cue(self, text: str) -> Cue:
        """(kind of question, objects it names, a stated time) from the question line."""


@dataclass
class Chat:
    """What the policy reads of its conversation."""

    kind: str
    tools: list[str]
    question: str  # the question block: "Question: ...", options, task line
    text: str  # the question line alone
    task: str
    duration: float
    glance: list[int]  # positions (in image order) of the first turn's frames
    times: list[float]  # time of every image part, in order
    replies: list[str]  # the policy's own earlier replies
    observations: list[str]  # tool observation lines, in order
    last_turn: bool
    senses: Senses
    images: list[np.ndarray] = field(default_factory=list)
    # where the rules' reads sit, as (message, start, end) in the messages' text_only contents (m1/evidence.py):
    # the question line's text, the video's length, each tool observation, each image part (with the time label
    # just before it), each option's text in order from A
    question_at: tuple[int, int, int] | None = None
    duration_at: tuple[int, int, int] | None = None
    observation_at: list[tuple[int, int, int]] = field(default_factory=list)
    frame_at: list[tuple[int, int, int]] = field(default_factory=list)
    option_at: list[tuple[int, int, int]] = field(default_factory=list)
    frame_text: list[str] = field(default_factory=list)  # each image part's text at frame_at (label + description)

    def look(self, positions: list[int] | None = None) -> Reading:
        """Look at the chat's frames (all, or those at `positions`), sorted by time, one per time."""
        return self.senses.look(self, positions)

    def cue(self) -> Cue:
        return self.senses.cue(self.text)


def chat_kind(messages: list[dict]) -> str | None:
    """Which seed kind a chat belongs to, from the marks its system prompt holds (None: not a seed-kind chat). Later
    kinds are tried first, so a kind whose prompt holds an earlier one's marks is still told apart."""
    system = next((m.get("content") for m in messages if m.get("role") == "system"), None)
    if not isinstance(system, str):
        return None
    specs = list(seed_kinds().values())[::-1]
    return next((s.name for s in specs if s.marks and all(m in system for m in s.marks)), None)


def listed_tools(system: str) -> list[str]:
    """The tools a system prompt lists as `- name: ...` lines (the default SeedKindSpec `offered_tools`)."""
    return re.findall(r"^- ([a-z_\-]+): ", system, re.M)


def read_chat(messages: list[dict], images: list[np.ndarray] | None, senses: Senses) -> Chat:
    kind = chat_kind(messages) or ""
    spec = seed_kind(kind) if kind else None
    system = messages[0].get("content", "") if messages else ""
    tools = ((spec.offered_tools or listed_tools) if spec else listed_tools)(system)
    times, glance, observations, users = [], [], [], []
    spots: dict[str, Any] = {"observation_at": [], "frame_at": [], "option_at": [], "frame_text": []}
    for n, m in enumerate(messages):
        if m.get("role") != "user":
            continue
        parts = (m["content"] if isinstance(m.get("content"), list)
                 else [{"type": "text", "text": str(m.get("content"))}])
        starts = part_starts([*parts, {"type": "text", "text": ""}])  # and where the content ends
        flat = text_only([{"content": parts}])[0]["content"]
        for i, (p, at) in enumerate(zip(parts, starts)):
            if p.get("type") == "image":
                if len(users) == 0:
                    glance.append(len(times))
                times.append(float(p.get("time", 0.0)))
                label = i > 0 and str(parts[i - 1].get("text", "")).startswith("<frame")
                spots["frame_at"].append((n, starts[i - 1] if label else at, starts[i + 1]))
                spots["frame_text"].append(flat[spots["frame_at"][-1][1]:starts[i + 1]])
            else:
                text = str(p.get("text", ""))
                if text.startswith("["):
                    observations.append(text)
                    spots["observation_at"].append((n, at, at + len(text)))
                if not users:
                    _spot(spots, "question_at", r"^Question: (.+)$", text, n, at)
                    _spot(spots, "duration_at", r"The video lasts ([\d.]+) s", text, n, at)
                    if not spots["option_at"] and "Options:" in text:
                        spots["option_at"] = _options_at(text, n, at)
        users.append(" ".join(str(p.get("text", "")) for p in parts if p.get("type") != "image"))
    first = users[0] if users else ""
    qm = re.search(r"^Question: .*?(?=^Task:|\Z)", first, re.M | re.S)
    question = qm.group(0).strip() if qm else first
    line = re.search(r"^Question: (.+)$", first, re.M)
    task = re.search(r"^Task: (.+)$", first, re.M)
    dur = re.search(r"The video lasts ([\d.]+) s", first)
    last = spec is not None and bool(users) and spec.last_turn in users[-1]
    return Chat(kind=kind, tools=tools, question=question, text=line.group(1).strip() if line else "",
                task=_task(task.group(1) if task else ""), duration=float(dur.group(1)) if dur else 0.0,
                glance=glance, times=times, replies=[m.get("content", "") for m in messages
                                                     if m.get("role") == "assistant"],
                observations=observations, last_turn=last, senses=senses, images=list(images or []), **spots)


def _options_at(text: str, message: int, at: int) -> list[tuple[int, int, int]]:
    """Where each option's text sits, A first, in the text part holding the options block."""
    block = text.index("Options:")
    found: list[tuple[int, int, int]] = []
    for m in OPTION.finditer(text, block):
        if ord(m.group(1)) - 65 != len(found):
            break
        found.append((message, at + m.start(2), at + m.end(2)))
    return found


def _spot(spots: dict[str, Any], name: str, pattern: str, text: str, message: int, at: int) -> None:
    """Keep where `pattern`'s group 1 (stripped) first sits in a text part starting at `at` of `message`."""
    m = re.search(pattern, text, re.M)
    if m and name not in spots:
        raw = m.group(1)
        a = m.start(1) + len(raw) - len(raw.lstrip())
        spots[name] = (message, at + a, at + a + len(raw.strip()))


def _task(line: str) -> str:
    low = line.lower()
    for word, task in (("multiple choice", "mcq"), ("temporal grounding", "grounding"), ("numeric", "numeric")):
        if low.startswith(word):
            return task
    return "open"


@dataclass(frozen=True)
class Read:
    """A value a rule read off its chat: written into a reply's JSON, it cites `sources` (m1/evidence.py)."""

    value: Any
    sources: tuple


@dataclass(frozen=True)
class Said:
    """Words a rule writes in pieces, each (text, sources, copy) citing where it was read (`copy` as in
    m1/evidence.py): its reasoning, written into a reply by `say` or, as a JSON string, by `write_json`."""

    pieces: tuple[tuple[str, tuple, bool], ...] = ()

    def __add__(self, other: Said | str) -> Said:
        return Said(self.pieces + (other.pieces if isinstance(other, Said) else ((other, (), False),)))

    def __radd__(self, other: str) -> Said:
        return Said(((other, (), False),) + self.pieces)

    def __str__(self) -> str:
        return "".join(text for text, _, _ in self.pieces)


def say(out: ReplyBuilder, said: Said | str, escape: bool = False) -> None:
    """Write `said` into `out`, each piece citing its sources (`escape`: as inside a JSON string)."""
    for text, sources, copy in said.pieces if isinstance(said, Said) else ((said, (), False),):
        out.read(json.dumps(text)[1:-1] if escape else text, sources, copy)


def answer_reply(before: str, why: Said | str, between: str, answer: Read
                 ) -> tuple[str, tuple[ChatEvidence, ...]]:
    """The answer turn `before` + why + `between` + answer + `</answer>`, its reasoning and answer citing their
    reads."""
    out = ReplyBuilder()
    out.add(before)
    say(out, why)
    out.add(between)
    out.read(answer.value, answer.sources)
    out.add("</answer>")
    return out.done()


def write_json(out: ReplyBuilder, value: Any) -> None:
    """`json.dumps(value)` written piece by piece into `out`, each `Read` in it citing where it was read (a `Said`
    is written as a string)."""
    if isinstance(value, Read):
        out.read(json.dumps(value.value), value.sources)
    elif isinstance(value, Said):
        out.add('"')
        say(out, value, escape=True)
        out.add('"')
    elif isinstance(value, dict):
        out.add("{")
        for i, (k, v) in enumerate(value.items()):
            out.add((", " if i else "") + json.dumps(k) + ": ")
            write_json(out, v)
        out.add("}")
    elif isinstance(value, (list, tuple)):
        out.add("[")
        for i, v in enumerate(value):
            out.add(", " if i else "")
            write_json(out, v)
        out.add("]")
    else:
        out.add(json.dumps(value))


def time_at(chat: Chat) -> tuple:
    """Where the question states its time (the sources of a read of it), or nothing."""
    t = TIME.search(chat.text)
    if chat.question_at is None or t is None:
        return ()
    m, a, _ = chat.question_at
    return ((m, a + t.start(), a + t.end()),)


def length_at(chat: Chat) -> tuple:
    """Where the first turn states the video's length (the sources of a read of it), or nothing."""
    return (chat.duration_at,) if chat.duration_at else ()


def fallback(chat: Chat) -> str:
    """A guess in the task's form, when nothing could be read."""
    return {"mcq": "A", "numeric": "0", "grounding": "[0.0 - 1.0]"}.get(chat.task, "unknown")


def frames_at(chat: Chat, times) -> tuple:
    """Where the frames shown at `times` sit in the chat (the sources of what was read off them)."""
    want = set(times)
    return tuple(at for t, at in zip(chat.times, chat.frame_at) if t in want)


def _chosen(chat: Chat, r: Reading) -> tuple[int | None, tuple]:
    """The option the answer letter names (None: no option) and where its text sits in the question."""
    letter = (r.answer or "").strip()
    if not (len(letter) == 1 and "A" <= letter <= "Z" and ord(letter) - 65 < len(r.options)):
        return None, ()
    k = ord(letter) - 65
    at = chat.option_at[k] if len(chat.option_at) == len(r.options) else None
    return k, ((at,) if at is not None and at[2] - at[1] == len(r.options[k]) else ())


def evidence(chat: Chat, r: Reading, answer: str | None = None) -> Said:
    """What the frames showed about the question's objects, each note citing its frames, then (with `answer`) the
    reading drills' chain to it (`chain`): the reasoning a student can read its answer from (an answer letter alone
    gives a tiny policy nothing to learn from)."""
    said = Said()
    for note, times in zip(r.notes, _note_times(r)):
        said = said + ". " + Said(((note.rstrip("."), frames_at(chat, times), False),))
    return said if answer is None else said + ". Read:" + chain(chat, r, answer)


def _note_times(r: Reading) -> list[tuple[float, ...]]:
    return [*r.note_times, *[()] * (len(r.notes) - len(r.note_times))]


CHAIN_FRAMES = 2  # frames a chain quotes at most (an order needs two; a position read off ten sightings one)


def chain(chat: Chat, r: Reading, answer: str) -> Said:
    """The hops from the chat to `answer` in the notation of the mini base's reading drills (m1/pretrain/drills.py,
    ` 78 -> 78.8s>[a small red cross at the top left] -> red -> B`): the question's clock time in seconds, each
    frame the notes read quoted as the chat shows it (after its `<frame k at`), the chosen option's words copied,
    then the answer. Every hop is one the base practised, each cited, so the student's answer is read off the step
    just written rather than recalled across the whole chat."""
    hops: list[Said] = []
    clock = TIME.search(chat.text)
    if clock:
        hops.append(Said(((f" {int(clock.group(1)) * 60 + int(clock.group(2))}", time_at(chat), False),)))
    times = list(dict.fromkeys(t for ts in _note_times(r) for t in ts))[:CHAIN_FRAMES]
    for t in times:
        if t not in chat.times:
            continue
        k = chat.times.index(t)
        text, (m, a, b) = chat.frame_text[k], chat.frame_at[k]
        cut = text.index(" at ") + 3 if text.startswith("<frame") and " at " in text else 0
        hops.append(Said(((text[cut:], ((m, a + cut, b),), True),)))
    k, at = _chosen(chat, r)
    if k is not None:
        hops.append(Said(((" ", (), False), (r.options[k], at, True))))
    hops.append(Said(((" " + answer, answer_read(chat, r, answer).sources, False),)))
    out = hops[0]
    for hop in hops[1:]:
        out = out + " ->" + hop
    return out


def answer_read(chat: Chat, r: Reading, answer: str) -> Read:
    """The answer as read: a letter from its option's text, any other answer from the frames the notes read."""
    k, at = _chosen(chat, r)
    if k is not None:
        return Read(answer, at)
    return Read(answer, frames_at(chat, {t for times in r.note_times for t in times}))


TOOL_SAYS = "the tool's result"  # why an answer is a tool's span


def answer_now(chat: Chat, prefer: Read | None = None) -> tuple[Read, Said | str]:
    """(answer, why) from every frame seen; `prefer` (a tool's span) when the frames settle nothing."""
    r = chat.look()
    if r.answer is not None and (r.seen or prefer is None):
        seen = "" if r.seen else " but could not see it"
        why = f"I read {len(set(chat.times))} frames{seen}" + evidence(chat, r, r.answer)
        return answer_read(chat, r, r.answer), why
    if prefer is not None:
        return prefer, TOOL_SAYS
    return Read(fallback(chat), ()), "a guess"


def calls_made(chat: Chat, tag: str) -> int:
    """The policy's earlier replies that hold a `<tag>`."""
    return sum(bool(re.search(rf"<{tag}>", r)) for r in chat.replies)
