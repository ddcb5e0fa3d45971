"""The on-disk CLIP embedding cache: reuse across indexes and processes, content-hash keys,
damaged files recomputed with a warning, atomic merged writes."""
import os
import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest

from tests.conftest import make_video
from tests.fakes import FakeClip
from m1.tools.clip_index import ClipCacheWarning, ClipIndex, file_sha256, model_fingerprint
from m1.video import VideoPool

REPO = Path(__file__).resolve().parents[2]


def reader_of(path):
    return VideoPool().open(str(path))


def cache_files(root):
    return sorted(p for p in Path(root).rglob("*.npz"))


def test_second_index_makes_no_image_encoder_calls(video_24_frames, tmp_path):
    cache = tmp_path / "cache"
    idx = list(range(0, 24, 2))
    first_model = FakeClip()
    first = ClipIndex(first_model, cache_dir=cache)
    a = first.frame_embeddings(reader_of(video_24_frames), idx)
    assert first_model.image_calls == 1 and first.images_encoded == 12 and first.disk_writes == 1
    [f] = cache_files(cache)
    assert f.name == f"{file_sha256(video_24_frames)}.npz" and f == first.cache_path(file_sha256(video_24_frames))

    second_model = FakeClip()
    second = ClipIndex(second_model, cache_dir=cache)  # new index, new model object, new reader
    b = second.frame_embeddings(reader_of(video_24_frames), idx[::-1])
    assert second_model.image_calls == 0 and second.images_encoded == 0
    assert second.disk_loaded == 12 and second.disk_writes == 0
    np.testing.assert_array_equal(b, a[::-1])
    s = second.scores(reader_of(video_24_frames), idx, "a white square")
    assert s.shape == (12,) and second_model.image_calls == 0


def test_fresh_process_reuses_the_cache(video_24_frames, tmp_path):
    cache = tmp_path / "cache"
    ClipIndex(FakeClip(), cache_dir=cache).frame_embeddings(reader_of(video_24_frames), list(range(24)))
    code = (
        "import sys; sys.path.insert(0, sys.argv[1])\n"
        "from tests.fakes import FakeClip\n"
        "from m1.tools.clip_index import ClipIndex\n"
        "from m1.video import VideoPool\n"
        "m = FakeClip(); ix = ClipIndex(m, cache_dir=sys.argv[2])\n"
        "e = ix.frame_embeddings(VideoPool().open(sys.argv[3]), list(range(24)))\n"
        "print(m.image_calls, ix.images_encoded, ix.disk_loaded, e.shape[0])\n")
    out = subprocess.run([sys.executable, "-c", code, str(REPO), str(cache), str(video_24_frames)], cwd=REPO,
                         capture_output=True, text=True, timeout=120, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["0", "0", "24", "24"]


def test_only_new_frames_are_encoded_and_the_file_grows(video_24_frames, tmp_path):
    cache = tmp_path / "cache"
    ClipIndex(FakeClip(), cache_dir=cache).frame_embeddings(reader_of(video_24_frames), list(range(10)))
    model = FakeClip()
    ix = ClipIndex(model, cache_dir=cache)
    ix.frame_embeddings(reader_of(video_24_frames), list(range(5, 15)))
    assert ix.disk_loaded == 10 and ix.images_encoded == 5
    with np.load(cache_files(cache)[0]) as data:
        assert data["indices"].tolist() == list(range(15))
        assert data["embeddings"].shape == (15, 4) and data["embeddings"].dtype == np.float32


def test_writes_merge_with_rows_another_index_added(video_24_frames, tmp_path):
    cache = tmp_path / "cache"
    a, b = ClipIndex(FakeClip(), cache_dir=cache), ClipIndex(FakeClip(), cache_dir=cache)
    r = reader_of(video_24_frames)
    a.frame_embeddings(r, [0, 1, 2])
    b.frame_embeddings(r, [20, 21])  # b read the cache already holding a's rows
    a.frame_embeddings(r, [3])  # a's next write keeps b's rows
    with np.load(cache_files(cache)[0]) as data:
        assert data["indices"].tolist() == [0, 1, 2, 3, 20, 21]
    assert not [p for p in Path(cache).rglob("*") if p.name.endswith(".tmp")]


def test_changed_content_gets_a_new_key_and_same_content_shares_it(tmp_path):
    cache = tmp_path / "cache"
    path = make_video(tmp_path / "v.mp4", seconds=6, fps=4, size=32)
    old_sha = file_sha256(path)
    ix = ClipIndex(FakeClip(), cache_dir=cache)
    old = ix.frame_embeddings(reader_of(path), [0, 8, 16])
    copy = tmp_path / "copy.mp4"
    copy.write_bytes(path.read_bytes())
    model = FakeClip()
    ClipIndex(model, cache_dir=cache).frame_embeddings(reader_of(copy), [0, 8, 16])
    assert model.image_calls == 0  # keyed by content, not by path

    make_video(path, seconds=6, fps=4, size=48)  # new bytes at the same path
    new_sha = file_sha256(path)
    assert new_sha != old_sha
    model = FakeClip()
    fresh = ClipIndex(model, cache_dir=cache)
    fresh.frame_embeddings(reader_of(path), [0, 8, 16])
    assert model.image_calls == 1 and fresh.images_encoded == 3 and fresh.disk_loaded == 0
    assert {p.stem for p in cache_files(cache)} == {old_sha, new_sha}
    # the first index notices the change on its next call instead of serving stale rows;
    # the new content's rows are on disk already (written by `fresh`)
    again = ix.frame_embeddings(VideoPool().open(str(path)), [0, 8, 16])
    assert ix.images_encoded == 3 and ix.disk_loaded == 3
    np.testing.assert_allclose(again, fresh.frame_embeddings(reader_of(path), [0, 8, 16]))
    assert not np.allclose(again, old)


def test_another_model_gets_another_file(video_24_frames, tmp_path):
    cache = tmp_path / "cache"
    ClipIndex(FakeClip(), cache_dir=cache).frame_embeddings(reader_of(video_24_frames), [0, 1])
    model = FakeClip()
    other = ClipIndex(model, cache_dir=cache, model_id="fakeclip retrained")
    other.frame_embeddings(reader_of(video_24_frames), [0, 1])
    assert model.image_calls == 1 and len(cache_files(cache)) == 2
    assert len({p.parent for p in cache_files(cache)}) == 2


def test_rows_of_another_width_are_dropped_and_recomputed(video_24_frames, tmp_path):
    class WideClip(FakeClip):  # same id, different output width (e.g. weights swapped in place)
        def encode_images(self, frames):
            return np.tile(super().encode_images(frames), 2) / np.sqrt(2)

    cache = tmp_path / "cache"
    ClipIndex(FakeClip(), cache_dir=cache, model_id="same").frame_embeddings(reader_of(video_24_frames), [0, 1, 2])
    ix = ClipIndex(WideClip(), cache_dir=cache, model_id="same")
    with pytest.warns(ClipCacheWarning, match="dropping the cached rows"):
        e = ix.frame_embeddings(reader_of(video_24_frames), [0, 1, 2, 3])
    assert e.shape == (4, 8) and ix.images_encoded == 4
    with np.load(cache_files(cache)[0]) as data:
        assert data["embeddings"].shape == (4, 8)


def test_fingerprint_follows_the_model_spec():
    from m1.config import ModelSpec

    class Spec:  # a model carrying a ModelSpec, like OpenClipModel
        def __init__(self, seed, device="cpu"):
            self.name = "clip"
            self.spec = ModelSpec(interface="clip", backend="open_clip", device=device,
                                  tiny={"arch": "open_clip", "seed": seed})

    assert model_fingerprint(Spec(1)) == model_fingerprint(Spec(1, device="cuda"))
    assert model_fingerprint(Spec(1)) != model_fingerprint(Spec(2))
    assert model_fingerprint(FakeClip()) != model_fingerprint(Spec(1))


def _garbage(path):
    path.write_bytes(b"this is not an npz file" * 10)


def _truncated(path):
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def _nan_rows(path):
    with np.load(path) as d:
        data = {k: d[k] for k in d.files}
    data["embeddings"][0, 0] = np.nan
    np.savez(path, **data)


def _wrong_shape(path):
    with np.load(path) as d:
        data = {k: d[k] for k in d.files}
    data["embeddings"] = data["embeddings"][:-1]
    np.savez(path, **data)


def _pickled(path):
    np.savez(path, indices=np.array([0], dtype=object), embeddings=np.zeros((1, 4), np.float32),
             model=np.array("x"), video=np.array("y"), version=np.array(1))


@pytest.mark.parametrize("damage", [_garbage, _truncated, _nan_rows, _wrong_shape, _pickled])
def test_damaged_cache_file_is_recomputed_with_a_warning(video_24_frames, tmp_path, damage):
    cache = tmp_path / "cache"
    idx = [0, 5, 10, 15]
    good = ClipIndex(FakeClip(), cache_dir=cache).frame_embeddings(reader_of(video_24_frames), idx)
    [f] = cache_files(cache)
    damage(f)
    model = FakeClip()
    ix = ClipIndex(model, cache_dir=cache)
    with pytest.warns(ClipCacheWarning, match="unreadable CLIP cache file"):
        got = ix.frame_embeddings(reader_of(video_24_frames), idx)
    np.testing.assert_allclose(got, good)
    assert model.image_calls == 1 and ix.images_encoded == 4 and ix.disk_loaded == 0
    # the rewrite repaired the file: the next index loads it silently
    model = FakeClip()
    with warnings.catch_warnings():
        warnings.simplefilter("error", ClipCacheWarning)
        ClipIndex(model, cache_dir=cache).frame_embeddings(reader_of(video_24_frames), idx)
    assert model.image_calls == 0


def test_unwritable_cache_dir_warns_and_keeps_working(video_24_frames, tmp_path):
    not_a_dir = tmp_path / "file"
    not_a_dir.write_text("x")
    ix = ClipIndex(FakeClip(), cache_dir=not_a_dir)
    with pytest.warns(ClipCacheWarning, match="cannot write CLIP cache file"):
        e = ix.frame_embeddings(reader_of(video_24_frames), [1, 2])
    assert e.shape == (2, 4) and ix.disk_writes == 0
    ix.frame_embeddings(reader_of(video_24_frames), [1, 2])  # served from memory, no second encode
    assert ix.images_encoded == 2


def test_without_cache_dir_nothing_touches_disk(video_24_frames, tmp_path, monkeypatch):
    import m1.tools.clip_index as ci

    def no_hash(path):
        raise AssertionError("hashed without a cache_dir")

    monkeypatch.setattr(ci, "file_sha256", no_hash)
    model = FakeClip()
    ix = ClipIndex(model)
    r = reader_of(video_24_frames)
    ix.frame_embeddings(r, [0, 1, 2])
    ix.frame_embeddings(r, [2, 3])
    assert model.image_calls == 2 and ix.images_encoded == 4 and ix.disk_writes == 0
    with pytest.raises(ValueError, match="no cache_dir"):
        ix.cache_path("abc")
