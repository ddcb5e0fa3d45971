"""Evidence: where each stretch of a training target is read from in its context, carried with the example.

A student learns a lookup far faster when one attention head is shown where the answer sits (the plateau study in
docs/experiments/mini_base.md). Whoever writes an example knows that place exactly: a drill generator placed the
caption it quotes, a teacher knows which note its answer came from. So the example carries it, in characters of the
whole text (prompt + target), and `token_evidence` turns it into token positions once the example is tokenized.
Nothing here matches strings: a span is recorded where the text is written (`TextBuilder`).
"""
from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import Sequence


@dataclass(frozen=True)
class Evidence:
    """Target characters [start, end) are read from `sources` (character spans earlier in the same text).

    copy: the stretch is written out of each source character by character (a quote), so each target token points
    at the source token holding the same character; otherwise (a letter read off its option, seconds off a clock)
    every token of the stretch points at every token of every source, and they share the head's target mass."""

    start: int
    end: int
    sources: tuple[tuple[int, int], ...]
    copy: bool = False

    def to_json(self) -> list:
        return [self.start, self.end, [list(s) for s in self.sources], self.copy]

    @classmethod
    def from_json(cls, row: Sequence) -> Evidence:
        start, end, sources, copy = row
        return cls(int(start), int(end), tuple((int(a), int(b)) for a, b in sources), bool(copy))


class TextBuilder:
    """A text written piece by piece that says where each piece landed (its character span)."""

    def __init__(self, text: str = ""):
        self.text = text

    def add(self, piece: str) -> tuple[int, int]:
        start = len(self.text)
        self.text += piece
        return start, len(self.text)


def token_evidence(offsets: Sequence[tuple[int, int]], evidence: Sequence[Evidence], first: int = 1
                   ) -> list[tuple[int, tuple[int, ...]]]:
    """(query position, evidence token positions) for every token at or after `first` that an evidence stretch
    covers. The query is the position before the token (the one whose output predicts it); evidence positions are
    never after the query. `offsets` are the tokens' character spans in the same text the evidence counts in."""
    ends = [b for _, b in offsets]

    def token_at(c: int) -> int:  # the first token ending after character c (a space may belong to no token)
        return bisect.bisect_right(ends, c)

    def tokens_over(a: int, b: int) -> list[int]:
        return [i for i in range(token_at(a), len(offsets)) if offsets[i][0] < b and offsets[i][1] > a]

    rows: list[tuple[int, tuple[int, ...]]] = []
    for i in range(max(first, 1), len(offsets)):
        a, b = offsets[i]
        if b <= a:
            continue
        for ev in evidence:
            if a >= ev.end or b <= ev.start:
                continue
            if ev.copy:
                delta = max(a, ev.start) - ev.start
                found = {token_at(s + delta) for s, e in ev.sources if s + delta < e}
            else:
                found = {t for s, e in ev.sources for t in tokens_over(s, e)}
            found = {t for t in found if t < i}
            if found:
                rows.append((i - 1, tuple(sorted(found))))
            break
    return rows


@dataclass(frozen=True)
class ChatEvidence:
    """Reply characters [start, end) are read from `sources`: (message index, start, end) spans of the chat's
    message contents (a list content counts in its text_only flattening, m1/models/base.py). A chat reaches the
    learner through a chat template, so its evidence names messages rather than characters of one text; `copy` as
    in `Evidence`. Written by whoever writes the reply (the rule teacher: m1/synth/teacher.py)."""

    start: int
    end: int
    sources: tuple[tuple[int, int, int], ...]
    copy: bool = False

    def __post_init__(self):  # rows read back from JSON hold lists; keep the value hashable and comparable
        sources = tuple(tuple(int(x) for x in s) for s in self.sources)
        if any(len(s) != 3 for s in sources):
            raise ValueError(f"evidence: each source is [message, start, end], got {self.sources}")
        object.__setattr__(self, "sources", sources)

    def placed(self, content_starts: Sequence[int | None], reply_start: int) -> Evidence:
        """As `Evidence` of one text where message i's content starts at `content_starts[i]` and the reply at
        `reply_start`."""
        return Evidence(reply_start + self.start, reply_start + self.end,
                        tuple((content_starts[m] + a, content_starts[m] + b) for m, a, b in self.sources), self.copy)


class ReplyBuilder(TextBuilder):
    """A reply written piece by piece that keeps where each piece it reads is read from (`ChatEvidence`)."""

    def __init__(self):
        super().__init__()
        self.evidence: list[ChatEvidence] = []

    def read(self, piece: str, sources, copy: bool = False) -> tuple[int, int]:
        """Write `piece`, read from `sources` ((message, start, end); None entries are left out)."""
        at = self.add(piece)
        self.cite(at, sources, copy)
        return at

    def cite(self, at: tuple[int, int], sources, copy: bool = False) -> None:
        found = tuple(dict.fromkeys(s for s in sources if s is not None))
        if found and at[1] > at[0]:
            self.evidence.append(ChatEvidence(at[0], at[1], found, copy))

    def done(self) -> tuple[str, tuple[ChatEvidence, ...]]:
        return self.text, tuple(self.evidence)


def content_starts(rendered: str, contents: Sequence[str], needed: Sequence[int] | None = None
                   ) -> list[int | None]:
    """Where each message's content sits in `rendered` (a chat template's text), found in order after the one
    before: the template's own markup lies between them. Locating a message is structure, not evidence. A template
    may rewrite a message (Qwen3's drops an earlier reply's <think> part): one outside `needed` (None: all) that is
    not found has no start."""
    starts: list[int | None] = []
    at = 0
    for i, content in enumerate(contents):
        found = rendered.find(content, at)
        if found < 0 and (needed is None or i in needed):
            raise ValueError(f"evidence: message {i}'s content is not in the rendered chat (the chat template "
                             f"rewrites it): {content[:60]!r}")
        starts.append(found if found >= 0 else None)
        at = found + len(content) if found >= 0 else at
    return starts


def chat_token_evidence(rendered: str, contents: Sequence[str], prompt_offsets: Sequence[tuple[int, int]],
                        reply: str, reply_offsets: Sequence[tuple[int, int]], evidence: Sequence[ChatEvidence],
                        tail: int = 0) -> list[tuple[int, tuple[int, ...]]]:
    """`token_evidence` of a chat sample: the prompt is `rendered` (the chat template's text of messages whose
    contents are `contents`) tokenized with `prompt_offsets`, the reply is tokenized on its own with
    `reply_offsets` and followed by `tail` tokens of no text (end-of-turn). Positions count the prompt's tokens,
    then the reply's."""
    starts = content_starts(rendered, contents, {m for ev in evidence for m, _, _ in ev.sources})
    for ev in evidence:
        for m, a, b in ev.sources:
            if not (0 <= m < len(contents) and 0 <= a <= b <= len(contents[m])):
                raise ValueError(f"evidence: source [{m}, {a}, {b}] is outside the chat's messages")
        if not 0 <= ev.start <= ev.end <= len(reply):
            raise ValueError(f"evidence: [{ev.start}, {ev.end}) is outside the reply of {len(reply)} characters")
    shift, end = len(rendered), len(rendered) + len(reply)
    offsets = [*prompt_offsets, *((a + shift, b + shift) for a, b in reply_offsets), *[(end, end)] * tail]
    return token_evidence(offsets, [ev.placed(starts, shift) for ev in evidence], first=len(prompt_offsets))
