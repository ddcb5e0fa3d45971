"""The tiny M1-Synth CLIP: captions, training, caching, loading and evaluation with the real tools."""
import json
import random

import numpy as np
import pytest

from m1.synth import clip_train as ct
from m1.synth.world import make_script

# Small but real: one 60 s training world, the default architecture.
QUICK = dict(videos=1, duration=60.0, steps=30, batch_size=64)
# Smaller still, for tests that train more than once.
MINI = dict(videos=1, duration=30.0, steps=6, batch_size=16, vision_width=64, vision_layers=1,
            text_width=32, text_layers=1, embed_dim=32)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    return ct.train_clip(tmp_path_factory.mktemp("synth-clip"), seed=0, progress=False, **QUICK)


def _metrics(folder):
    return json.loads((folder / ct.METRICS).read_text())


def test_captions_are_true_of_their_frame_and_selective():
    script = make_script(3, duration=120.0)
    rng = random.Random(0)
    frames = [ct.describe(script, t) for t in np.arange(0, 120, 0.5)]
    assert sum(1 for f in frames if f.things) > 100  # the world is mostly populated
    caps = [ct.sample_caption(f, rng) for f in frames]
    m = ct.match_matrix(caps, frames)
    assert m.shape == (len(caps), len(frames)) and np.all(np.diag(m) == 1)
    assert m.mean() < 0.3  # a caption is not true of most frames
    for c, f in zip(caps, frames):
        names = [f"{t.colour} {t.shape}" for t in f.things]
        assert any(n in c.text for n in names) if f.things else ("background" in c.text or "frame" in c.text)


def test_caption_constraints():
    red_tl = ct.Thing("red", "square", "large", "top left")
    blue_br = ct.Thing("blue", "circle", "small", "bottom right")
    both = ct.FrameDesc("grey", (red_tl, blue_br))
    only_red = ct.FrameDesc("navy", (ct.Thing("red", "square", "small", "bottom left"),))
    empty = ct.FrameDesc("grey", ())
    pos = ct.Caption("a red square at the top left", (ct.Thing("red", "square", "", "top left"),))
    assert pos.matches(both) and not pos.matches(only_red)
    pair = ct.Caption("a red square and a blue circle", (ct.Thing("red", "square", "", ""),
                                                         ct.Thing("blue", "circle", "", "")))
    assert pair.matches(both) and not pair.matches(only_red)
    bg = ct.Caption("a red square on a navy background", (ct.Thing("red", "square", "", ""),), "navy")
    assert bg.matches(only_red) and not bg.matches(both)
    nothing = ct.Caption("an empty grey background", (), "grey", True)
    assert nothing.matches(empty) and not nothing.matches(both)


def test_params_are_validated_and_hashed():
    with pytest.raises(ValueError, match="unknown synth CLIP parameter"):
        ct.clip_params(layers=3)
    with pytest.raises(ValueError, match="multiple of patch_size"):
        ct.clip_params(image_size=60)
    assert ct.params_hash({}) == ct.params_hash(dict(ct.DEFAULTS))
    assert ct.params_hash({"steps": 10}) != ct.params_hash({"steps": 11})


@pytest.mark.slow
def test_folder_loads_through_open_clip_model(trained):
    from m1.models.clip import OpenClipModel
    from m1.synth.render import render_frame

    spec = ct.model_spec(trained)
    assert spec.clip_name.endswith(".json") and spec.pretrained.endswith(ct.CHECKPOINT)
    model = OpenClipModel(spec, "synth-clip")
    script = make_script(5, duration=60.0)
    frames = np.stack([render_frame(script, t) for t in (1.0, 10.0, 20.0)])
    img = model.encode_images(frames)
    txt = model.encode_texts(["the red square", "a blue circle at the top left"])
    assert img.shape == (3, 64) and txt.shape == (2, 64)
    assert np.allclose(np.linalg.norm(img, axis=1), 1, atol=1e-5)
    assert np.allclose(np.linalg.norm(txt, axis=1), 1, atol=1e-5)
    # the checkpoint was really loaded: weights differ from a fresh random init
    rand = OpenClipModel(spec.model_copy(update={"pretrained": None}), "random")
    assert not np.allclose(rand.encode_texts(["the red square"]), txt[:1], atol=1e-3)


@pytest.mark.slow
def test_loss_decreases_and_metrics_written(trained):
    m = _metrics(trained)
    losses = m["losses"]
    assert len(losses) == QUICK["steps"] and all(np.isfinite(losses))
    assert np.mean(losses[-5:]) < np.mean(losses[:5]) - 0.2
    assert m["params"]["steps"] == QUICK["steps"] and m["frames"] > 0 and m["train_seconds"] > 0
    manifest = json.loads((trained / ct.MANIFEST).read_text())
    assert (trained / manifest["config"]).is_file() and (trained / manifest["checkpoint"]).is_file()


@pytest.mark.slow
def test_deterministic_given_seed(tmp_path):
    a = _metrics(ct.train_clip(tmp_path / "a", seed=7, progress=False, **MINI))["losses"]
    b = _metrics(ct.train_clip(tmp_path / "b", seed=7, progress=False, **MINI))["losses"]
    c = _metrics(ct.train_clip(tmp_path / "c", seed=8, progress=False, **MINI))["losses"]
    assert a == b
    assert a != c


@pytest.mark.slow
def test_ensure_reuses_folder(tmp_path, monkeypatch):
    monkeypatch.setenv("M1_CACHE", str(tmp_path / "cache"))
    first = ct.ensure_synth_clip(progress=False, **MINI)  # $M1_CACHE/synth-clip/<hash of the training parameters>
    assert first == tmp_path / "cache" / "synth-clip" / ct.params_hash(MINI) and (first / ct.MANIFEST).is_file()
    assert [p.name for p in first.parent.iterdir()] == [first.name]  # no temp folder left behind

    def boom(*a, **k):
        raise AssertionError("ensure_synth_clip retrained an existing folder")

    monkeypatch.setattr(ct, "train_clip", boom)
    assert ct.ensure_synth_clip(progress=False, **MINI) == first
    with pytest.raises(AssertionError, match="retrained"):  # other params -> a new build
        ct.ensure_synth_clip(progress=False, **{**MINI, "seed": 1})
    assert [p.name for p in first.parent.iterdir()] == [first.name]  # failed build cleaned up


def test_model_files_needs_a_finished_folder(tmp_path):
    with pytest.raises(FileNotFoundError, match="not a finished synth CLIP folder"):
        ct.model_files(tmp_path)


@pytest.mark.slow
def test_evaluate_returns_rates(trained):
    r = ct.evaluate_clip(trained, videos=1, seed=11, duration=60.0)
    for name in ("trained", "random", "chance"):
        for key in ("video_r1", "image_hit"):
            assert 0.0 <= r[name][key] <= 1.0, (name, key, r[name][key])
    assert r["trained"]["n"] == len(r["rows"]) > 0
    assert r["trained"]["n"] == r["random"]["n"]
    # rows agree with the summary
    assert r["trained"]["image_hit"] == pytest.approx(np.mean([x["image_hit"] for x in r["rows"]]))
    assert all(x["caption"].startswith("the ") for x in r["rows"])
    assert "trained" in ct.format_table(r) and "random" in ct.format_table(r)


def test_the_default_clip_ships_and_loads_without_training(monkeypatch, tmp_path):
    """The demo's CLIP (the recipe's default parameters) comes with M1: no training on first use."""
    import json

    import numpy as np

    from m1.config import ModelSpec
    from m1.models.clip import SYNTH_CLIP
    from m1.models.hub import ModelHub

    monkeypatch.setenv("M1_CACHE", str(tmp_path))  # a fresh machine's empty cache
    monkeypatch.setattr(ct, "train_clip", lambda *a, **k: (_ for _ in ()).throw(AssertionError("trained")))
    folder = ct.ensure_synth_clip(progress=False)
    assert folder.parent == ct.SHIPPED
    manifest = json.loads((folder / ct.MANIFEST).read_text())
    assert manifest["params"] == ct.clip_params() and folder.name == ct.params_hash({})
    clip = ModelHub({"clip": ModelSpec(interface="clip", backend="open_clip", clip_name=SYNTH_CLIP, device="cpu")}).clip("clip")
    emb = clip.encode_texts(["a red square on the left"])
    assert emb.shape == (1, 64) and np.allclose(np.linalg.norm(emb, axis=1), 1.0, atol=1e-5)
