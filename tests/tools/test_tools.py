"""The paper's tool parameters hold on real (generated) videos."""
import numpy as np
import pytest

from tests.fakes import FakeClip, FakeVision
from m1.config import ToolsConfig
from m1.models.base import Completion
from m1.schema import Question
from m1.tools import browse
from m1.tools.base import ToolContext, ToolError
from m1.tools.clip_index import ClipIndex
from m1.tools.select import clip_spans, global_sampling, image_retrieval, time_stamp_retrieval, video_retrieval
from m1.video import VideoPool


@pytest.fixture
def reader(video_factory):
    return VideoPool().open(str(video_factory("long.mp4", seconds=100, fps=4, size=32)))


def ctx(reader, key_info="", text="What happens?", **cfg):
    return ToolContext(question=Question(id="q", video=str(reader.info.path), text=text), video=reader,
                       key_info=key_info, cfg=ToolsConfig(**cfg), clip=ClipIndex(FakeClip()))


def test_global_sampling_uniform(reader):
    r = global_sampling(ctx(reader))
    assert len(r.focus.indices) == 16 and r.focus.span == (0.0, reader.info.duration)
    gaps = np.diff(r.focus.timestamps)
    assert gaps.min() > 5.5 and gaps.max() < 7.0  # 100 s / 16


def test_six_clips_cover_the_video():
    spans = clip_spans(100.0, 6)
    assert len(spans) == 6 and spans[0][0] == 0.0 and spans[-1][1] == 100.0
    assert all(abs(a[1] - b[0]) < 1e-9 for a, b in zip(spans, spans[1:]))
    assert all(abs((e - s) - 100 / 6) < 1e-9 for s, e in spans)


def test_video_retrieval_returns_one_clip(reader):
    r = video_retrieval(ctx(reader, key_info="white square"))
    s, e = r.focus.span
    assert any(abs(s - a) < 1e-6 and abs(e - b) < 1e-6 for a, b in clip_spans(reader.info.duration, 6))
    assert len(r.focus.indices) == 16 and all(s <= t <= e for t in r.focus.timestamps)


def test_video_retrieval_adjacent_clips_above_threshold(reader):
    r = video_retrieval(ctx(reader, key_info="white square", adjacent_threshold=-1.0, max_adjacent_clips=3))
    s, e = r.focus.span
    assert abs((e - s) - 3 * reader.info.duration / 6) < 1e-6  # every clip beats -1: grows to 3
    r = video_retrieval(ctx(reader, key_info="white square", adjacent_threshold=1.01))
    assert abs((r.focus.span[1] - r.focus.span[0]) - reader.info.duration / 6) < 1e-6


@pytest.mark.parametrize("said, span", [("00:50", (20.0, 80.0)), ("00:10", (0.0, 40.0)), ("1:35", (65.0, None))])
def test_time_stamp_window_clipped_at_both_ends(reader, said, span):
    r = time_stamp_retrieval(ctx(reader, key_info=f"what happens at {said}"))
    dur = reader.info.duration
    assert r.focus.span[0] == pytest.approx(span[0])
    assert r.focus.span[1] == pytest.approx(span[1] if span[1] is not None else dur)
    assert all(r.focus.span[0] <= t <= r.focus.span[1] for t in r.focus.timestamps)


def test_time_stamp_needs_a_time(reader):
    with pytest.raises(ToolError, match="no time"):
        time_stamp_retrieval(ctx(reader, key_info="no time here", text="what colour?"))
    with pytest.raises(ToolError, match="past the end"):
        time_stamp_retrieval(ctx(reader, key_info="at 05:00"))


def test_image_retrieval_at_2fps_top_k_in_time_order(reader):
    c = ctx(reader, key_info="white square", image_top_k=16)
    r = image_retrieval(c)
    ts = r.focus.timestamps
    assert len(ts) == 16 and ts == sorted(ts)
    halves = np.array(ts) * 2  # candidates sit on a 2 fps grid
    assert np.allclose(halves, np.round(halves), atol=0.13)
    # the CLIP index embedded every 2 fps candidate once; a second query reuses them all
    n = c.clip.images_encoded
    assert n == pytest.approx(reader.info.duration * 2, abs=2)
    image_retrieval(ctx(reader, key_info="another query", image_top_k=32))
    c2 = ctx(reader, key_info="x")
    c2.clip = c.clip
    image_retrieval(c2)
    assert c.clip.images_encoded == n
    r32 = image_retrieval(ctx(reader, key_info="white square", image_top_k=32))
    assert len(r32.focus.indices) == 32


def test_browsers_frame_counts(reader):
    c = ctx(reader, key_info="square")
    focus = video_retrieval(c).focus
    for tool, n in (("Rough Browser", 16), ("Fine Browser", 32), ("Space Tool", 16)):
        req, idx = browse.prepare(tool, c, focus)
        assert len(idx) == n and req.frames.shape[0] == n and req.frames.shape[-1] == 3
        assert all(focus.span[0] <= t <= focus.span[1] for t in req.timestamps)
    req, idx = browse.prepare("Grounding Tool", c, focus)
    assert len(idx) == 32  # a 16.7 s clip at 2 fps is 33 frames, capped at 32


def test_grounding_span_in_video_time(reader):
    c = ctx(reader)
    focus = video_retrieval(ctx(reader, key_info="q")).focus
    s0 = focus.span[0]
    # a reply counted from the clip start is shifted into video time
    res = browse.finish("Grounding Tool", c, focus, Completion(text="##Timestamp: [1 - 3]"), [])
    if s0 > 3:
        assert res.span == pytest.approx((s0 + 1, s0 + 3))
    inside = f"##Timestamp: [{s0 + 2:.1f} - {s0 + 4:.1f}]"
    res = browse.finish("Grounding Tool", c, focus, Completion(text=inside), [])
    assert res.span == pytest.approx((s0 + 2, s0 + 4), abs=0.05)


def test_browser_answer_line(reader):
    c = ctx(reader)
    focus = global_sampling(c).focus
    res = browse.finish("Rough Browser", c, focus, Completion(text="A red dot. ##Answer: B"), [1, 2])
    assert res.answer == "B" and res.frames == [1, 2]
    res = browse.finish("Rough Browser", c, focus, Completion(text="   "), [])
    assert res.error == "empty browser reply"
