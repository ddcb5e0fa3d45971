"""M1-Synth world: a seeded script of coloured shapes on changing backgrounds.

The script is the single source of truth: the renderer draws `Script.visible_at(t)` and the
question generator reads the same records, so a question's answer is exactly what is on screen.

Layout: the frame is split into four quadrant cells. Each cell shows at most one object at a
time and an object moves only inside its cell, so objects never overlap and every detection is
clean. Events are placed so that key moments are separated in time (no two objects appear within a
few seconds of each other), which keeps "what appears at 02:15" and "what appears right after X"
unambiguous. Some events are planted for question families (spatial pairs, order pairs, repeated
flashes, a late flash ...) with object identities reserved so they are unique in the video.
"""
from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

# Well separated, saturated object colours (RGB); every object pixel is far from every background
# and every object colour is far from the others.
# Backgrounds are dark (luma <= 50) and objects bright (luma >= 110): the luma edge is sharp,
# which matters because H.264 keeps chroma at half resolution and blurs colour-only edges.
COLOURS: dict[str, tuple[int, int, int]] = {
    "red": (240, 60, 60),
    "orange": (255, 140, 0),
    "yellow": (240, 240, 60),
    "green": (50, 210, 80),
    "cyan": (40, 210, 220),
    "blue": (70, 110, 255),
    "purple": (180, 90, 240),
    "white": (245, 245, 245),
}
BACKGROUNDS: dict[str, tuple[int, int, int]] = {
    "black": (15, 15, 15),
    "grey": (50, 50, 50),
    "navy": (15, 25, 70),
    "maroon": (70, 15, 20),
    "forest": (15, 55, 25),
}
SHAPES = ("square", "circle", "triangle", "cross")
SIZES: dict[str, float] = {"small": 0.12, "medium": 0.17, "large": 0.23}  # side / min(W, H)
MOTIONS = ("still", "left", "right", "up", "down")
CELLS: dict[tuple[int, int], str] = {(0, 0): "top left", (0, 1): "top right",
                                     (1, 0): "bottom left", (1, 1): "bottom right"}

Shape = Literal["square", "circle", "triangle", "cross"]
Colour = Literal["red", "orange", "yellow", "green", "cyan", "blue", "purple", "white"]
Background = Literal["black", "grey", "navy", "maroon", "forest"]
Size = Literal["small", "medium", "large"]
Motion = Literal["still", "left", "right", "up", "down"]

# Duration classes (seconds). Medium events are long enough that a browser sampling every ~2 s
# never mistakes them for a flash; "short" is only used for timestamp targets.
FLASH = (1.0, 3.0)
SHORT = (5.0, 8.0)
MEDIUM = (8.0, 25.0)
GROUNDING = (5.0, 10.0)  # short enough that 16 frames over a long video cannot place it
START_GAP = 4.5  # two events never start closer than this
END_GAP = 2.5  # an event never starts this close to another's end (unless planted as a pair)
CELL_PAD = 1.0  # idle time in a cell between two of its events
STEP = 0.5  # event times are multiples of this


class _Rec(BaseModel):
    model_config = ConfigDict(extra="forbid")


class Obj(_Rec):
    shape: Shape
    colour: Colour
    size: Size

    @property
    def name(self) -> str:
        """How questions refer to the object: colour and shape ("red square")."""
        return f"{self.colour} {self.shape}"


class Event(_Rec):
    """One object on screen during [start, end), moving in a straight line inside its cell.

    `path` holds the top-left corner of the object's box (pixels) at `start` and at `end`.
    `role` says what the event was planted for ("" for filler); ground truth never relies on it.
    """

    id: int
    obj: Obj
    start: float
    end: float
    cell: tuple[int, int]
    motion: Motion
    path: tuple[tuple[float, float], tuple[float, float]]
    role: str = ""

    @model_validator(mode="after")
    def _check(self) -> Event:
        if not self.end > self.start >= 0:
            raise ValueError(f"event {self.id}: need 0 <= start < end, got [{self.start}, {self.end})")
        if self.cell not in CELLS:
            raise ValueError(f"event {self.id}: cell {self.cell} is not one of {list(CELLS)}")
        return self

    @property
    def duration(self) -> float:
        return self.end - self.start

    @property
    def position(self) -> str:
        return CELLS[self.cell]

    def corner_at(self, t: float) -> tuple[int, int]:
        (x0, y0), (x1, y1) = self.path
        f = min(1.0, max(0.0, (t - self.start) / self.duration))
        return int(round(x0 + (x1 - x0) * f)), int(round(y0 + (y1 - y0) * f))


class Scene(_Rec):
    start: float
    end: float
    background: Background


@dataclass(frozen=True)
class Visible:
    """An object on screen at some time: its event and its box [x0, x1) x [y0, y1) in pixels."""

    event: Event
    box: tuple[int, int, int, int]  # x0, y0, x1, y1

    @property
    def centre(self) -> tuple[float, float]:
        x0, y0, x1, y1 = self.box
        return (x0 + x1) / 2, (y0 + y1) / 2


class Script(_Rec):
    seed: int
    duration: float
    fps: int
    width: int
    height: int
    scenes: list[Scene]
    events: list[Event] = Field(default_factory=list)

    @model_validator(mode="after")
    def _check(self) -> Script:
        if not self.scenes or self.scenes[0].start != 0 or self.scenes[-1].end != self.duration:
            raise ValueError("scenes must cover [0, duration] from the first to the last")
        for a, b in zip(self.scenes, self.scenes[1:]):
            if a.end != b.start:
                raise ValueError(f"scenes must be contiguous: {a.end} != {b.start}")
        for e in self.events:
            if e.end > self.duration:
                raise ValueError(f"event {e.id} ends at {e.end} after the video ({self.duration} s)")
            side = size_px(e.obj.size, self.width, self.height)
            for x, y in e.path:
                x0, y0, x1, y1 = cell_bounds(e.cell, self.width, self.height)
                if not (x0 <= round(x) and round(x) + side <= x1 and y0 <= round(y) and round(y) + side <= y1):
                    raise ValueError(f"event {e.id}: box at ({x}, {y}) size {side} leaves cell {e.cell}")
        return self

    @property
    def num_frames(self) -> int:
        return int(round(self.duration * self.fps))

    def frame_time(self, i: int) -> float:
        """Frame i is on screen during [i/fps, (i+1)/fps); it shows the world at i/fps."""
        return i / self.fps

    def background_at(self, t: float) -> str:
        for s in self.scenes:
            if s.start <= t < s.end:
                return s.background
        return self.scenes[-1].background

    def visible_at(self, t: float) -> list[Visible]:
        """Objects on screen at time t with their boxes, in event-id order."""
        out = []
        for e in self.events:
            if e.start <= t < e.end:
                x, y = e.corner_at(t)
                side = size_px(e.obj.size, self.width, self.height)
                out.append(Visible(e, (x, y, x + side, y + side)))
        return out

    def to_json(self) -> str:
        return json.dumps(self.model_dump(mode="json"), indent=1, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> Script:
        return cls.model_validate_json(text)

    @classmethod
    def load(cls, path: str | Path) -> Script:
        try:
            return cls.from_json(Path(path).read_text())
        except ValueError as exc:
            raise ValueError(f"{path}: not a valid M1-Synth script: {exc}") from exc


def size_px(size: str, width: int, height: int) -> int:
    return max(6, int(round(SIZES[size] * min(width, height))))


def cell_margin(width: int, height: int) -> int:
    return max(2, int(round(0.03 * min(width, height))))


def cell_bounds(cell: tuple[int, int], width: int, height: int) -> tuple[int, int, int, int]:
    """Inner box [x0, x1) x [y0, y1) of a quadrant cell; the margin keeps cells apart."""
    r, c = cell
    m = cell_margin(width, height)
    cw, ch = width // 2, height // 2
    return c * cw + m, r * ch + m, (c + 1) * cw - m, (r + 1) * ch - m


def fmt_time(t: float) -> str:
    """Seconds as mm:ss (minutes may exceed 59)."""
    s = int(round(t))
    return f"{s // 60:02d}:{s % 60:02d}"


# --------------------------------------------------------------------------------------------
# script generation


@dataclass
class _Slot:
    """An event being placed; its object identity is chosen at the end (see _assign_objects)."""

    start: float
    end: float
    cell: tuple[int, int]
    size: str
    motion: str
    path: tuple[tuple[float, float], tuple[float, float]]
    role: str
    identity: str  # "unique" | "count" | "common"
    group: int = -1  # slots of one counting group share an object


class _Builder:
    def __init__(self, rng: random.Random, duration: float, width: int, height: int):
        self.rng, self.duration, self.width, self.height = rng, duration, width, height
        self.slots: list[_Slot] = []
        self.protected: list[tuple[float, float, int]] = []  # windows where no other event may start

    def q(self, t: float) -> float:
        return round(t / STEP) * STEP

    def uniform(self, lo: float, hi: float) -> float:
        return self.q(self.rng.uniform(lo, hi))

    def cell_free(self, cell: tuple[int, int], start: float, end: float) -> bool:
        return all(s.cell != cell or s.end + CELL_PAD <= start or end + CELL_PAD <= s.start
                   for s in self.slots)

    def start_ok(self, start: float, end: float, partners: tuple[int, ...] = ()) -> bool:
        if start < 0 or end > self.duration:
            return False
        for i, s in enumerate(self.slots):
            if i in partners:
                continue
            if abs(s.start - start) < START_GAP or abs(s.end - start) < END_GAP \
                    or abs(s.start - end) < END_GAP:
                return False
        return all(not (lo <= start <= hi) or owner in partners for lo, hi, owner in self.protected)

    def path_for(self, cell: tuple[int, int], size: str, motion: str):
        x0, y0, x1, y1 = cell_bounds(cell, self.width, self.height)
        side = size_px(size, self.width, self.height)
        xs, ys = (x0, x1 - side), (y0, y1 - side)
        rx, ry = self.rng.randint(*xs), self.rng.randint(*ys)
        if motion == "right":
            return (xs[0], ry), (xs[1], ry)
        if motion == "left":
            return (xs[1], ry), (xs[0], ry)
        if motion == "down":
            return (rx, ys[0]), (rx, ys[1])
        if motion == "up":
            return (rx, ys[1]), (rx, ys[0])
        return (rx, ry), (rx, ry)

    def place(self, duration: tuple[float, float] | float, role: str, identity: str,
              window: tuple[float, float] | None = None, cells=None, motion: str | None = None,
              partners: tuple[int, ...] = (), start: float | None = None, tries: int = 200,
              group: int = -1) -> int | None:
        """Place one event; returns its slot index, or None when no legal place was found."""
        lo, hi = window if window is not None else (0.0, self.duration)
        for _ in range(tries):
            d = duration if isinstance(duration, float) else self.uniform(*duration)
            d = max(STEP * 2, d)
            s = start if start is not None else self.uniform(lo, max(lo, hi - d))
            e = self.q(s + d)
            cell = self.rng.choice(cells or list(CELLS))
            if not (self.cell_free(cell, s, e) and self.start_ok(s, e, partners)):
                continue
            size = self.rng.choice(list(SIZES))
            mot = motion or self.rng.choice(MOTIONS)
            self.slots.append(_Slot(s, e, cell, size, mot, self.path_for(cell, size, mot), role,
                                    identity, group))
            return len(self.slots) - 1
        return None

    def drop(self, index: int | None) -> None:
        if index is not None:
            self.slots.pop(index)
            self.protected = [(lo, hi, o) for lo, hi, o in self.protected if o != index]


def _make_scenes(rng: random.Random, duration: float) -> list[Scene]:
    n = max(2, int(round(duration / 75)))
    cuts = sorted(rng.sample(range(1, n * 4), n - 1))
    bounds = [0.0] + [round(duration * c / (n * 4) / STEP) * STEP for c in cuts] + [duration]
    names = list(BACKGROUNDS)
    scenes, prev = [], None
    for a, b in zip(bounds, bounds[1:]):
        bg = rng.choice([x for x in names if x != prev])
        scenes.append(Scene(start=a, end=b, background=bg))
        prev = bg
    return scenes


def make_script(seed: int, duration: float = 300.0, fps: int = 4, width: int = 128, height: int = 128,
                sets: int | None = None, fillers: int | None = None) -> Script:
    """Build a random but reproducible world: the same arguments always give the same script.

    `sets` is how many groups of planted question targets to place (default: one per 2.5 min,
    at most 3); `fillers` how many extra random events (default: one per 12 s).
    """
    _check_world_size(duration, fps, width, height)
    duration = float(round(duration / STEP) * STEP)
    rng = random.Random(seed)
    scenes = _make_scenes(rng, duration)
    b = _Builder(rng, duration, width, height)
    n_sets = sets if sets is not None else min(3, max(1, int(round(duration / 150))))
    body = _plant_late_flash(b, duration)
    medium = (MEDIUM[0], max(12.0, min(MEDIUM[1], duration / 5)))
    for group in range(n_sets):
        _plant_set(b, rng, scenes, body, medium, group)
    _add_long_and_fillers(b, rng, duration, medium, fillers)
    events = _assign_objects(rng, b.slots)
    return Script(seed=seed, duration=duration, fps=fps, width=width, height=height, scenes=scenes,
                  events=events)


def _check_world_size(duration: float, fps: int, width: int, height: int) -> None:
    if not 30 <= duration <= 1200:
        raise ValueError(f"duration must be in [30, 1200] seconds, got {duration}")
    if fps < 2:
        raise ValueError(f"fps must be >= 2, got {fps}")
    if width < 128 or height < 128 or width % 2 or height % 2:
        raise ValueError(f"size must be even and >= 128x128, got {width}x{height}")


def _plant_late_flash(b: _Builder, duration: float) -> float:
    """The late flash, the only event starting in the last part of the video; returns where the body before that
    part ends (the other planted targets stay within it)."""
    late = min(60.0, duration / 4)
    i = b.place(FLASH, "late_flash", "unique", window=(duration - min(30.0, late / 2), duration - 3),
                motion="still")
    if i is not None:
        b.protected.append((duration - late, duration, i))
    return duration - late - 2


def _plant_set(b: _Builder, rng: random.Random, scenes: list[Scene], body: float, medium: tuple[float, float],
               group: int) -> None:
    """One group of planted question targets, one per family, placed in a shuffled order (so that short videos,
    which cannot hold every vignette, still cover all families across seeds)."""

    def timestamp() -> None:
        t = b.place(SHORT, "timestamp", "common", window=(8.0, body))
        if t is not None:
            b.protected.append((b.slots[t].start - 6, b.slots[t].start + 6, t))

    def counting(group: int) -> None:
        k = rng.randint(2, 5)
        width_k = body / k
        for j in range(k):
            b.place(FLASH, "counting", "count", window=(j * width_k + 1, (j + 1) * width_k - 1),
                    motion="still", group=group)

    plants = [lambda: _plant_spatial(b, body), lambda: _plant_order(b, body, medium), timestamp,
              lambda: b.place(GROUNDING, "grounding", "unique", window=(2.0, body)),
              lambda: b.place(FLASH, "attribute_position", "unique", window=(2.0, body),
                              motion="still"),
              lambda: b.place((10.0, max(12.0, medium[1])), "attribute_motion", "unique",
                              window=(2.0, body)),
              lambda: _plant_in_scene(b, scenes, body),
              lambda g=group: counting(g)]
    rng.shuffle(plants)
    for plant in plants:
        plant()


def _add_long_and_fillers(b: _Builder, rng: random.Random, duration: float, medium: tuple[float, float],
                          fillers: int | None) -> None:
    """Long events anywhere, then `fillers` random ones (default: one per 12 s)."""
    n_long = max(1, int(round(duration / 200)))
    long_hi = max(40.0, min(240.0, duration / 3))
    for _ in range(n_long):
        b.place((min(40.0, long_hi), long_hi), "long", "common", window=(0.0, duration))
    for _ in range(fillers if fillers is not None else int(duration / 12)):
        dur = FLASH if rng.random() < 0.45 else medium
        b.place(dur, "filler", "common", window=(0.0, duration), tries=40)


def _plant_spatial(b: _Builder, body: float) -> None:
    """Two objects in the same row (left/right) or column (above/below), overlapping >= 5 s."""
    pairs = [((0, 0), (0, 1)), ((1, 0), (1, 1)), ((0, 0), (1, 0)), ((0, 1), (1, 1))]
    for _ in range(50):
        c1, c2 = b.rng.choice(pairs)
        if b.rng.random() < 0.5:
            c1, c2 = c2, c1
        i = b.place((14.0, 25.0), "spatial", "unique", window=(2.0, body), cells=[c1], tries=20)
        if i is None:
            continue
        s1, e1 = b.slots[i].start, b.slots[i].end
        # a short overlap: a plan has to find the right moment to see both at once
        j = b.place((8.0, 20.0), "spatial", "unique", cells=[c2], partners=(i,), tries=20,
                    start=max(s1 + START_GAP, e1 - b.uniform(5.0, 10.0)))
        if j is not None and b.slots[j].end <= body:
            return
        b.drop(j)
        b.drop(i)


def _plant_order(b: _Builder, body: float, medium: tuple[float, float]) -> None:
    """A (unique) leaves, then B appears 1-4 s later; nothing else starts near that moment."""
    for _ in range(50):
        i = b.place((8.0, 20.0), "order_ref", "unique", window=(2.0, body - 10), tries=20)
        if i is None:
            continue
        end = b.slots[i].end
        gap = b.uniform(1.0, 4.0)
        dur = FLASH if b.rng.random() < 0.3 else medium
        j = b.place(dur, "order_next", "common", start=end + gap, partners=(i,), tries=20)
        if j is not None:
            b.protected.append((end - 6, end + gap + 6, i))
            b.protected.append((end - 6, end + gap + 6, j))
            return
        b.drop(i)


def _plant_in_scene(b: _Builder, scenes: list[Scene], body: float) -> None:
    """A unique flash well inside one scene, for the background question."""
    inner = [s for s in scenes if min(s.end, body) - s.start >= 8]
    if not inner:
        return
    s = b.rng.choice(inner)
    b.place(FLASH, "background", "unique", window=(s.start + 2, min(s.end, body) - 2), motion="still")


def _assign_objects(rng: random.Random, slots: list[_Slot]) -> list[Event]:
    """Give each slot an object: reserved combos for unique/counting slots, the rest shared."""
    deck = [(c, s) for c in COLOURS for s in SHAPES]
    rng.shuffle(deck)
    order = sorted(range(len(slots)), key=lambda k: (slots[k].start, slots[k].cell))
    chosen: dict[int, tuple[str, str]] = {}
    groups: dict[int, tuple[str, str]] = {}
    for k in order:  # reserve for counting groups first, then unique slots
        s = slots[k]
        if s.identity.startswith("count") and s.group not in groups and deck:
            groups[s.group] = deck.pop()
    for k in order:
        s = slots[k]
        if s.identity.startswith("count"):
            chosen[k] = groups[s.group] if s.group in groups else None
        elif s.identity == "unique" and len(deck) > 4:
            chosen[k] = deck.pop()
    common = deck or [(c, s) for c in COLOURS for s in SHAPES]
    events = []
    for new_id, k in enumerate(order):
        s = slots[k]
        colour, shape = chosen.get(k) or rng.choice(common)
        events.append(Event(id=new_id, obj=Obj(shape=shape, colour=colour, size=s.size), start=s.start,
                            end=s.end, cell=s.cell, motion=s.motion, path=s.path, role=s.role))
    return events
