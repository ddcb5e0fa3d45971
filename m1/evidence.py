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

    def shifted(self, by: int) -> Evidence:
        return Evidence(self.start + by, self.end + by, tuple((a + by, b + by) for a, b in self.sources), self.copy)

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
