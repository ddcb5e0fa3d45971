"""Synth vision: the browsers' VLM for the M1-Synth world, answering from pixels only.

It sees exactly what a real VLM would: the frames it is given, their times and the prompt. It
never reads the world script, the file path or the question id. Each frame is segmented against
its background (estimated from the frame border), every blob gets a palette colour (majority of
its pixels), a shape (fill ratio and mass distribution of the blob) and a size; the question's
templated wording is found in the prompt and answered from those detections. When the frames do
not show what the question needs, it says so; for multiple choice it then picks a letter from a
hash of the prompt, which is right only by chance.

Detections are kept per process (`DETECTIONS`, keyed by the frame's pixels): every agent, rollout and greedy run of
a MARL step shows it the same frames, and detecting is most of its cost.
"""
from __future__ import annotations

import hashlib
import re
import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from statistics import median
from typing import Any

import numpy as np

from m1.kinds.prompts import CAPTION_PROMPT
from m1.models.base import Completion, ModelError, SamplingParams, VisionRequest
from m1.schema import LETTERS
from m1.synth.questions import MOTION_TEXT, RELATIONS
from m1.synth.world import BACKGROUNDS, COLOURS, SHAPES, SIZES, fmt_time

_OBJ_RGB = np.array(list(COLOURS.values()), np.float32)
_OBJ_NAMES = list(COLOURS)
_BG_RGB = np.array(list(BACKGROUNDS.values()), np.float32)
_BG_NAMES = list(BACKGROUNDS)
FG_THRESHOLD = 50  # max channel difference from the background that makes a pixel foreground
ORDER_WINDOW = 6.0  # "right after": the leaving must be seen to within this many seconds
DETECT_CACHE_FRAMES = 16384  # detections kept per process (under 1 KB each)


@dataclass(frozen=True, slots=True)  # frozen: cached detections are shared by every answer
class Blob:
    colour: str
    shape: str
    size: str
    cx: float
    cy: float
    box: tuple[int, int, int, int]
    area: int

    @property
    def name(self) -> str:
        return f"{self.colour} {self.shape}"


@dataclass
class FrameSeen:
    t: float
    background: str
    blobs: list[Blob]
    width: int
    height: int


def _components(mask: np.ndarray) -> list[list[tuple[int, int, int]]]:
    """8-connected components of a boolean mask as lists of row runs (y, x0, x1)."""
    h, w = mask.shape
    padded = np.zeros((h, w + 2), np.int8)
    padded[:, 1:-1] = mask
    d = np.diff(padded, axis=1)
    ys, xs = np.nonzero(d == 1)
    _, xe = np.nonzero(d == -1)
    runs = list(zip(ys.tolist(), xs.tolist(), xe.tolist()))  # both lists are row-major ordered
    parent = list(range(len(runs)))

    def find(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    prev: list[int] = []
    cur: list[int] = []
    row = -1
    for i, (y, x0, x1) in enumerate(runs):
        if y != row:
            prev = cur if y == row + 1 else []
            cur, row = [], y
        for j in prev:
            _, p0, p1 = runs[j]
            if x0 <= p1 and p0 <= x1:  # touching diagonally counts
                a, b = find(i), find(j)
                if a != b:
                    parent[a] = b
        cur.append(i)
    groups: dict[int, list[tuple[int, int, int]]] = {}
    for i, r in enumerate(runs):
        groups.setdefault(find(i), []).append(r)
    return list(groups.values())


def _nearest(rgb: np.ndarray, table: np.ndarray) -> np.ndarray:
    d = ((rgb[:, None, :] - table[None, :, :]) ** 2).sum(-1)
    return d.argmin(1)


def _shape(m: np.ndarray) -> str:
    """Tell the four shapes apart from a tight boolean mask cropped to its box.

    Only a square fills its corners. Across the upper quarter a circle is nearly as wide as its
    box, while a triangle (apex up) and a cross are narrow; across the lower quarter the
    triangle is wide and the cross still narrow. Widths are averaged over a band of rows, so a
    ragged compressed edge does not flip the decision.
    """
    bh, bw = m.shape
    m = m.astype(np.float32)
    r = max(1, int(round(min(bw, bh) / 14)))

    def corner(fx: float, fy: float) -> bool:
        cx, cy = int(fx * (bw - 1) + 0.5), int(fy * (bh - 1) + 0.5)
        return bool(m[max(0, cy - r):cy + r + 1, max(0, cx - r):cx + r + 1].mean() > 0.5)

    def width(f0: float, f1: float) -> float:
        rows = m[int(f0 * bh):max(int(f0 * bh) + 1, int(round(f1 * bh)))]
        return float(rows.mean())

    if sum(corner(fx, fy) for fx in (0.08, 0.92) for fy in (0.08, 0.92)) >= 3:
        return "square"
    if width(0.2, 0.32) < 0.62:
        return "triangle" if width(0.68, 0.8) > 0.62 else "cross"
    return "circle"


def detect(frame: np.ndarray) -> tuple[str, list[Blob]]:
    """Background name and the coloured shapes of one RGB frame."""
    h, w, _ = frame.shape
    border = np.concatenate([frame[:2].reshape(-1, 3), frame[-2:].reshape(-1, 3),
                             frame[:, :2].reshape(-1, 3), frame[:, -2:].reshape(-1, 3)])
    bg_rgb = np.median(border.astype(np.float32), axis=0)
    background = _BG_NAMES[int(_nearest(bg_rgb[None], _BG_RGB)[0])]
    diff = np.abs(frame.astype(np.int16) - bg_rgb.astype(np.int16)).max(-1)
    mask = diff > FG_THRESHOLD
    blobs = []
    min_side = SIZES["small"] * min(w, h)
    for runs in _components(mask):
        area = sum(x1 - x0 for _, x0, x1 in runs)
        if area < 0.25 * min_side ** 2:
            continue  # compression noise or a fringe
        ys = [y for y, _, _ in runs]
        y0, y1 = min(ys), max(ys) + 1
        x0, x1 = min(r[1] for r in runs), max(r[2] for r in runs)
        pix = np.concatenate([frame[y, a:b] for y, a, b in runs]).astype(np.float32)
        k = int(np.bincount(_nearest(pix, _OBJ_RGB), minlength=len(_OBJ_NAMES)).argmax())
        colour = _OBJ_NAMES[k]
        # Tight mask: how far each pixel is along the line from the background to the object
        # colour; past half way is object. This puts blurred edges where they were drawn.
        ya, yb, xa, xb = max(0, y0 - 1), min(h, y1 + 1), max(0, x0 - 1), min(w, x1 + 1)
        v = _OBJ_RGB[k] - bg_rgb
        alpha = (frame[ya:yb, xa:xb].astype(np.float32) - bg_rgb) @ v / float(v @ v)
        tight = alpha > 0.5
        rows, cols = np.nonzero(tight)
        if len(rows) < 0.25 * min_side ** 2:
            continue
        m = tight[rows.min():rows.max() + 1, cols.min():cols.max() + 1]
        bh, bw = m.shape
        shape = _shape(m)
        side = max(bw, bh) / min(w, h)
        size = min(SIZES, key=lambda s_: abs(SIZES[s_] - side))
        x0, y0 = int(cols.min() + xa), int(rows.min() + ya)
        blobs.append(Blob(colour, shape, size, x0 + bw / 2, y0 + bh / 2, (x0, y0, x0 + bw, y0 + bh),
                          int(len(rows))))
    blobs.sort(key=lambda b: (b.cy > h / 2, b.cx))
    return background, blobs


class DetectionCache:
    """`detect` by frame pixels, least recently used dropped past `max_frames` frames; thread-safe.

    A detection depends on the pixels alone, so the key is the frame's shape, dtype and the SHA-256 of its bytes: a
    hit is the detection of this very frame, whatever video, time or prompt it comes with (hashing costs ~1/40 of
    detecting a 128x128 frame).
    """

    def __init__(self, max_frames: int = DETECT_CACHE_FRAMES):
        if max_frames < 0:
            raise ValueError(f"max_frames must be >= 0, got {max_frames}")
        self.max_frames = int(max_frames)
        self.hits = 0
        self.misses = 0
        self._items: OrderedDict[tuple, tuple[str, tuple[Blob, ...]]] = OrderedDict()
        self._lock = threading.Lock()

    def __call__(self, frame: np.ndarray) -> tuple[str, tuple[Blob, ...]]:
        frame = np.ascontiguousarray(frame)
        key = (frame.shape, frame.dtype.str, hashlib.sha256(frame).digest())
        with self._lock:
            found = self._items.get(key)
            if found is not None:
                self._items.move_to_end(key)
                self.hits += 1
                return found
            self.misses += 1
        background, blobs = detect(frame)
        found = (background, tuple(blobs))
        with self._lock:
            self._items[key] = found
            while len(self._items) > self.max_frames:
                self._items.popitem(last=False)
        return found

    def __len__(self) -> int:
        with self._lock:
            return len(self._items)

    def clear(self) -> None:
        with self._lock:
            self._items.clear()


DETECTIONS = DetectionCache()


@dataclass
class Run:
    """An object seen in consecutive frames (by time) of one request."""

    name: str
    k0: int
    k1: int  # inclusive frame positions in time order
    sightings: list[tuple[float, Blob]] = field(default_factory=list)

    @property
    def first(self) -> float:
        return self.sightings[0][0]

    @property
    def last(self) -> float:
        return self.sightings[-1][0]


_C = "|".join(COLOURS)
_S = "|".join(SHAPES)
_OBJ = rf"({_C}) ({_S})"
TEMPLATES = [
    ("timestamp", re.compile(r"what colou?r is the shape that appears at (\d+):(\d{2})")),
    ("order", re.compile(rf"what appears right after the {_OBJ} leaves")),
    ("position", re.compile(rf"where in the frame does the {_OBJ} appear")),
    ("motion", re.compile(rf"which way does the {_OBJ} move")),
    ("counting", re.compile(rf"how many times does an? {_OBJ} appear")),
    ("spatial", re.compile(rf"where is the {_OBJ} relative to the {_OBJ}")),
    ("grounding", re.compile(rf"when does the {_OBJ} appear")),
    ("late", re.compile(r"which object flashes briefly near the end")),
    ("background", re.compile(rf"what colou?r is the background when the {_OBJ} appears")),
]
_OPTION = re.compile(r"^\s*\(?([A-H])[):.]\s*(.+?)\s*$", re.M)


def parse_options(prompt: str) -> list[str]:
    """Options written as lines "A: text" (or "A. text", "(A) text"), from A on, in order."""
    found: list[str] = []
    for m in _OPTION.finditer(prompt):
        k = LETTERS.index(m.group(1))
        if k == len(found):
            found.append(m.group(2))
        elif k == 0 and len(found) < 2:  # a stray "A:" line before the real block
            found = [m.group(2)]
    return found if len(found) >= 2 else []


def _norm(text: str) -> str:
    text = re.sub(r"[^a-z ]", " ", text.lower())
    return " ".join(w for w in text.split() if w not in ("a", "an", "the", "it", "of"))


class SynthVisionModel:
    """VisionModel for M1-Synth videos. `spec` may be None; nothing is loaded. `detections`: the process's shared
    cache by default; None detects every frame anew."""

    def __init__(self, spec: Any = None, name: str = "synth-vision", detections: DetectionCache | None = DETECTIONS):
        self.spec, self.name = spec, name
        self.detections = detections
        self.calls = 0  # describe() calls
        self.requests = 0  # requests answered
        self.frames_seen = 0

    def describe(self, requests: list[VisionRequest], params: SamplingParams) -> list[Completion]:
        self.calls += 1
        see = self.detections if self.detections is not None else detect
        out = []
        for i, req in enumerate(requests):
            frames = np.asarray(req.frames)
            if frames.ndim != 4 or frames.shape[-1] != 3 or frames.dtype != np.uint8:
                raise ModelError(f"{self.name}: request {i}: frames must be (T, H, W, 3) uint8, "
                                 f"got {frames.shape} {frames.dtype}")
            if len(req.timestamps) != len(frames):
                raise ModelError(f"{self.name}: request {i}: {len(frames)} frames but "
                                 f"{len(req.timestamps)} timestamps")
            self.requests += 1
            self.frames_seen += len(frames)
            out.append(_Answerer(frames, list(req.timestamps), req.prompt, see).completion(params))
        return out


class _Answerer:
    """What the frames show about the prompt. `see`: how a frame is detected (the process's cache by default)."""

    def __init__(self, frames: np.ndarray, timestamps: list[float], prompt: str, see=DETECTIONS):
        order = sorted(range(len(frames)), key=lambda k: timestamps[k])
        self.seen = []
        for k in order:
            bg, blobs = see(frames[k])
            self.seen.append(FrameSeen(float(timestamps[k]), bg, list(blobs), frames.shape[2], frames.shape[1]))
        self.times = [f.t for f in self.seen]
        self.prompt = prompt
        self.options = parse_options(prompt)
        self.runs = self._runs()
        self.notes: list[str] = []  # sentences about the objects the question is about
        self.note_times: list[tuple[float, ...]] = []  # the times of the frames each note is read from

    def _note(self, text: str, *times: float) -> None:
        self.notes.append(text)
        self.note_times.append(tuple(dict.fromkeys(times)))

    def _runs(self) -> list[Run]:
        """Follow each object through consecutive frames; same name and a nearby centre."""
        runs: list[Run] = []
        open_: list[Run] = []
        for k, f in enumerate(self.seen):
            reach = 0.3 * min(f.width, f.height)
            still_open: list[Run] = []
            for b in f.blobs:
                near = [r for r in open_ if r.name == b.name and r.k1 == k - 1
                        and abs(r.sightings[-1][1].cx - b.cx) + abs(r.sightings[-1][1].cy - b.cy) < reach]
                if near:
                    r = min(near, key=lambda r: abs(r.sightings[-1][1].cx - b.cx)
                            + abs(r.sightings[-1][1].cy - b.cy))
                    open_.remove(r)
                    r.k1 = k
                    r.sightings.append((f.t, b))
                else:
                    r = Run(b.name, k, k, [(f.t, b)])
                still_open.append(r)
            runs += open_  # not continued in this frame: closed
            open_ = still_open
        runs += open_
        return sorted(runs, key=lambda r: (r.k0, r.name, r.sightings[0][1].cx))

    def of(self, name: str) -> list[Run]:
        return [r for r in self.runs if r.name == name]

    def gap(self) -> float:
        if len(self.times) < 2:
            return 1.0
        return float(median(b - a for a, b in zip(self.times, self.times[1:])))

    # ---------------------------------------------------------------------------------------

    def completion(self, params: SamplingParams) -> Completion:
        if not self.seen:
            return Completion(text="No frames were given, so nothing can be seen.",
                              meta={"question": None, "seen": False})
        if self.prompt == CAPTION_PROMPT:  # a seed-kind captioner: what each frame shows, in a few words
            return Completion(text=self._caption(), meta={"question": "caption", "seen": True})
        low = self.prompt.lower()
        kind, m = next(((k, p.search(low)) for k, p in TEMPLATES if p.search(low)), (None, None))
        final, seen = "", False
        if kind is not None:
            final, seen = getattr(self, f"_{kind}")(m)
        text = self._summary(params.max_new_tokens, final)
        return Completion(text=text, meta={"question": kind, "seen": seen, "frames": len(self.seen)})

    def _summary(self, max_tokens: int, final: str) -> str:
        lines = [f"{len(self.seen)} frames from {fmt_time(self.times[0])} to {fmt_time(self.times[-1])}."]
        lines += self.notes
        for r in self.runs:
            b = r.sightings[0][1]
            where = self._where(b)
            if r.first == r.last:
                lines.append(f"At {fmt_time(r.first)} a {b.size} {r.name} is at the {where}.")
            else:
                lines.append(f"From {fmt_time(r.first)} to {fmt_time(r.last)} a {b.size} {r.name} is at "
                             f"the {where}.")
        budget = max(8, int(max_tokens / 1.4) - len(final.split()) - 2)  # ~1.4 tokens per word
        kept, used = [], 0
        for line in dict.fromkeys(lines):
            n = len(line.split())
            if used + n > budget:
                break
            kept.append(line)
            used += n
        summary = " ".join(kept)
        if final.startswith("##Timestamp"):
            if "##reason" in self.prompt.lower():  # a grounding tool prompt: span first, then why
                return f"{final}\n##Reason: {summary}"
            span = final.split(":", 1)[1].strip()
            return f"##Summary: {summary}\n##Answer: {span}\n{final}"
        return f"##Summary: {summary}" + (f"\n{final}" if final else "")

    def _caption(self) -> str:
        things = [f"a {b.size} {b.name} at the {self._where(b)}" for f in self.seen for b in f.blobs]
        return "; ".join(things) if things else "only the background"

    def _where(self, b: Blob) -> str:
        f = self.seen[0]
        return ("top" if b.cy < f.height / 2 else "bottom") + " " + ("left" if b.cx < f.width / 2 else "right")

    def _choose(self, answer: str | None) -> tuple[str, bool]:
        """The final line for a multiple-choice answer; a prompt-hash guess when unseen."""
        if answer is not None:
            if not self.options:
                return f"##Answer: {answer}", True
            target = _norm(answer)
            for k, opt in enumerate(self.options):
                if _norm(opt) == target:
                    return f"##Answer: {LETTERS[k]}", True
            for k, opt in enumerate(self.options):
                if target and target in _norm(opt):
                    return f"##Answer: {LETTERS[k]}", True
            self._note(f"What I saw ({answer}) matches none of the options.")
        if not self.options:
            return "##Answer: not seen", False
        k = int(hashlib.sha256(self.prompt.encode()).hexdigest(), 16) % len(self.options)
        self._note("The frames do not show what the question asks about; the answer is a guess.")
        return f"##Answer: {LETTERS[k]}", False

    # one method per question template: returns (final line, whether the evidence was seen)

    def _timestamp(self, m):
        t = int(m.group(1)) * 60 + int(m.group(2))
        lo, hi = t - 1.5, t + min(self.gap() + 1.0, 6.0)
        cands = [r for r in self.runs if lo <= r.first <= hi]
        if not cands:
            self._note(f"Nothing appears around {fmt_time(t)} in these frames.")
            return self._choose(None)
        r = min(cands, key=lambda r: (abs(r.first - t), r.name))
        self._note(f"At {fmt_time(r.first)} a {r.name} appears at the {self._where(r.sightings[0][1])}.", r.first)
        return self._choose(r.name.split()[0])

    def _order(self, m):
        ref = f"{m.group(1)} {m.group(2)}"
        runs = self.of(ref)
        if not runs:
            self._note(f"The {ref} is not visible in these frames.")
            return self._choose(None)
        last = runs[-1]
        if last.k1 == len(self.seen) - 1:
            self._note(f"The {ref} is still visible in the last frame; I cannot see it leave.", last.last)
            return self._choose(None)
        gone = self.times[last.k1 + 1]
        if gone - last.last > ORDER_WINDOW:
            self._note(f"The {ref} is last seen at {fmt_time(last.last)}, but the next frame is at "
                       f"{fmt_time(gone)}; I cannot tell when it left.", last.last, gone)
            return self._choose(None)
        after = [r for r in self.runs if r.name != ref and r.k0 > last.k1 and r.first - last.last <= 2 * ORDER_WINDOW]
        if not after:
            self._note(f"The {ref} leaves after {fmt_time(last.last)}; nothing new appears right after it.",
                       last.last, gone)
            return self._choose(None)
        nxt = min(after, key=lambda r: (r.k0, r.name))
        self._note(f"The {ref} is last seen at {fmt_time(last.last)}; next a {nxt.name} appears at "
                   f"{fmt_time(nxt.first)}.", last.last, nxt.first)
        return self._choose(nxt.name)

    def _position(self, m):
        name = f"{m.group(1)} {m.group(2)}"
        sights = [s for r in self.of(name) for s in r.sightings]
        if not sights:
            self._note(f"The {name} is not visible in these frames.")
            return self._choose(None)
        f = self.seen[0]
        cx = float(np.mean([b.cx for _, b in sights]))
        cy = float(np.mean([b.cy for _, b in sights]))
        where = ("top" if cy < f.height / 2 else "bottom") + " " + ("left" if cx < f.width / 2 else "right")
        self._note(f"At {fmt_time(sights[0][0])} the {name} is at the {where}.", *(t for t, _ in sights))
        return self._choose(where)

    def _motion(self, m):
        name = f"{m.group(1)} {m.group(2)}"
        sights = [s for r in self.of(name) for s in r.sightings]
        if len(sights) < 2:
            self._note(f"The {name} is not seen in two frames, so its motion is unknown.", *(t for t, _ in sights))
            return self._choose(None)
        (t0, a), (t1, b) = sights[0], sights[-1]
        dx, dy = b.cx - a.cx, b.cy - a.cy
        if max(abs(dx), abs(dy)) < 3:
            way = "still"
        elif abs(dx) >= abs(dy):
            way = "right" if dx > 0 else "left"
        else:
            way = "down" if dy > 0 else "up"
        self._note(f"From {fmt_time(t0)} to {fmt_time(t1)} the {name} {MOTION_TEXT[way]}.", t0, t1)
        return self._choose(MOTION_TEXT[way])

    def _counting(self, m):
        name = f"{m.group(1)} {m.group(2)}"
        runs = self.of(name)
        if runs:
            self._note(f"The {name} is seen {len(runs)} time(s): " + ", ".join(fmt_time(r.first) for r in runs) + ".",
                       *(r.first for r in runs))
        else:
            self._note(f"No {name} is visible in these frames.")
        return f"##Answer: {len(runs)}", bool(runs)

    def _spatial(self, m):
        a, b = f"{m.group(1)} {m.group(2)}", f"{m.group(3)} {m.group(4)}"
        pairs = []
        for f in self.seen:
            ba = next((x for x in f.blobs if x.name == a), None)
            bb = next((x for x in f.blobs if x.name == b), None)
            if ba is not None and bb is not None:
                pairs.append((f.t, ba.cx - bb.cx, ba.cy - bb.cy))
        if not pairs:
            self._note(f"The {a} and the {b} are never visible together in these frames.")
            return self._choose(None)
        dx = float(np.mean([p[1] for p in pairs]))
        dy = float(np.mean([p[2] for p in pairs]))
        if abs(dx) >= abs(dy):
            rel = "left" if dx < 0 else "right"
        else:
            rel = "above" if dy < 0 else "below"
        self._note(f"At {fmt_time(pairs[0][0])} the {a} is {RELATIONS[rel]} of the {b}.", *(p[0] for p in pairs))
        return self._choose(RELATIONS[rel])

    def _grounding(self, m):
        name = f"{m.group(1)} {m.group(2)}"
        runs = self.of(name)
        if not runs:
            self._note(f"The {name} is not visible in these frames.")
            return "##Timestamp: not found", False
        k0, k1 = runs[0].k0, runs[-1].k1
        g = self.gap()
        before = self.times[k0] - self.times[k0 - 1] if k0 > 0 else g
        after = self.times[k1 + 1] - self.times[k1] if k1 + 1 < len(self.times) else g
        s, e = max(0.0, self.times[k0] - before / 2), self.times[k1] + after / 2
        self._note(f"The {name} is seen from {fmt_time(self.times[k0])} to {fmt_time(self.times[k1])}.",
                   self.times[k0], self.times[k1])
        return f"##Timestamp: [{s:.1f} - {e:.1f}]", True

    def _late(self, m):
        n = len(self.seen)
        brief = [r for r in self.runs if r.k0 > 0 and r.k1 < n - 1 and r.last - r.first <= 3.5]
        if not brief:
            self._note("No brief flash is visible in these frames.")
            return "##Answer: not seen", False
        r = max(brief, key=lambda r: (r.first, r.name))
        self._note(f"A {r.name} flashes briefly at {fmt_time(r.first)}.", r.first)
        return f"##Answer: {r.name}", True

    def _background(self, m):
        name = f"{m.group(1)} {m.group(2)}"
        bgs = [f.background for f in self.seen if any(b.name == name for b in f.blobs)]
        if not bgs:
            self._note(f"The {name} is not visible in these frames.")
            return "##Answer: not seen", False
        bg = max(set(bgs), key=lambda x: (bgs.count(x), x))
        self._note(f"When the {name} is visible (first at {fmt_time(self._first(name))}) the background is {bg}.",
                   *(f.t for f in self.seen if any(b.name == name for b in f.blobs)))
        return f"##Answer: {bg}", True

    def _first(self, name: str) -> float:
        return self.of(name)[0].first
