"""Reading drills written from M1-Synth worlds: the lookups a student must make in its tools' output, one step at a
time and chained, with the answer a rule reads off the world's ground truth.

A drill is a prompt (what the student sees: described frames, tool notes, options, a question), a target (what it
should write next) and its family. The frames are described from the world's script in the words the synth vision
model uses (`a small red cross at the bottom left`), so no video is rendered and drills are fresh every step; held-out
drills come from worlds whose seeds training never draws (`split`).

Every lookup is written as a quote: the student first writes the key it looks for (copied from the question), then
the words that follow that key where the context holds it, so that finding a fact is continuing a text already seen
(what induction heads do) rather than jumping to it.

Single steps (each supervised on its own):
- `find`:    described frames + an object -> ` red cross at the bottom left` (its caption, quoted)
- `option`:  options + a value -> its letter
- `clock`:   a clock time -> seconds
- `at_time`: described frames + a time in seconds -> ` 78.8s>[a small red cross at the top left] -> red`
- `span`:    agents' grounding notes + an object -> the note's sentence about it, ending with its span

Chains (the evaluated families; `steps=True` writes each step before the answer, `False` the answer alone):
- `attribute`: find -> option            (` red cross at the bottom left -> C`)
- `timestamp`: clock -> at_time -> option (` 78 -> 78.8s>[a small red cross at the top left] -> red -> B`)
- `grounding`: span                       (` The red cross is seen from 00:59 to 01:11. ##Timestamp: [59.2 - 71.4]`)

A drill's `answer` is what is graded: the target always ends with it.
"""
from __future__ import annotations

import random
from dataclasses import dataclass

from m1.evidence import Evidence, TextBuilder
from m1.registry import GROUNDING_TOOL
from m1.synth.world import CELLS, COLOURS, Script, fmt_time, make_script

LETTERS = "ABCD"
POSITIONS = list(CELLS.values())
SINGLE = ("find", "option", "clock", "at_time", "span")
CHAINS = ("attribute", "timestamp", "grounding")
FAMILIES = SINGLE + CHAINS
AGENT_TAGS = ("[qwen3_big]", "[qwen3_small]", "[qwen2_big]", "[qwen2_small]")
# world seeds: training draws below HELD_OUT_SEED; the held-out worlds (the record's accuracy) lie in
# [HELD_OUT_SEED, DEV_SEED), the dev worlds (evaluations during training, where settings are chosen) at DEV_SEED and above
HELD_OUT_SEED = 10 ** 6
DEV_SEED = 2 * 10 ** 6
SPLITS = {"train": 0, "held_out": HELD_OUT_SEED, "dev": DEV_SEED}


@dataclass(frozen=True)
class Drill:
    family: str
    prompt: str
    target: str  # what follows the prompt, starting with a space
    answer: str  # the part of the target that is graded (the last step)
    # where the target's stretches are read from, in characters of prompt + target (m1/evidence.py)
    evidence: tuple[Evidence, ...] = ()


def glance(script: Script, rng: random.Random, frames: int) -> list[tuple[float, list[tuple[str, str, str]]]]:
    """`frames` evenly spaced frames over a random window of the video: (time, [(size, name, position)])."""
    span = min(script.duration, frames * rng.choice((2.0, 4.0, 8.0)))
    start = rng.uniform(0.0, script.duration - span)
    step = span / frames
    out = []
    for k in range(frames):
        t = round(start + (k + 0.5) * step, 1)
        out.append((t, [(v.event.obj.size, v.event.obj.name, v.event.position) for v in script.visible_at(t)]))
    return out


@dataclass
class Described:
    """Where a described glance put things: per frame its quote (` 78.8s>[...]`), and per object the stretch
    ` red cross at the bottom left` of each caption naming it, and that caption's colour word (` red`)."""

    quotes: list[tuple[int, int]]
    places: dict[str, list[tuple[int, int]]]
    colours: list[tuple[int, int] | None]  # the colour word of a frame with one shape


def describe(frames, text: TextBuilder | None = None) -> str:
    """The frames as a text student reads them (the seed kinds' described glance); with `text`, written onto it and
    its spans kept in `text.described`."""
    out = text or TextBuilder()
    where = Described([], {}, [])
    base = len(out.text)
    for k, (t, things) in enumerate(frames):
        out.add(f"<frame {k} at")
        q0 = out.add(f" {t:.1f}s>[")[0]
        colour = None
        for j, (size, name, pos) in enumerate(things):
            out.add(("; " if j else "") + f"a {size}")
            c = out.add(f" {name.split()[0]}")
            rest = out.add(f" {' '.join(name.split()[1:])} at the {pos}".replace("  ", " "))
            where.places.setdefault(name, []).append((c[0], rest[1]))
            colour = c if len(things) == 1 else None
        if not things:
            out.add("only the background")
        where.quotes.append((q0, out.add("]")[1]))
        where.colours.append(colour)
    out.described = where  # type: ignore[attr-defined]
    return out.text[base:]


def _options(right: str, pool: list[str], rng: random.Random, text: TextBuilder | None = None
             ) -> tuple[str, str, tuple[int, int]]:
    """Four options holding `right` (shuffled) as text, the right letter and (with `text`, written onto it) where
    the right option's value sits."""
    opts = [right] + rng.sample([p for p in pool if p != right], 3)
    rng.shuffle(opts)
    out = text or TextBuilder()
    base, value = len(out.text), (0, 0)
    for i, o in enumerate(opts):
        out.add(("\n" if i else "") + f"{LETTERS[i]}:")
        span = out.add(f" {o}")
        if o == right:
            value = span
    return out.text[base:], LETTERS[opts.index(right)], value


def _seconds(t: float) -> int:
    """The whole seconds a clock time names for a frame shown at t (mm:ss truncates, as the questions do)."""
    return int(t)


def _where(frames) -> dict[str, set[str]]:
    where: dict[str, set[str]] = {}
    for _, things in frames:
        for _, name, pos in things:
            where.setdefault(name, set()).add(pos)
    return where


def _single_times(frames) -> list[tuple[float, str]]:
    """(time, colour) of frames with exactly one shape, whose whole second no other frame shares."""
    seconds = [_seconds(t) for t, _ in frames]
    return [(t, things[0][1].split()[0]) for t, things in frames
            if len(things) == 1 and seconds.count(_seconds(t)) == 1]


def make_drill(family: str, script: Script, rng: random.Random, frames: int = 16, steps: bool = False
               ) -> Drill | None:
    """One drill of `family` from `script`, or None when the glance drawn cannot carry it (draw again). The drill
    carries its evidence: each stretch of the target it quotes or reads points at the context that holds it."""
    p = TextBuilder()
    if family == "clock":
        return _clock_drill(script, rng, p)
    if family == "option":
        return _option_drill(rng, p)
    if family in ("span", "grounding"):
        return _span(family, script, rng, steps)
    seen = glance(script, rng, frames)
    describe(seen, p)
    if family in ("find", "attribute"):
        return _place_drill(family, seen, rng, p, steps)
    return _timed_drill(family, seen, rng, p, steps)


def _clock_drill(script: Script, rng: random.Random, p: TextBuilder) -> Drill:
    """A clock time read as seconds."""
    t = rng.randrange(0, int(script.duration))
    p.add("Clock time ")
    clock = p.add(fmt_time(t))
    p.add(" in seconds:")
    return _finish("clock", p, [(f" {t}", [clock], False)])


def _option_drill(rng: random.Random, p: TextBuilder) -> Drill:
    """The letter of the option that says a given value."""
    colours = list(COLOURS)
    value = rng.choice(POSITIONS + colours)
    p.add("Options:\n")
    _, letter, at = _options(value, POSITIONS if value in POSITIONS else colours, rng, p)
    p.add(f"\nWhich option says {value}?\n<answer>")
    return _finish("option", p, [(f" {letter}", [at], False)])


def _place_drill(family: str, seen, rng: random.Random, p: TextBuilder, steps: bool) -> Drill | None:
    """`find`: where a shape seen in one place is; `attribute`: the same as a multiple-choice question (with
    `steps`, quoting where it was seen first)."""
    spans: Described = p.described  # type: ignore[attr-defined]
    names = [n for n, ps in _where(seen).items() if len(ps) == 1]
    if not names:
        return None
    name = rng.choice(names)
    pos = next(iter(_where(seen)[name]))
    quote = (f" {name} at the {pos}", spans.places[name], True)
    if family == "find":
        p.add(f"\nWhere is the {name}?")
        return _finish(family, p, [quote], answer=f" {pos}")
    p.add(f"\nQuestion: Where in the frame does the {name} appear?\nOptions:\n")
    _, letter, at = _options(pos, POSITIONS, rng, p)
    p.add("\n<answer>")
    return _finish(family, p, [quote, (" ->", [], False), (f" {letter}", [at], False)] if steps else
                   [(f" {letter}", [at], False)])


def _timed_drill(family: str, seen, rng: random.Random, p: TextBuilder, steps: bool) -> Drill | None:
    """`at_time`: the colour of the shape shown at a time, quoting that frame; otherwise the same as a
    multiple-choice question (with `steps`: the time, the frame quoted, its colour, then the letter)."""
    spans: Described = p.described  # type: ignore[attr-defined]
    cands = _single_times(seen)
    if not cands:
        return None
    t, colour = rng.choice(cands)
    k = [ft for ft, _ in seen].index(t)
    q0, q1 = spans.quotes[k]
    frame = p.text[q0:q1]  # ` 78.8s>[a small red cross at the top left]`
    c0, c1 = spans.colours[k]  # the colour word inside it, read back out of the quote once written
    if family == "at_time":
        p.add(f"\nWhat is shown at {_seconds(t)} seconds?")
        return _finish(family, p, [(frame, [(q0, q1)], True), (" ->", [], False),
                                   (f" {colour}", [("piece", 0, c0 - q0, c1 - q0)], True)])
    p.add("\nQuestion: What colour is the shape that appears at ")
    clock = p.add(fmt_time(_seconds(t)))
    p.add("?\nOptions:\n")
    _, letter, at = _options(colour, list(COLOURS), rng, p)
    p.add("\n<answer>")
    if not steps:
        return _finish(family, p, [(f" {letter}", [at], False)])
    return _finish(family, p, [(f" {_seconds(t)}", [clock], False), (" ->", [], False),
                               (frame, [(q0, q1)], True), (" ->", [], False),
                               (f" {colour}", [("piece", 2, c0 - q0, c1 - q0)], True), (" ->", [], False),
                               (f" {letter}", [at], False)])


def _finish(family: str, prompt: TextBuilder, pieces: list[tuple[str, list, bool]], answer: str | None = None
            ) -> Drill:
    """The drill whose target is `pieces` written in order: (text, its sources, copied?). A source is a character
    span of the prompt, or ("piece", j, a, b): characters a..b of piece j of this target (a word read back out of a
    quote just written). A copied piece is its sources' text exactly."""
    text, evidence, at = TextBuilder(prompt.text), [], []
    for piece, sources, copy in pieces:
        start, end = text.add(piece)
        at.append(start)
        spans = tuple((at[s[1]] + s[2], at[s[1]] + s[3]) if s[0] == "piece" else s for s in sources)
        if copy and any(text.text[a:b] != piece for a, b in spans):
            raise AssertionError(f"a {family} drill quotes {piece!r} from a source that holds other text")
        if spans:
            evidence.append(Evidence(start, end, spans, copy))
    return Drill(family, prompt.text, text.text[len(prompt.text):], answer or pieces[-1][0], tuple(evidence))


def _span(family: str, script: Script, rng: random.Random, steps: bool) -> Drill | None:
    """Agents' grounding notes, one per object (2-4 of the world's objects), and the span to copy for one of them."""
    by_name: dict[str, list] = {}
    for e in script.events:
        by_name.setdefault(e.obj.name, []).append(e)
    names = [n for n, es in by_name.items() if len(es) == 1]
    if len(names) < 2:
        return None
    picked = rng.sample(names, min(len(names), rng.randint(2, 4)))
    notes = []
    for name in picked:
        e = by_name[name][0]
        s, t = round(max(0.0, e.start - rng.uniform(0, 1)), 1), round(e.end + rng.uniform(0, 1), 1)
        notes.append((name, f"[{s:.1f} - {t:.1f}]", rng.choice(AGENT_TAGS), fmt_time(e.start), fmt_time(e.end)))
    which = rng.randrange(len(notes))
    p, spans = TextBuilder(), []
    for i, (name, span, tag, a, b) in enumerate(notes):
        p.add(("\n" if i else "") + f"{tag} {GROUNDING_TOOL.name}:")
        body = p.add(f" The {name} is seen from {a} to {b}. ##Timestamp: ")
        spans.append((body[0], p.add(span)[1]))
    name, span = notes[which][0], notes[which][1]
    question = "When is the {} on screen?" if family == "grounding" else "Which span was written for the {}?"
    p.add(f"\nQuestion: {question.format(name)}\n<answer>")
    s0, s1 = spans[which]
    quote = p.text[s0:s1]  # ` The red cross is seen from ... ##Timestamp: [a - b]`
    if family == "span" or steps:
        return _finish(family, p, [(quote, [(s0, s1)], True)], answer=f" {span}")
    return _finish(family, p, [(f" {span}", [(s1 - len(span) - 1, s1)], True)])


class DrillSource:
    """Fresh drills of the chosen families from worlds drawn at random (`split` "train", "dev" or "held_out"), with
    a small cache of scripts (writing one costs a few milliseconds)."""

    def __init__(self, split: str, seed: int, duration: float = 120.0, worlds: int = 400):
        if split not in SPLITS:
            raise ValueError(f"drill split must be one of {list(SPLITS)}, got {split!r}")
        self.rng = random.Random(seed)
        base = SPLITS[split]
        self.seeds = [base + self.rng.randrange(HELD_OUT_SEED) for _ in range(worlds)]
        self.duration = duration
        self._scripts: dict[int, Script] = {}

    def script(self) -> Script:
        seed = self.rng.choice(self.seeds)
        if seed not in self._scripts:
            self._scripts[seed] = make_script(seed, duration=self.duration)
        return self._scripts[seed]

    def draw(self, family: str, frames: int = 16, steps: bool = False) -> Drill:
        for _ in range(100):
            d = make_drill(family, self.script(), self.rng, frames, steps)
            if d is not None:
                return d
        raise RuntimeError(f"no world of {self.duration:.0f} s carried a {family!r} drill in 100 draws")
