import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("DS_ACCELERATOR", "cpu")

import numpy as np
import pytest


@pytest.fixture(scope="session")
def m1_cache(tmp_path_factory):
    """One cache of tiny models for the whole session (built offline on first use)."""
    d = os.environ.get("M1_TEST_CACHE") or str(tmp_path_factory.mktemp("m1cache"))
    os.environ["M1_CACHE"] = d
    return d


def holds_file_open(reader) -> bool:
    """Whether a VideoReader holds its file open now (a released one opens it again on its next decode)."""
    return reader._backend is not None


def make_video(path, seconds=12, fps=4, size=64):
    """A small mp4 whose background colour steps every second (so frames differ by time)."""
    from m1.video import write_video

    def frames():
        for i in range(int(seconds * fps)):
            s = i // fps
            img = np.zeros((size, size, 3), np.uint8)
            img[:] = ((s * 40) % 256, (s * 90) % 256, (255 - s * 20) % 256)
            img[size // 4: size // 2, size // 4: size // 2] = (255, 255, 255)
            yield img

    return write_video(path, frames(), fps, size, size)


def top_boxes(data: bytes) -> list[tuple[int, bytes, int]]:
    """(offset, type, size) of the top-level boxes of a whole mp4 (32-bit sizes, as PyAV writes small files)."""
    out, pos = [], 0
    while pos + 8 <= len(data):
        size = int.from_bytes(data[pos: pos + 4], "big")
        out.append((pos, data[pos + 4: pos + 8], size))
        pos += size
    return out


def fragmented_mp4(src, dst, mehd_seconds=None):
    """`src` remuxed as a recorder writes it: an empty moov, then one moof+mdat fragment per keyframe (FFmpeg's
    `frag_keyframe+empty_moov`). With `mehd_seconds` the moov also declares the total length in an `mehd` box (as
    MP4Box or GStreamer write it; FFmpeg does not): inserted into moov/mvex, which `default_base_moof` allows, as the
    fragments then address their data from their own moof."""
    import av

    with av.open(str(src)) as inp, av.open(str(dst), "w", format="mp4",
                                           options={"movflags": "frag_keyframe+empty_moov+default_base_moof"}) as out:
        stream = out.add_stream_from_template(inp.streams.video[0])
        for packet in inp.demux(inp.streams.video[0]):
            if packet.dts is not None:
                packet.stream = stream
                out.mux(packet)
    if mehd_seconds is None:
        return dst
    data = bytearray(open(dst, "rb").read())
    [moov] = [pos for pos, kind, _ in top_boxes(bytes(data)) if kind == b"moov"]
    assert data.find(b"mehd") < 0
    mvhd, mvex = data.find(b"mvhd", moov) + 4, data.find(b"mvex", moov) - 4
    assert data[mvhd] == 0  # a version-0 mvhd: timescale at payload offset 12
    timescale = int.from_bytes(data[mvhd + 12: mvhd + 16], "big")
    mehd = (16).to_bytes(4, "big") + b"mehd" + bytes(4) + round(mehd_seconds * timescale).to_bytes(4, "big")
    data[mvex + 8: mvex + 8] = mehd
    for at in (moov, mvex):
        data[at: at + 4] = (int.from_bytes(data[at: at + 4], "big") + len(mehd)).to_bytes(4, "big")
    open(dst, "wb").write(bytes(data))
    return dst


def make_synth_world(folder, videos, seed, duration, questions_per_video):
    """A small M1-Synth world in `folder`: (folder, questions.jsonl, its questions)."""
    from m1.data.questions import read_questions
    from m1.synth.make import make_dataset

    path = make_dataset(folder, videos=videos, seed=seed, duration=duration,
                        questions_per_video=questions_per_video, progress=False)
    qs, issues = read_questions(path, folder)
    assert not issues
    return folder, path, qs


@pytest.fixture
def video_factory(tmp_path):
    def _make(name="v.mp4", **kw):
        return make_video(tmp_path / name, **kw)

    return _make


@pytest.fixture(scope="module")
def video(tmp_path_factory, m1_cache):
    """The trainer tests' video, one per test module: 6 s at 2 fps (12 frames, 64 px), as a str path. It sets up the
    session's tiny-model cache too (`m1_cache`), which the runs on it build their models in."""
    return str(make_video(tmp_path_factory.mktemp("vid") / "v.mp4", seconds=6, fps=2))


@pytest.fixture
def video_24_frames(tmp_path):
    """A fresh video per test: 6 s at 4 fps (24 frames, 32 px), as a Path (the CLIP cache tests index every frame)."""
    return make_video(tmp_path / "v.mp4", seconds=6, fps=4, size=32)


def varied_reward(episodes):
    """A reward that differs between rollouts (random tiny models rarely earn different task rewards): for each agent
    with a generation in the episode, the sum of its completion token ids mod 7. Any team: agents without a
    generation get no reward."""
    out = []
    for e in episodes:
        ids: dict[str, int] = {}
        for g in e.generations:
            ids[g.agent] = ids.get(g.agent, 0) + sum(g.completion_ids)
        out.append({a: float(n % 7) for a, n in ids.items()})
    return out


def is_dag(top) -> bool:
    """A topology's edges have no cycle (Kahn's algorithm): what every sampled training DAG must be."""
    indegree = {a: 0 for a in top.agents}
    for _, b in top.edges:
        indegree[b] += 1
    ready, seen = [a for a, n in indegree.items() if n == 0], 0
    while ready:
        a = ready.pop()
        seen += 1
        for src, b in top.edges:
            if src == a:
                indegree[b] -= 1
                if indegree[b] == 0:
                    ready.append(b)
    return seen == len(indegree)


def pytest_configure(config):
    """One torch thread: on 2 shared cores, tiny models run many times faster single-threaded."""
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    try:
        import torch
        from torch.optim.optimizer import register_optimizer_step_pre_hook

        torch.set_num_threads(1)
        register_optimizer_step_pre_hook(_no_training_outside_slow)
    except ImportError:
        pass


_current_test = []  # the item pytest is running (setup, call and teardown)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    _current_test.append(item)
    try:
        yield
    finally:
        _current_test.pop()


def _no_training_outside_slow(optimizer, args, kwargs):
    """`make test-fast` trains no model: an optimizer step in this process (a GRPO or SFT step, a learner update, an
    experiment stage that trains, in the test or its fixtures) fails a test without the `slow` mark."""
    if _current_test and _current_test[-1].get_closest_marker("slow") is None:
        pytest.fail(f"{_current_test[-1].nodeid} steps an optimizer ({type(optimizer).__name__}): a test that trains "
                    "gets @pytest.mark.slow (make test-fast trains no model; see tests/README.md)", pytrace=False)


@pytest.fixture
def empty_hf_cache(monkeypatch, tmp_path):
    """No hub model in the Hugging Face cache, whatever this machine holds (the check reads it, never downloads)."""
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hf_cache"))


@pytest.fixture(autouse=True)
def _experiment_rows(monkeypatch, tmp_path):
    """Experiments write their committed records into the test's own folder, never the repository's
    docs/experiments (`m1 experiment run`'s default rows_dir)."""
    monkeypatch.setenv("M1_EXPERIMENT_ROWS", str(tmp_path / "experiment_rows"))
