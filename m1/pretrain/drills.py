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

from m1.registry import GROUNDING_TOOL
from m1.synth.world import CELLS, COLOURS, Script, fmt_time, make_script

LETTERS = "ABCD"
POSITIONS = list(CELLS.values())
SINGLE = ("find", "option", "clock", "at_time", "span")
CHAINS = ("attribute", "timestamp", "grounding")
FAMILIES = SINGLE + CHAINS
AGENT_TAGS = ("[qwen3_big]", "[qwen3_small]", "[qwen2_big]", "[qwen2_small]")
# world seeds: training draws below HELD_OUT_SEED, evaluation at and above it
HELD_OUT_SEED = 10 ** 6


@dataclass(frozen=True)
class Drill:
    family: str
    prompt: str
    target: str  # what follows the prompt, starting with a space
    answer: str  # the part of the target that is graded (the last step)


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


def describe(frames) -> str:
    """The frames as a text student reads them (the seed kinds' described glance)."""
    parts = []
    for k, (t, things) in enumerate(frames):
        cap = "; ".join(f"a {size} {name} at the {pos}" for size, name, pos in things) or "only the background"
        parts.append(f"<frame {k} at {t:.1f}s>[{cap}]")
    return "".join(parts)


def _options(right: str, pool: list[str], rng: random.Random) -> tuple[str, str]:
    """Four options holding `right` (shuffled) as text, and the right letter."""
    opts = [right] + rng.sample([p for p in pool if p != right], 3)
    rng.shuffle(opts)
    return "\n".join(f"{LETTERS[i]}: {o}" for i, o in enumerate(opts)), LETTERS[opts.index(right)]


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
    """One drill of `family` from `script`, or None when the glance drawn cannot carry it (draw again)."""
    colours = list(COLOURS)
    if family == "clock":
        t = rng.randrange(0, int(script.duration))
        return Drill(family, f"Clock time {fmt_time(t)} in seconds:", f" {t}", f" {t}")
    if family == "option":
        value = rng.choice(POSITIONS + colours)
        opts, letter = _options(value, POSITIONS if value in POSITIONS else colours, rng)
        return Drill(family, f"Options:\n{opts}\nWhich option says {value}?\n<answer>", f" {letter}", f" {letter}")
    if family in ("span", "grounding"):
        return _span(family, script, rng, steps)
    seen = glance(script, rng, frames)
    body = describe(seen)
    if family in ("find", "attribute"):
        names = [n for n, ps in _where(seen).items() if len(ps) == 1]
        if not names:
            return None
        name = rng.choice(names)
        pos = next(iter(_where(seen)[name]))
        if family == "find":
            return Drill(family, f"{body}\nWhere is the {name}?", f" {name} at the {pos}", f" {pos}")
        opts, letter = _options(pos, POSITIONS, rng)
        head = f"{body}\nQuestion: Where in the frame does the {name} appear?\nOptions:\n{opts}\n<answer>"
        return Drill(family, head, f" {name} at the {pos} -> {letter}" if steps else f" {letter}", f" {letter}")
    cands = _single_times(seen)
    if not cands:
        return None
    t, colour = rng.choice(cands)
    frame = next(f"{t:.1f}s>[{describe([(t, things)]).split('>[', 1)[1]}" for ft, things in seen if ft == t)
    if family == "at_time":
        return Drill(family, f"{body}\nWhat is shown at {_seconds(t)} seconds?", f" {frame} -> {colour}",
                     f" {colour}")
    opts, letter = _options(colour, colours, rng)
    head = f"{body}\nQuestion: What colour is the shape that appears at {fmt_time(_seconds(t))}?\nOptions:\n{opts}\n<answer>"
    return Drill(family, head, f" {_seconds(t)} -> {frame} -> {colour} -> {letter}" if steps else f" {letter}",
                 f" {letter}")


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
        notes.append((name, f"[{s:.1f} - {t:.1f}]",
                      f"{rng.choice(AGENT_TAGS)} {GROUNDING_TOOL.name}: The {name} is seen from {fmt_time(e.start)} to "
                      f"{fmt_time(e.end)}. ##Timestamp: [{s:.1f} - {t:.1f}]"))
    name, span, note = rng.choice(notes)
    body = "\n".join(n for _, _, n in notes)
    question = "When is the {} on screen?" if family == "grounding" else "Which span was written for the {}?"
    prompt = f"{body}\nQuestion: {question.format(name)}\n<answer>"
    quote = " " + note.split(f"{GROUNDING_TOOL.name}: ", 1)[1]  # ` The red cross is seen from ... ##Timestamp: [a - b]`
    return Drill(family, prompt, quote if family == "span" or steps else f" {span}", f" {span}")


class DrillSource:
    """Fresh drills of the chosen families from worlds drawn at random (`split` "train" or "held_out"), with a small
    cache of scripts (writing one costs a few milliseconds)."""

    def __init__(self, split: str, seed: int, duration: float = 120.0, worlds: int = 400):
        if split not in ("train", "held_out"):
            raise ValueError(f"drill split must be 'train' or 'held_out', got {split!r}")
        self.rng = random.Random(seed)
        base = HELD_OUT_SEED if split == "held_out" else 0
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


def rule_answer(drill: Drill) -> str:
    """What a hand-written reader answers: the check that the drills are answerable from their prompts alone."""
    import re

    p = drill.prompt
    if drill.family == "clock":
        m, s = re.search(r"(\d\d):(\d\d)", p).groups()
        return f" {int(m) * 60 + int(s)}"
    opts = dict(re.findall(r"^([ABCD]): (.+)$", p, re.M))
    pick = (lambda v: " " + next(k for k, o in opts.items() if o == v))
    if drill.family == "option":
        return pick(re.search(r"Which option says (.+)\?", p).group(1))
    if drill.family in ("span", "grounding"):
        name = re.search(r"(?:When is the|written for the) (.+?)(?: on screen)?\?", p).group(1)
        return " " + re.search(rf"The {name} is seen .*?##Timestamp: (\[[^\]]+\])", p).group(1)
    frames = re.findall(r"<frame \d+ at ([\d.]+)s>\[([^\]]*)\]", p)
    if drill.family in ("find", "attribute"):
        name = re.search(r"Where (?:is|in the frame does) the (\w+ \w+)", p).group(1)
        pos = next(re.search(rf"{name} at the (\w+ \w+)", cap).group(1) for _, cap in frames if name in cap)
        return f" {pos}" if drill.family == "find" else pick(pos)
    if drill.family == "at_time":
        sec = int(re.search(r"at (\d+) seconds", p).group(1))
    else:
        m, s = re.search(r"appears at (\d\d):(\d\d)", p).groups()
        sec = int(m) * 60 + int(s)
    cap = next(cap for t, cap in frames if int(float(t)) == sec)
    colour = re.search(r"an? \w+ (\w+) ", cap).group(1)
    return f" {colour}" if drill.family == "at_time" else pick(colour)
