"""The video-reading audit: what M1 reads from a file agrees with what a player shows for it.

Each kind of file users bring is generated here from known pictures and known presentation times, which are the
reference reading: the size and orientation a player shows (FFmpeg's display matrix turns the stored picture
counter-clockwise by the angle it is set with), the time each frame is shown (its timestamp on the file's clock),
the length (the last frame's start plus one frame) and the number of frames. Every reader path is held to it:
decord (when installed), PyAV, the shared frame cache, and `m1 serve`'s media (an uploaded copy of the file, read
as the served team reads it). docs/video_input.md has the table "kind of file -> what M1 reads".
"""
import base64
import importlib.util
from dataclasses import dataclass, field
from fractions import Fraction
from pathlib import Path

import numpy as np
import pytest

from m1.video import FrameCache, VideoError, VideoPool, VideoReader, probe, time_to_index

HAS_DECORD = importlib.util.find_spec("decord") is not None


@dataclass
class Case:
    """A file to write: the pictures a player shows and when, and how the file stores them."""

    shown: list[np.ndarray]  # (H, W, 3) as a player shows each frame
    times: list[float]  # when each frame is first shown, seconds from the file's start
    rate: int  # the stream's time base is 1/rate
    rotate: int = 0  # FFmpeg's display rotation (counter-clockwise degrees) written into the file
    hflip: bool = False
    audio_first: bool = False  # an audio stream before the video, starting at 0 while the video starts later
    pix_fmt: str = "yuv420p"
    patch: list = field(default_factory=list)  # (box type, offset in its payload, bytes): a damaged header

    @property
    def duration(self) -> float:
        gaps = sorted(b - a for a, b in zip(self.times, self.times[1:]))
        return self.times[-1] + (gaps[len(gaps) // 2] if gaps else 1 / self.rate)


def pictures(n: int, w: int, h: int) -> list[np.ndarray]:
    """Frame i: a flat colour of its own, a white block in the top-left corner (orientation), a red block in the
    bottom-right one."""
    out = []
    for i in range(n):
        img = np.zeros((h, w, 3), np.uint8)
        img[:] = ((37 * i) % 200 + 30, (91 * i) % 200 + 30, (53 * i + 100) % 200 + 30)
        img[: h // 3, : w // 3] = 255
        img[-h // 4:, -w // 4:] = (255, 0, 0)
        out.append(img)
    return out


def stored(shown: np.ndarray, rotate: int, hflip: bool) -> np.ndarray:
    """The picture to store so that a player, turning it counter-clockwise by `rotate` (then mirroring), shows
    `shown`."""
    if hflip:
        shown = shown[:, ::-1]
    return np.ascontiguousarray(np.rot90(shown, -(rotate // 90)))


def write_case(path: Path, case: Case) -> Path:
    import av

    h, w = stored(case.shown[0], case.rotate, case.hflip).shape[:2]
    with av.open(str(path), "w", options={"fflags": "+bitexact"}) as container:
        audio = None
        if case.audio_first:
            audio = container.add_stream("aac", rate=16000)
            audio.layout = "mono"
        stream = container.add_stream("libx264", rate=case.rate)
        stream.width, stream.height, stream.pix_fmt = w, h, case.pix_fmt
        stream.options = {"crf": "8", "preset": "veryfast", "threads": "1"}
        if case.rotate or case.hflip:
            stream.set_display_rotation(case.rotate, hflip=case.hflip)
        if audio is not None:  # one second of silence from 0, muxed first
            for k in range(0, 16000, 1024):
                frame = av.AudioFrame.from_ndarray(np.zeros((1, 1024), np.float32), format="fltp", layout="mono")
                frame.sample_rate, frame.pts, frame.time_base = 16000, k, Fraction(1, 16000)
                for packet in audio.encode(frame):
                    container.mux(packet)
        for img, t in zip(case.shown, case.times):
            frame = av.VideoFrame.from_ndarray(stored(img, case.rotate, case.hflip), format="rgb24")
            frame.pts, frame.time_base = round(t * case.rate), Fraction(1, case.rate)
            for packet in stream.encode(frame):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
        if audio is not None:
            for packet in audio.encode():
                container.mux(packet)
    for kind, offset, data in case.patch:
        patch_box(path, kind, offset, data)
    return path


def patch_box(path: Path, kind: bytes, offset: int, data: bytes) -> None:
    """Overwrite bytes at `offset` into the payload of the first box of type `kind` (searched by name)."""
    blob = bytearray(path.read_bytes())
    at = blob.index(kind) + 4 + offset
    blob[at:at + len(data)] = data
    path.write_bytes(bytes(blob))


def cfr(n, fps, w=64, h=48, **kw) -> Case:
    return Case(pictures(n, w, h), [i / fps for i in range(n)], fps, **kw)


# mvhd (version 0): 4 bytes version/flags, creation, modification, timescale, then duration at payload offset 16
CASES = {
    "landscape": cfr(12, 4),
    "portrait": cfr(12, 4, w=48, h=64),
    "phone, turned 90 cw": cfr(12, 4, w=48, h=64, rotate=270),
    "phone, upside down (180)": cfr(12, 4, rotate=180),
    "phone, turned 90 ccw": cfr(12, 4, w=48, h=64, rotate=90),
    "mirrored (front camera)": cfr(8, 4, hflip=True),
    "variable frame rate": Case(pictures(10, 64, 48), [0, .1, .2, .3, 1.0, 1.1, 3.0, 3.1, 3.2, 6.0], 10),
    "screen recording": Case(pictures(8, 80, 48), [0, 1 / 30, 2 / 30, 2.0, 2 + 1 / 30, 7.5, 7.6, 12.0], 30,
                             pix_fmt="yuv444p"),
    "header length and rate wrong": Case(pictures(10, 64, 48), [i / 5 for i in range(10)], 5,
                                         patch=[(b"mvhd", 16, (10 ** 6).to_bytes(4, "big"))]),
    # headers that contradict the packets they describe: the movie's timescale, and the track's and media's
    # durations (tkhd at payload offset 20, mdhd at 16): the length still comes from the packets
    "header timescale wrong": Case(pictures(10, 64, 48), [i / 5 for i in range(10)], 5,
                                   patch=[(b"mvhd", 12, (7).to_bytes(4, "big"))]),
    "track and media durations wrong": Case(pictures(10, 64, 48), [i / 5 for i in range(10)], 5,
                                            patch=[(b"tkhd", 20, (10 ** 6).to_bytes(4, "big")),
                                                   (b"mdhd", 16, (10 ** 6).to_bytes(4, "big"))]),
    "long and sparse": Case(pictures(40, 32, 32), [15.0 * i for i in range(40)], 1),
    "audio first, video from 0.5 s": Case(pictures(8, 64, 48), [0.5 + i / 4 for i in range(8)], 4,
                                          audio_first=True),
}


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    d = tmp_path_factory.mktemp("audit")
    return {name: write_case(d / f"{k:02d}.mp4", case) for k, (name, case) in enumerate(CASES.items())}


def frame_of(frame: np.ndarray, case: Case) -> int:
    """Which reference picture a decoded frame is (the nearest by mean difference), and checks it is close."""
    diffs = [np.abs(frame.astype(int) - ref).mean() for ref in case.shown]
    best = int(np.argmin(diffs))
    assert diffs[best] < 8, f"frame is no reference picture (nearest {best}, mean difference {diffs[best]:.1f})"
    return best


def check_reading(reader: VideoReader, case: Case, name: str) -> None:
    info = reader.info
    h, w = case.shown[0].shape[:2]
    assert (info.width, info.height) == (w, h), (name, reader.backend, info)
    assert info.num_frames == len(case.shown), (name, reader.backend, info)
    assert abs(info.duration - case.duration) < 1e-3, (name, reader.backend, info.duration, case.duration)
    got = reader.timestamps(range(info.num_frames))
    assert np.allclose(got, case.times, atol=1e-3), (name, reader.backend, got, case.times)
    frames = reader.frames(range(info.num_frames))
    assert frames.shape == (len(case.shown), h, w, 3)
    assert [frame_of(f, case) for f in frames] == list(range(len(case.shown))), (name, reader.backend)
    for i, t in enumerate(case.times):  # the frame on screen at a time is the one a player shows then
        assert time_to_index(info, t + 1e-3) == i and time_to_index(info, t - 1e-3) == max(i - 1, 0)


BACKENDS = ["pyav"] + (["decord"] if HAS_DECORD else [])
DECORD_REFUSES = {"portrait", "phone, turned 90 cw", "phone, turned 90 ccw", "mirrored (front camera)"}
# kinds decord 0.6.0 cannot read as a player shows them (docs/video_input.md)


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("backend", BACKENDS)
def test_each_reader_reads_each_kind_as_a_player_shows_it(corpus, name, backend):
    """PyAV reads every kind as the reference. decord reads it so too, or refuses it with a VideoError that names
    the problem (the `auto` reader then takes PyAV: the test below); it never returns other pictures or times."""
    case = CASES[name]
    try:
        reader = VideoReader(corpus[name], backend=backend)
        check_reading(reader, case, name)
    except VideoError as exc:
        assert backend == "decord" and name in DECORD_REFUSES, (name, backend, exc)
        assert str(corpus[name]) in str(exc) and "decord" in str(exc)
    else:
        assert name not in DECORD_REFUSES or backend != "decord", f"decord now reads {name!r}: update the table"


@pytest.mark.parametrize("name", list(CASES))
def test_probe_and_the_auto_reader_agree_with_the_reference(corpus, name):
    case, path = CASES[name], corpus[name]
    info = probe(path)
    h, w = case.shown[0].shape[:2]
    assert (info.width, info.height, info.num_frames) == (w, h, len(case.shown))
    assert abs(info.duration - case.duration) < 1e-3
    check_reading(VideoReader(path), case, name)


@pytest.mark.parametrize("name", list(CASES))
def test_the_frame_cache_serves_what_was_decoded(corpus, name):
    """A second reader through the same pool and cache decodes nothing and reads the same pictures."""
    case, path = CASES[name], corpus[name]
    pool = VideoPool(FrameCache(64 << 20))
    reader = pool.open(path)
    first = reader.frames(range(len(case.shown)))
    pool.close()
    again = VideoPool(pool.cache).open(path)
    second = again.frames(range(len(case.shown)))
    assert again.decoded == 0 and np.array_equal(first, second)
    check_reading(again, case, name)


@pytest.mark.parametrize("name", list(CASES))
def test_serve_reads_an_uploaded_copy_as_the_file(corpus, name, tmp_path):
    pytest.importorskip("fastapi")
    from m1.serve import Limits, parse_request

    case, path = CASES[name], corpus[name]
    body = {"messages": [{"role": "user", "content": [
        {"type": "video_url", "video_url": {"url": "data:video/mp4;base64," +
                                            base64.b64encode(path.read_bytes()).decode()}},
        {"type": "text", "text": "What is shown?"}]}]}
    q = parse_request(body, "tiny", Limits(), tmp_path)
    check_reading(VideoReader(q.video), case, name)


def test_a_display_matrix_that_is_not_a_quarter_turn_is_an_error_that_says_so(tmp_path):
    import av

    path = tmp_path / "tilted.mp4"
    with av.open(str(path), "w") as container:
        stream = container.add_stream("libx264", rate=4)
        stream.width, stream.height, stream.pix_fmt = 64, 48, "yuv420p"
        stream.set_display_rotation(30)
        for img in pictures(4, 64, 48):
            for packet in stream.encode(av.VideoFrame.from_ndarray(img, format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    with pytest.raises(VideoError, match="turns the picture by 30 degrees, not a quarter turn"):
        VideoReader(path)


def _avi(path: Path, declared: int | None) -> Path:
    """Ten frames at 5 fps in an AVI whose stream header (`strh` length) may declare another count."""
    import struct

    import av

    with av.open(str(path), "w") as container:
        stream = container.add_stream("libx264", rate=5)
        stream.width, stream.height, stream.pix_fmt = 64, 48, "yuv420p"
        for img in pictures(10, 64, 48):
            for packet in stream.encode(av.VideoFrame.from_ndarray(img, format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    if declared is not None:
        blob = bytearray(path.read_bytes())
        at = blob.index(b"strh") + 8 + 32  # fccType, handler, flags, priority+language, initial frames, scale,
        blob[at:at + 4] = struct.pack("<I", declared)  # rate, start: then the length in frames
        path.write_bytes(bytes(blob))
    return path


@pytest.mark.parametrize("backend", ["auto", "pyav"] + (["decord"] if HAS_DECORD else []))
def test_a_header_frame_count_never_sets_the_length(tmp_path, backend):
    """An AVI's header count of frames contradicting its packets (10 here) never sets the length, on any path.
    Fewer declared than held (5): every path reads what the packets hold. More declared (1000): the file is cut
    short or its header is wrong, an error that says so on every path (probe, each backend), never a length taken
    from the header."""
    clean = _avi(tmp_path / "clean.avi", None)
    reference = VideoReader(clean, backend="pyav").info
    fewer = _avi(tmp_path / "fewer.avi", 5)
    for info in (probe(fewer), VideoReader(fewer, backend=backend).info):
        assert (info.num_frames, info.times) == (10, reference.times)
        assert abs(info.duration - reference.duration) < 1e-6
    more = _avi(tmp_path / "more.avi", 1000)
    for read in (probe, lambda p: VideoReader(p, backend=backend)):
        with pytest.raises(VideoError, match="header lists 1000 frames but the file holds 10"):
            read(more)
