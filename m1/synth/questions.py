"""Questions about an M1-Synth script, with ground truth read from the script.

Families follow the paper's four task kinds: long-video MCQ (timestamp, order, attribute),
counting, spatial, temporal grounding, plus short open answers. Each question records its family
and the evidence it needs (`meta["evidence"]`: time span, object names, event ids), and cues a
rule-based teacher can act on (`meta["cue"]`, `meta["plan"]`, `meta["key_info"]`, `meta["time"]`).

A question is only asked when the script makes its answer unambiguous for someone who looks at
the right frames (e.g. the referenced object is unique in the video, nothing else appears near
the asked moment).
"""
from __future__ import annotations

import random
from collections import defaultdict
from typing import Callable

from m1.registry import (FINE_BROWSER, GLOBAL_SAMPLING, GROUNDING_TOOL, IMAGE_RETRIEVAL, ROUGH_BROWSER, SPACE_TOOL,
                         TIME_STAMP_RETRIEVAL, VIDEO_RETRIEVAL)
from m1.schema import LETTERS, Question
from m1.synth.world import CELLS, COLOURS, MOTIONS, SHAPES, Event, Script, fmt_time

FAMILIES = ("timestamp", "order", "attribute", "counting", "spatial", "grounding", "open")
TASK_OF = {"timestamp": "mcq", "order": "mcq", "attribute": "mcq", "spatial": "mcq",
           "counting": "numeric", "grounding": "grounding", "open": "open"}

# Option wordings shared with the synth vision model (it maps what it saw to these texts).
RELATIONS = {"left": "to the left", "right": "to the right", "above": "above", "below": "below"}
MOTION_TEXT = {"still": "stays still", "left": "moves left", "right": "moves right",
               "up": "moves up", "down": "moves down"}
POSITIONS = tuple(CELLS.values())

# What a good plan looks like for each cue (read by the rule-based teacher).
_GS, _VR, _TSR, _IR = (s.name for s in (GLOBAL_SAMPLING, VIDEO_RETRIEVAL, TIME_STAMP_RETRIEVAL, IMAGE_RETRIEVAL))
_RB, _FB, _ST, _GT = (s.name for s in (ROUGH_BROWSER, FINE_BROWSER, SPACE_TOOL, GROUNDING_TOOL))
PLANS = {
    "timestamp": [_TSR, _RB],
    "order": [_VR, _FB],
    "brief": [_IR, _FB],
    "motion": [_VR, _FB],
    "count": [_GS, _FB],
    "spatial": [_VR, _ST],
    "grounding": [_VR, _GT],
    "end": [_TSR, _FB],
    "background": [_IR, _RB],
}

BRIEF = 3.5  # longest event a browser should call a "flash"
ORDER_GAP = 6.0  # the next object appears at most this long after the reference leaves
QUIET = 5.0  # no other object appears this close to an asked moment


class LetterCycle:
    """Hands out answer letters in shuffled blocks so every letter is used equally often."""

    def __init__(self, rng: random.Random, n: int = 4):
        self.rng, self.n, self.block = rng, n, []

    def next(self) -> int:
        if not self.block:
            self.block = list(range(self.n))
            self.rng.shuffle(self.block)
        return self.block.pop()


def with_article(name: str) -> str:
    return ("an " if name[0] in "aeiou" else "a ") + name


def late_window(duration: float) -> float:
    """Length of the "near the end" part of a video, in seconds."""
    return min(60.0, duration / 4)


def make_questions(script: Script, video_path: str, rng: random.Random, limit: int | None = None,
                   letters: LetterCycle | None = None, id_prefix: str | None = None) -> list[Question]:
    """All families' questions for one video, interleaved family by family, at most `limit`.

    `letters` lets a caller share one letter balance over many videos (make_dataset does).
    """
    letters = letters or LetterCycle(rng)
    gen = _Gen(script, video_path, rng, letters)
    per_family: dict[str, list[Callable[[], Question]]] = {f: [] for f in FAMILIES}
    for family in FAMILIES:
        cands = getattr(gen, f"_{family}")()
        if family not in ("attribute", "open"):  # those two interleave their subtypes themselves
            rng.shuffle(cands)
        per_family[family] = cands
    out: list[Question] = []
    prefix = id_prefix or f"synth-{script.seed}"
    while any(per_family.values()) and (limit is None or len(out) < limit):
        for family in FAMILIES:
            if per_family[family] and (limit is None or len(out) < limit):
                q = per_family[family].pop(0)()
                q.id = f"{prefix}-q{len(out):02d}"
                out.append(q)
    return out


class _Gen:
    def __init__(self, script: Script, video: str, rng: random.Random, letters: LetterCycle):
        self.s, self.video, self.rng, self.letters = script, video, rng, letters
        self.by_name: dict[str, list[Event]] = defaultdict(list)
        for e in script.events:
            self.by_name[e.obj.name].append(e)
        self.starts = sorted(e.start for e in script.events)

    # ---------------------------------------------------------------------------------------
    # helpers

    def unique(self, e: Event) -> bool:
        return len(self.by_name[e.obj.name]) == 1

    def starts_near(self, t: float, radius: float, exclude: tuple[Event, ...] = ()) -> bool:
        skip = {x.id for x in exclude}
        return any(abs(e.start - t) < radius for e in self.s.events if e.id not in skip)

    def names_near(self, lo: float, hi: float) -> list[str]:
        return list(dict.fromkeys(e.obj.name for e in self.s.events if e.start < hi and e.end > lo))

    def question(self, family: str, text: str, answer: str, span: tuple[float, float],
                 events: list[Event], cue: str, options: list[str] | None = None, **extra) -> Question:
        meta = {"family": family, "cue": cue, "plan": list(PLANS[cue]),
                "key_info": extra.pop("key_info", ""),
                "evidence": {"span": [round(span[0], 2), round(span[1], 2)],
                             "objects": [e.obj.name for e in events], "events": [e.id for e in events]},
                "duration": self.s.duration, **extra}
        return Question(id="", video=self.video, text=text, options=options or [], task=TASK_OF[family],
                        answer=answer, meta=meta)

    def mcq(self, family: str, text: str, right: str, distractors: list[str], span, events, cue,
            **extra) -> Question:
        """Place the right option at the next balanced letter; the others in seeded order."""
        wrong = [d for d in dict.fromkeys(distractors) if d != right][:3]
        if len(wrong) < 3:
            raise ValueError(f"need 3 distractors for {text!r}, got {wrong}")
        self.rng.shuffle(wrong)
        k = self.letters.next()
        options = wrong[:k] + [right] + wrong[k:]
        return self.question(family, text, LETTERS[k], span, events, cue, options=options, **extra)

    def other_colours(self, colour: str, lo: float, hi: float) -> list[str]:
        near = [n.split()[0] for n in self.names_near(lo, hi)]
        rest = [c for c in COLOURS if c not in near]
        self.rng.shuffle(rest)
        return [c for c in dict.fromkeys(near + rest) if c != colour]

    def other_names(self, exclude: set[str], lo: float, hi: float) -> list[str]:
        near = [n for n in self.names_near(lo, hi) if n not in exclude]
        self.rng.shuffle(near)
        rest = [f"{c} {s}" for c in COLOURS for s in SHAPES if f"{c} {s}" not in exclude]
        self.rng.shuffle(rest)
        return list(dict.fromkeys(near + rest))

    def interleave(self, *lists: list) -> list:
        """Shuffle each subtype's candidates and alternate the subtypes, so all get asked."""
        for lst in lists:
            self.rng.shuffle(lst)
        out = []
        for i in range(max(map(len, lists))):
            for lst in lists:
                out += lst[i:i + 1]
        return out

    # ---------------------------------------------------------------------------------------
    # families: each returns a list of builders (called only for the questions kept)

    def _timestamp(self):
        out = []
        for e in self.s.events:
            same_before = any(x.id != e.id and x.obj.name == e.obj.name and e.start - 8 <= x.end <= e.start
                              for x in self.by_name[e.obj.name])
            if 4 <= e.duration <= 10 and e.start >= 5 and not same_before \
                    and not self.starts_near(e.start, QUIET + 0.5, (e,)):
                out.append(lambda e=e: self.mcq(
                    "timestamp", f"What colour is the shape that appears at {fmt_time(e.start)}?",
                    e.obj.colour, self.other_colours(e.obj.colour, e.start - 30, e.start + 30),
                    (max(0.0, e.start - 10), e.end), [e], "timestamp", time=e.start,
                    key_info=f"the shape that appears at {fmt_time(e.start)}"))
        return out

    def _order(self):
        out = []
        for a in self.s.events:
            if not self.unique(a):
                continue
            after = [e for e in self.s.events if e.start > a.end]
            if not after:
                continue
            b = min(after, key=lambda e: (e.start, e.id))
            if b.start - a.end > ORDER_GAP or b.obj.name == a.obj.name:
                continue
            if any(e.id not in (a.id, b.id) and a.end - QUIET <= e.start <= b.start + QUIET
                   for e in self.s.events):
                continue
            span = (a.end - min(a.duration, 8.0), b.start + min(b.duration, 4.0))
            out.append(lambda a=a, b=b, span=span: self.mcq(
                "order", f"What appears right after the {a.obj.name} leaves?", with_article(b.obj.name),
                [with_article(n) for n in self.other_names({a.obj.name, b.obj.name}, a.start - 30, b.end + 30)],
                span, [a, b], "order", key_info=f"the {a.obj.name} leaving"))
        return out

    def _attribute(self):
        brief, moving = [], []
        for e in self.s.events:
            if not self.unique(e):
                continue
            if e.duration <= 3.0:
                brief.append(lambda e=e: self.mcq(
                    "attribute", f"Where in the frame does the {e.obj.name} appear?", e.position,
                    [p for p in POSITIONS if p != e.position], (e.start, e.end), [e], "brief",
                    subtype="position", key_info=f"the {e.obj.name}"))
            elif 10 <= e.duration <= 40:
                others = [MOTION_TEXT[m] for m in MOTIONS if m != e.motion]
                self.rng.shuffle(others)
                moving.append(lambda e=e, others=others: self.mcq(
                    "attribute", f"Which way does the {e.obj.name} move?", MOTION_TEXT[e.motion], others,
                    (e.start, e.end), [e], "motion", subtype="motion", key_info=f"the {e.obj.name} moving"))
        return self.interleave(brief, moving)

    def _counting(self):
        out = []
        for name, evs in self.by_name.items():
            evs = sorted(evs, key=lambda e: e.start)
            if len(evs) < 2 or any(b.start - a.end < 5 for a, b in zip(evs, evs[1:])):
                continue
            if any(e.duration > 30 for e in evs):
                continue
            out.append(lambda name=name, evs=evs: self.question(
                "counting", f"How many times does {with_article(name)} appear?", str(len(evs)),
                (evs[0].start, evs[-1].end), evs, "count", dense=True, key_info=f"every {name}"))
        return out

    def _spatial(self):
        out = []
        evs = [e for e in self.s.events if self.unique(e)]
        for a in evs:
            for b in evs:
                if a.id == b.id or a.cell == b.cell:
                    continue
                lo, hi = max(a.start, b.start), min(a.end, b.end)
                if not 4 <= hi - lo <= 12:  # long overlaps would not need the right clip
                    continue
                (ra, ca), (rb, cb) = a.cell, b.cell
                if ra == rb:
                    rel = "left" if ca < cb else "right"
                elif ca == cb:
                    rel = "above" if ra < rb else "below"
                else:
                    continue  # diagonal: neither relation is clean
                if a.id > b.id:  # each unordered pair once; which one is the subject is random
                    continue
                out.append(lambda a=a, b=b, rel=rel, lo=lo, hi=hi: self.mcq(
                    "spatial", f"While both are visible, where is the {a.obj.name} relative to the "
                               f"{b.obj.name}?", RELATIONS[rel],
                    [v for k, v in RELATIONS.items() if k != rel], (lo, hi), [a, b], "spatial",
                    key_info=f"the {a.obj.name} and the {b.obj.name} together"))
        return out

    def _grounding(self):
        out = []
        for e in self.s.events:
            if self.unique(e) and 4 <= e.duration <= 12:
                out.append(lambda e=e: self.question(
                    "grounding", f"When does the {e.obj.name} appear? Give [start - end] in seconds.",
                    f"[{e.start:.1f} - {e.end:.1f}]", (e.start, e.end), [e], "grounding",
                    key_info=f"the {e.obj.name}"))
        return out

    def _open(self):
        late, bgs = [], []
        d = self.s.duration
        lw = late_window(d)
        for e in self.s.events:
            if not self.unique(e) or e.duration > 3.0:
                continue
            inside = [x for x in self.s.events if x.start >= d - lw and x.end <= d - 0.5]
            later_brief = [x for x in self.s.events if x.id != e.id and x.start > e.start - QUIET
                           and x.duration <= 8]
            if e.start >= d - lw and e.end <= d - 1 and not later_brief \
                    and all(x.id == e.id or x.duration > 8 for x in inside):
                late.append(lambda e=e: self.question(
                    "open", "Which object flashes briefly near the end of the video?", e.obj.name,
                    (d - lw, d), [e], "end", subtype="late_flash", time=max(0.0, d - 30),
                    key_info="a brief flash near the end"))
            scene = next((s for s in self.s.scenes if s.start + 1 <= e.start and e.end <= s.end - 1), None)
            if scene is not None:
                bgs.append(lambda e=e, scene=scene: self.question(
                    "open", f"What colour is the background when the {e.obj.name} appears?",
                    scene.background, (e.start, e.end), [e], "background", subtype="background",
                    key_info=f"the {e.obj.name}"))
        return self.interleave(late, bgs)
