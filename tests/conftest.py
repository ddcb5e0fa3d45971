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


def make_synth_world(folder, videos, seed, duration, questions_per_video):
    """A small M1-Synth world in `folder`: (folder, questions.jsonl, its questions)."""
    from m1.run import read_questions
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


def pytest_configure(config):
    """One torch thread: on 2 shared cores, tiny models run many times faster single-threaded."""
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    try:
        import torch

        torch.set_num_threads(1)
    except ImportError:
        pass


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
