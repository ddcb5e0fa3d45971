"""M1-Synth: reproducible world + questions, exact ground truth, and a pixel-reading vision model."""
from __future__ import annotations

import collections
import json
import os
import random
import re
from pathlib import Path

import numpy as np
import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from m1.models.base import ModelError, SamplingParams, VisionRequest  # noqa: E402
from m1.synth.vision import SynthVisionModel, detect, parse_options  # noqa: E402
from m1.schema import LETTERS, Question  # noqa: E402
from m1.synth.cli import app  # noqa: E402
from m1.synth.make import make_dataset  # noqa: E402
from m1.synth.questions import FAMILIES, LetterCycle, make_questions  # noqa: E402
from m1.synth.render import render, render_frame  # noqa: E402
from m1.synth.world import (BACKGROUNDS, COLOURS, Event, Obj, Scene, Script, cell_bounds,  # noqa: E402
                            make_script, size_px)

PARAMS = SamplingParams(max_new_tokens=256)


# ------------------------------------------------------------------------------------------
# helpers

def read_all(path) -> tuple[np.ndarray, float]:
    """All frames of a video and its fps (m1.video.VideoReader, or PyAV if it is missing)."""
    try:
        from m1.video import VideoReader
    except ImportError:
        import av

        with av.open(str(path)) as c:
            s = c.streams.video[0]
            return np.stack([f.to_ndarray(format="rgb24") for f in c.decode(s)]), float(s.average_rate)
    with VideoReader(path) as r:
        return r.frames(range(len(r))), r.info.fps


def prompt_for(q: Question) -> str:
    block = f"Options:\n{q.options_block()}\n" if q.options else ""
    return f"Question: {q.text}\n{block}Focus: {q.meta['key_info']}"


def right_times(q: Question, duration: float) -> list[float]:
    """Frames covering the question's evidence span densely (>= 2 per second)."""
    s, e = q.meta["evidence"]["span"]
    lo, hi = max(0.0, s - 2), min(duration - 0.01, e + 2)
    return list(np.linspace(lo, hi, int(max(16, np.ceil((hi - lo) * 2)))))


def wrong_times(q: Question, duration: float) -> list[float]:
    """As many frames, spread over the video but at least 5 s away from the evidence span."""
    s, e = q.meta["evidence"]["span"]
    grid = [t for t in np.arange(0, duration, 0.25) if t < s - 5 or t > e + 5]
    n = min(len(grid), max(16, min(64, len(right_times(q, duration)))))
    return [grid[i] for i in np.linspace(0, len(grid) - 1, n).round().astype(int)] if n else []


def ask(model, frames, fps, times, q: Question, prompt: str | None = None) -> str:
    idx = sorted({min(len(frames) - 1, int(round(t * fps))) for t in times})
    req = VisionRequest(frames=frames[idx], timestamps=[i / fps for i in idx], prompt=prompt or prompt_for(q))
    return model.describe([req], PARAMS)[0].text


def correct(q: Question, text: str) -> bool:
    if q.task == "grounding":
        m = re.search(r"##Timestamp:\s*\[([\d.]+)\s*-\s*([\d.]+)\]", text)
        if not m:
            return False
        a, b = float(m.group(1)), float(m.group(2))
        s, e = (float(x) for x in q.answer.strip("[]").split(" - "))
        union = max(b, e) - min(a, s)
        return union > 0 and max(0.0, min(b, e) - max(a, s)) / union >= 0.5
    m = re.search(r"##Answer:\s*(.+)", text)
    if not m:
        return False
    got = m.group(1).strip()
    return got[:1] == q.answer if q.task == "mcq" else got.lower() == q.answer.lower()


def event(i, name, size, start, end, cell, motion="still", w=128, h=128):
    colour, shape = name.split()
    x0, y0, x1, y1 = cell_bounds(cell, w, h)
    side = size_px(size, w, h)
    cy = (y0 + y1 - side) // 2
    path = {"still": ((x0 + 2, cy), (x0 + 2, cy)), "right": ((x0, cy), (x1 - side, cy))}[motion]
    return Event(id=i, obj=Obj(shape=shape, colour=colour, size=size), start=start, end=end, cell=cell,
                 motion=motion, path=path)


@pytest.fixture(scope="module")
def hand_script() -> Script:
    """A two-minute world with one clean case of every family."""
    evs = [
        event(0, "red square", "medium", 10, 20, (0, 0)),  # order: leaves at 20 ...
        event(1, "blue circle", "large", 22, 30, (1, 1)),  # ... blue circle appears at 22
        event(2, "white circle", "small", 35, 37, (1, 0)),  # counting x3
        event(3, "green triangle", "large", 40, 55, (0, 0)),  # spatial: left of the yellow cross
        event(4, "yellow cross", "medium", 47, 53, (0, 1)),
        event(5, "purple cross", "medium", 60, 75, (1, 0), motion="right"),  # motion
        event(6, "white circle", "small", 65, 67, (1, 1)),
        event(7, "white circle", "small", 80, 82, (0, 1)),
        event(8, "cyan circle", "small", 85, 87, (1, 1)),  # background: navy; position: bottom right
        event(9, "orange square", "small", 110, 112, (0, 1)),  # late flash
    ]
    scenes = [Scene(start=0, end=60, background="black"), Scene(start=60, end=120, background="navy")]
    return Script(seed=0, duration=120, fps=4, width=128, height=128, scenes=scenes, events=evs)


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    out = tmp_path_factory.mktemp("synth")
    make_dataset(out, videos=8, seed=11, duration=60, fps=4, size=128, questions_per_video=20, progress=False)
    qs = [Question.model_validate_json(line) for line in (out / "questions.jsonl").read_text().splitlines()]
    videos = {v: read_all(out / v) for v in sorted({q.video for q in qs})}
    return out, qs, videos


# ------------------------------------------------------------------------------------------
# world and renderer

def test_script_roundtrip_and_checks():
    s = make_script(5, duration=90, fps=3, width=160, height=128)
    assert Script.from_json(s.to_json()) == s
    assert s.num_frames == 270 and len(s.events) >= 5
    assert make_script(5, duration=90, fps=3, width=160, height=128) == s
    assert make_script(6, duration=90, fps=3, width=160, height=128) != s
    durations = [e.duration for e in make_script(1, duration=600).events]
    assert min(durations) <= 3 and max(durations) >= 60  # flashes and minute-long events
    for bad in (dict(duration=20), dict(fps=1), dict(width=64)):
        with pytest.raises(ValueError, match=str(list(bad.values())[0])):
            make_script(0, **{"duration": 60, **bad})
    # one object per cell at a time, and objects stay inside their cell
    for t in np.arange(0, s.duration, 0.5):
        cells = [v.event.cell for v in s.visible_at(t)]
        assert len(cells) == len(set(cells))


def test_render_draws_the_script(hand_script):
    f = render_frame(hand_script, 50.0)  # green triangle and yellow cross on black
    assert f.shape == (128, 128, 3) and f.dtype == np.uint8
    assert tuple(f[0, 0]) == BACKGROUNDS["black"]
    for v in hand_script.visible_at(50.0):
        x0, y0, x1, y1 = v.box
        cx, cy = (x0 + x1) // 2, (y0 + y1) // 2
        assert tuple(f[cy, cx]) == COLOURS[v.event.obj.colour]
    assert tuple(render_frame(hand_script, 100.0)[0, 0]) == BACKGROUNDS["navy"]
    colours = {tuple(c) for c in render_frame(hand_script, 50.0).reshape(-1, 3)}
    assert colours == {BACKGROUNDS["black"], COLOURS["green"], COLOURS["yellow"]}  # flat, no blending


def test_detect_on_decoded_video(tmp_path, hand_script):
    path = render(hand_script, tmp_path / "hand.mp4")
    frames, fps = read_all(path)
    assert len(frames) == 480 and fps == 4
    wrong = 0
    for i in range(0, 480, 3):
        want = sorted((v.event.obj.name, v.event.obj.size, v.event.position) for v in hand_script.visible_at(i / 4))
        bg, blobs = detect(frames[i])
        assert bg == hand_script.background_at(i / 4)
        got = sorted((b.name, b.size, ("top " if b.cy < 64 else "bottom ") + ("left" if b.cx < 64 else "right"))
                     for b in blobs)
        wrong += got != want
    assert wrong == 0


def test_same_seed_gives_identical_files(tmp_path):
    a = make_dataset(tmp_path / "a", videos=2, seed=3, duration=30, questions_per_video=6, progress=False)
    b = make_dataset(tmp_path / "b", videos=2, seed=3, duration=30, questions_per_video=6, progress=False)
    files = sorted(p.relative_to(tmp_path / "a") for p in (tmp_path / "a").rglob("*") if p.is_file())
    assert [str(p) for p in files] == ["questions.jsonl", "scripts/synth_000.json", "scripts/synth_001.json",
                                       "synth.json", "videos/synth_000.mp4", "videos/synth_001.mp4"]
    for p in files:
        assert (tmp_path / "a" / p).read_bytes() == (tmp_path / "b" / p).read_bytes(), p
    qs = [json.loads(line) for line in a.read_text().splitlines()]
    assert qs and all(q["video"].startswith("videos/") for q in qs)
    c = make_dataset(tmp_path / "c", videos=2, seed=4, duration=30, questions_per_video=6, progress=False)
    assert c.read_bytes() != b.read_bytes()


def test_cli_make(tmp_path):
    from typer.testing import CliRunner

    res = CliRunner().invoke(app, ["make", str(tmp_path / "o"), "--videos", "1", "--seed", "2",
                                   "--duration", "30", "--fps", "2", "--size", "128",
                                   "--questions-per-video", "3"])
    assert res.exit_code == 0, res.output
    assert (tmp_path / "o" / "videos" / "synth_000.mp4").stat().st_size > 1000
    script = Script.load(tmp_path / "o" / "scripts" / "synth_000.json")
    assert (script.fps, script.width, script.duration) == (2, 128, 30)
    bad = CliRunner().invoke(app, ["make", str(tmp_path / "p"), "--duration", "5"])
    assert bad.exit_code != 0 and "duration" in bad.output


def test_make_refuses_a_folder_made_with_other_settings_and_remakes_the_same(tmp_path):
    """Another size and seed into a made folder would leave its old videos and scripts beside the new questions:
    refused in one line (exit 2) naming the folder, both settings and the way out; the same settings
    make the same set again, in a folder made before the settings were recorded too."""
    from typer.testing import CliRunner

    out = tmp_path / "w"
    args = lambda videos, seed: ["make", str(out), "--videos", str(videos), "--seed", str(seed),  # noqa: E731
                                 "--duration", "30", "--questions-per-video", "2"]
    assert CliRunner().invoke(app, args(2, 1)).exit_code == 0
    made = {p.relative_to(out): p.read_bytes() for p in out.rglob("*") if p.is_file()}
    assert json.loads((out / "synth.json").read_text()) == {"videos": 2, "seed": 1, "duration": 30.0, "fps": 4,
                                                             "size": 128, "questions_per_video": 2}
    res = CliRunner().invoke(app, args(1, 2))
    assert res.exit_code == 2 and res.output.splitlines() == [
        f"error: {out} holds an M1-Synth set made with --videos 2 --seed 1, not --videos 1 --seed 2: make the new "
        f"set into another folder, or remove {out} first"]
    assert {p.relative_to(out): p.read_bytes() for p in out.rglob("*") if p.is_file()} == made  # untouched
    res = CliRunner().invoke(app, args(2, 1))
    assert res.exit_code == 0, res.output
    assert {p.relative_to(out): p.read_bytes() for p in out.rglob("*") if p.is_file()} == made  # the same set
    (out / "synth.json").unlink()  # made before the record: its scripts tell the settings
    assert CliRunner().invoke(app, args(2, 1)).exit_code == 0 and (out / "synth.json").read_bytes() == made[
        Path("synth.json")]
    (out / "synth.json").unlink()
    res = CliRunner().invoke(app, args(1, 2))
    assert res.exit_code == 2 and "made with --videos 2 --seed (not 2), not --videos 1 --seed 2" in res.output


# ------------------------------------------------------------------------------------------
# questions

def test_ground_truth_on_hand_built_script(hand_script):
    qs = make_questions(hand_script, "hand.mp4", random.Random(0))
    assert {q.meta["family"] for q in qs} == set(FAMILIES)

    def answer(q):
        return q.options[LETTERS.index(q.answer)] if q.task == "mcq" else q.answer

    got = {q.text: answer(q) for q in qs}
    expect = {
        "What colour is the shape that appears at 00:22?": "blue",
        "What appears right after the red square leaves?": "a blue circle",
        "How many times does a white circle appear?": "3",
        "While both are visible, where is the green triangle relative to the yellow cross?": "to the left",
        "When does the yellow cross appear? Give [start - end] in seconds.": "[47.0 - 53.0]",
        "Which way does the purple cross move?": "moves right",
        "Where in the frame does the cyan circle appear?": "bottom right",
        "What colour is the background when the cyan circle appears?": "navy",
        "Which object flashes briefly near the end of the video?": "orange square",
    }
    for text, ans in expect.items():
        assert got.get(text) == ans, (text, got.get(text))
    # nothing is asked that the script makes ambiguous: the white circle is not unique
    assert not any("the white circle" in q.text for q in qs)
    for q in qs:
        assert q.meta["evidence"]["span"][0] <= q.meta["evidence"]["span"][1]
        assert q.meta["plan"] and q.meta["cue"]
        if q.task == "mcq":
            assert len(q.options) == 4 and len(set(q.options)) == 4
    ts = next(q for q in qs if q.meta["family"] == "timestamp" and "00:22" in q.text)
    assert ts.meta["time"] == 22 and ts.meta["plan"][0] == "Time Stamp Retrieval"


def test_answer_letters_are_balanced():
    rng = random.Random(1)
    letters = LetterCycle(rng)
    counts = collections.Counter()
    for seed in range(25):
        for q in make_questions(make_script(seed, duration=300), "v.mp4", rng, letters=letters):
            if q.task == "mcq":
                counts[q.answer] += 1
                assert q.options[LETTERS.index(q.answer)] not in q.options[:LETTERS.index(q.answer)]
    assert set(counts) == set("ABCD") and sum(counts.values()) > 200
    assert max(counts.values()) - min(counts.values()) <= 1  # shared cycle: exact to one block
    # independent per-video cycles are balanced too (statistically)
    counts2 = collections.Counter(q.answer for seed in range(25)
                                  for q in make_questions(make_script(seed, duration=300), "v.mp4",
                                                          random.Random(seed)) if q.task == "mcq")
    n = sum(counts2.values())
    assert all(abs(c / n - 0.25) < 0.05 for c in counts2.values())


# ------------------------------------------------------------------------------------------
# synth vision

def test_vision_reads_pixels(hand_script):
    model = SynthVisionModel(None, "synth")
    q = next(q for q in make_questions(hand_script, "x", random.Random(0)) if "00:22" in q.text)
    times = np.arange(10, 34, 1.0)
    frames = np.stack([render_frame(hand_script, t) for t in times])
    req = VisionRequest(frames=frames, timestamps=list(times), prompt=prompt_for(q))
    text = model.describe([req], PARAMS)[0].text
    assert correct(q, text) and "00:22" in text
    # repaint the blue circle green: the answer must follow the pixels
    painted = frames.copy()
    painted[np.all(painted == COLOURS["blue"], axis=-1)] = COLOURS["green"]
    text2 = model.describe([VisionRequest(painted, list(times), prompt_for(q))], PARAMS)[0].text
    assert re.search(r"##Answer: (\w)", text2).group(1) == LETTERS[q.options.index("green")]
    # frames without the moment: an honest "not seen" and a guess that depends only on the prompt
    empty = np.stack([render_frame(hand_script, t) for t in (90.0, 100.0)])
    text3 = model.describe([VisionRequest(empty, [90.0, 100.0], prompt_for(q))], PARAMS)[0]
    assert text3.meta["seen"] is False and "guess" in text3.text
    assert model.calls == 3 and model.requests == 3
    with pytest.raises(ModelError, match="timestamps"):
        model.describe([VisionRequest(frames, [0.0], "x")], PARAMS)
    with pytest.raises(ModelError, match="uint8"):
        model.describe([VisionRequest(frames.astype(np.float32), list(times), "x")], PARAMS)


def test_vision_names_the_letter_of_rotated_options(hand_script):
    """SFT's rotate_options moves the options; the browser's answer letter moves with them."""
    from m1.marl.sft import rotate_options

    model = SynthVisionModel(None, "synth")
    q = next(q for q in make_questions(hand_script, "x", random.Random(0)) if "00:22" in q.text)
    times = np.arange(10, 34, 1.0)
    frames = np.stack([render_frame(hand_script, t) for t in times])
    for shift in range(len(q.options)):
        r = rotate_options(q, shift)
        text = model.describe([VisionRequest(frames, list(times), prompt_for(r))], PARAMS)[0].text
        assert re.search(r"##Answer: (\w)", text).group(1) == r.answer == LETTERS[(LETTERS.index(q.answer) + shift)
                                                                                   % len(q.options)]


def test_parse_options_formats():
    assert parse_options("Q?\nA: red\nB: blue\nC: green\nD: white") == ["red", "blue", "green", "white"]
    assert parse_options("(A) left\n(B) right") == ["left", "right"]
    assert parse_options("no options here") == []


def test_vision_accuracy_right_vs_wrong_frames(dataset):
    _, qs, videos = dataset
    model = SynthVisionModel(None, "synth")
    right, wrong = collections.defaultdict(list), collections.defaultdict(list)
    for q in qs:
        frames, fps = videos[q.video]
        duration = len(frames) / fps
        right[q.meta["family"]].append(correct(q, ask(model, frames, fps, right_times(q, duration), q)))
        wt = wrong_times(q, duration)
        if wt:
            wrong[q.task].append(correct(q, ask(model, frames, fps, wt, q)))
    assert set(right) == set(FAMILIES), sorted(right)
    for family, oks in right.items():
        assert np.mean(oks) >= 0.95, (family, np.mean(oks), len(oks))
    assert len(wrong["mcq"]) >= 40
    assert np.mean(wrong["mcq"]) <= 0.25 + 0.15, np.mean(wrong["mcq"])
    for task in ("numeric", "grounding", "open"):
        assert np.mean(wrong[task]) <= 0.1, (task, np.mean(wrong[task]))


def test_vision_with_agent_prompts(dataset):
    """The real browser prompts (when that module exists) carry the question well enough."""
    prompts = pytest.importorskip("m1.agents.prompts")
    _, qs, videos = dataset
    model = SynthVisionModel(None, "synth")
    kinds = {"spatial": "space", "grounding": "grounding"}
    n = 0
    for q in qs[:40]:
        frames, fps = videos[q.video]
        times = right_times(q, len(frames) / fps)
        kind = kinds.get(q.meta["family"], "fine")
        prompt = prompts.browser_prompt(kind, q, q.meta["key_info"], times, 256)
        assert correct(q, ask(model, frames, fps, times, q, prompt=prompt)), (kind, q.text)
        n += 1
    assert n == min(40, len(qs))


def test_vision_detection_cache_changes_no_answer(dataset, monkeypatch):
    """The detection cache (on by default) gives the answers of detecting every frame anew; a repeated request
    detects nothing again, and the cache keeps at most its bound, least recently used out first."""
    from m1.synth import vision

    assert SynthVisionModel().detections is vision.DETECTIONS
    calls = collections.Counter()

    def counted(frame):
        calls["detect"] += 1
        return detect(frame)

    monkeypatch.setattr(vision, "detect", counted)
    _, qs, videos = dataset
    reqs = []
    for q in qs[:20]:
        frames, fps = videos[q.video]
        idx = sorted({min(len(frames) - 1, int(round(t * fps))) for t in right_times(q, len(frames) / fps)})
        reqs.append(VisionRequest(frames[idx], [i / fps for i in idx], prompt_for(q)))
    n = sum(len(r.frames) for r in reqs)
    distinct = len({f.tobytes() for r in reqs for f in r.frames})
    assert distinct < n  # questions of one video share frames
    want = SynthVisionModel(None, "synth", detections=None).describe(reqs, PARAMS)
    assert calls["detect"] == n
    cache = vision.DetectionCache()
    model = SynthVisionModel(None, "synth", detections=cache)
    for repeat in range(2):
        calls.clear()
        got = model.describe(reqs, PARAMS)
        assert [(c.text, c.meta) for c in got] == [(c.text, c.meta) for c in want]
        assert calls["detect"] == (distinct if repeat == 0 else 0)
    assert (cache.misses, cache.hits, len(cache)) == (distinct, 2 * n - distinct, distinct)

    small = vision.DetectionCache(max_frames=2)
    a, b, c = list({f.tobytes(): f for r in reqs for f in r.frames}.values())[:3]  # three different frames
    for f in (a, b, a, c):  # a is used again before c arrives: b goes
        small(f)
    calls.clear()
    small(a), small(c)
    assert (len(small), calls["detect"]) == (2, 0)
    small(b)
    assert calls["detect"] == 1
