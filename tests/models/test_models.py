"""Model backends on tiny random models built offline: batching, padding, log-probs, the hub."""
from __future__ import annotations

import os
import sys

os.environ["HF_HUB_OFFLINE"] = "1"

import numpy as np
import pytest

from m1.config import ModelSpec, TinySpec
from m1.models.base import ChatRequest, Completion, ModelError, SamplingParams, VisionRequest
from m1.models.hub import ModelHub

SPECS = {
    "q2": ModelSpec(interface="chat", tiny=TinySpec(arch="qwen2")),
    "q3": ModelSpec(interface="chat", tiny=TinySpec(arch="qwen3")),
    "vl": ModelSpec(interface="vision", tiny=TinySpec(arch="qwen2_5_vl")),
    "clip": ModelSpec(interface="clip", backend="open_clip", tiny=TinySpec(arch="open_clip", image_size=64)),
}

CHATS = [
    ChatRequest([{"role": "user", "content": "Hi"}]),
    ChatRequest([{"role": "system", "content": "You are an agent in a team that answers questions "
                                               "about a video."},
                 {"role": "user", "content": "Question: What colour is the first shape? "
                                             "Options: (A) red (B) green (C) blue (D) yellow"}]),
    ChatRequest([{"role": "user", "content": "Plan the tools. ##tool use:"}]),
]


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    with pytest.MonkeyPatch.context() as mp:
        d = tmp_path_factory.mktemp("m1cache")
        mp.setenv("M1_CACHE", str(d))
        yield d


@pytest.fixture(scope="module")
def hub(cache_dir):
    return ModelHub(SPECS)


# ---------------------------------------------------------------- tokenizer


def test_tokenizer_is_deterministic_and_round_trips_the_chat_template(tmp_path):
    from transformers import AutoTokenizer

    from m1.models.tiny import SPECIAL_TOKENS, build_tokenizer

    tok = build_tokenizer()
    assert tok.get_vocab() == build_tokenizer().get_vocab()
    tok.save_pretrained(tmp_path)
    tok = AutoTokenizer.from_pretrained(tmp_path)
    assert tok.eos_token == "<|im_end|>" and tok.pad_token == "<|endoftext|>"
    assert tok.padding_side == "left"
    for s in SPECIAL_TOKENS:  # each special is one token
        assert len(tok.encode(s, add_special_tokens=False)) == 1, s
    msgs = [{"role": "system", "content": "Answer briefly."},
            {"role": "user", "content": [{"type": "video"}, {"type": "image"},
                                         {"type": "text", "text": "What moves left?"}]}]
    text = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert text == ("<|im_start|>system\nAnswer briefly.<|im_end|>\n<|im_start|>user\n"
                    "<|vision_start|><|video_pad|><|vision_end|>"
                    "<|vision_start|><|image_pad|><|vision_end|>What moves left?<|im_end|>\n"
                    "<|im_start|>assistant\n")
    ids = tok.encode(text, add_special_tokens=False)
    assert tok.decode(ids) == text
    # The built-in corpus makes the planning vocabulary cheap.
    line = "##tool use: <Video Retrieval>, <Rough Browser>"
    assert len(tok.encode(line, add_special_tokens=False)) <= len(line) // 3


# ---------------------------------------------------------------- chat


@pytest.mark.parametrize("key", ["q2", "q3"])
def test_batched_greedy_is_one_call_and_matches_single_calls(hub, key):
    model = hub.chat(key)
    params = SamplingParams(max_new_tokens=10)
    before = model.calls
    batch = model.generate(CHATS, params)
    assert model.calls == before + 1
    singles = [model.generate([r], params)[0] for r in CHATS]
    assert model.calls == before + 1 + len(CHATS)
    tok = model.tokenizer
    lengths = set()
    for req, b, s in zip(CHATS, batch, singles):
        assert isinstance(b, Completion)
        assert b.completion_ids == s.completion_ids  # left padding does not change the result
        np.testing.assert_allclose(b.logprobs, s.logprobs, atol=1e-4)
        expected_prompt = tok(model.render(req), add_special_tokens=False)["input_ids"]
        assert b.prompt_ids == expected_prompt  # no padding inside
        lengths.add(len(b.prompt_ids))
        assert tok.pad_token_id not in b.prompt_ids
        assert b.text == tok.decode(b.completion_ids, skip_special_tokens=True)
        assert len(b.logprobs) == len(b.completion_ids) > 0
        assert all(lp <= 0.0 for lp in b.logprobs)
        ends_with_eos = b.completion_ids[-1] in model.eos_ids
        assert b.finish_reason == ("stop" if ends_with_eos else "length")
        if not ends_with_eos:
            assert len(b.completion_ids) == params.max_new_tokens
    assert len(lengths) == 3  # the prompts really had different lengths
    # Tiny models are initialised to give varied outputs, so the comparison above means something.
    assert len({tuple(b.completion_ids) for b in batch}) > 1


def test_qwen3_template_accepts_enable_thinking(hub):
    text = hub.chat("q3").render(CHATS[0])
    assert text.endswith("<|im_start|>assistant\n")


def test_sampling_is_reproducible_and_logprobs_match_the_tempered_policy(hub):
    import torch

    model = hub.chat("q2")
    p = SamplingParams(max_new_tokens=8, temperature=0.7, top_p=0.9, seed=11)
    a = model.generate(CHATS, p)
    b = model.generate(CHATS, p)
    c = model.generate(CHATS, SamplingParams(max_new_tokens=8, temperature=0.7, top_p=0.9, seed=12))
    assert [x.completion_ids for x in a] == [x.completion_ids for x in b]
    assert [x.completion_ids for x in a] != [x.completion_ids for x in c]
    # Documented meaning: log_softmax(logits / T) of the chosen token, before top_p filtering.
    one = a[1]
    ids = torch.tensor([one.prompt_ids + one.completion_ids])
    with torch.no_grad():
        logits = model.model(input_ids=ids).logits[0].float()
    n = len(one.prompt_ids)
    lp = torch.log_softmax(logits[n - 1:-1] / 0.7, dim=-1)
    want = lp.gather(1, torch.tensor(one.completion_ids)[:, None])[:, 0].tolist()
    np.testing.assert_allclose(one.logprobs, want, atol=1e-4)


def test_logprobs_can_be_switched_off(hub):
    out = hub.chat("q2").generate(CHATS[:1], SamplingParams(max_new_tokens=4, logprobs=False))
    assert out[0].logprobs is None and len(out[0].completion_ids) >= 1


def test_prompt_budget_overlong_prompt_is_refused_not_cut(hub, monkeypatch):
    """A prompt that does not fit the context is an error naming the model, never cut from the front (which would lose
    the system prompt and the question); the team's limits.max_prompt_tokens trims before it gets here."""
    model = hub.chat("q2")
    monkeypatch.setattr(model, "context_length", 40)
    long = ChatRequest([{"role": "user", "content": "a red square moves left " * 30}])
    with pytest.raises(ModelError, match=r"model 'q2': a prompt of \d+ tokens and 8 new tokens do not fit its context "
                                         r"of 40 tokens; prompts are never cut"):
        model.generate([CHATS[0], long], SamplingParams(max_new_tokens=8))
    short = model.generate([CHATS[0]], SamplingParams(max_new_tokens=8))[0]
    assert short.prompt_ids == model.tokenizer(model.render(CHATS[0]), add_special_tokens=False)["input_ids"]


def test_ensure_tiny_is_idempotent_and_keyed_by_spec(cache_dir, monkeypatch):
    from m1.models import tiny

    spec = TinySpec(arch="qwen2", hidden_size=32, heads=2, kv_heads=1, layers=1)
    first = tiny.ensure_tiny(spec, cache_dir)
    stamp = (first / "model.safetensors").stat().st_mtime_ns

    def no_rebuild(*a, **k):
        raise AssertionError("rebuilt a model that was already in the cache")

    monkeypatch.setattr(tiny, "_build_text", no_rebuild)
    assert tiny.ensure_tiny(spec, cache_dir) == first
    assert (first / "model.safetensors").stat().st_mtime_ns == stamp
    assert first.name.startswith("qwen2-")
    other = TinySpec(arch="qwen2", hidden_size=32, heads=2, kv_heads=1, layers=1, seed=1)
    assert tiny.spec_hash(other) != tiny.spec_hash(spec)
    assert not [p for p in cache_dir.iterdir() if p.name.startswith(".")]  # no temp dirs left


def test_ensure_tiny_rejects_bad_head_split(tmp_path):
    from m1.models.tiny import ensure_tiny

    with pytest.raises(ModelError, match="hidden_size 30"):
        ensure_tiny(TinySpec(arch="qwen2", hidden_size=30, heads=4), tmp_path)
    assert list(tmp_path.iterdir()) == []  # the failed build left nothing behind


# ---------------------------------------------------------------- vision


def _frames(n, h, w, seed):
    return np.random.default_rng(seed).integers(0, 255, (n, h, w, 3), dtype=np.uint8)


def test_vision_describe_batches_odd_and_even_frame_counts(hub):
    model = hub.vision("vl")
    reqs = [VisionRequest(_frames(3, 56, 56, 0), [0.0, 2.0, 4.0], "What happens?"),
            VisionRequest(_frames(4, 64, 80, 1), [10.0, 10.5, 11.0, 11.5], "Describe the shapes.",
                          system="Be brief.")]
    params = SamplingParams(max_new_tokens=6)
    before = model.calls
    out = model.describe(reqs, params)
    assert model.calls == before + 1
    assert [o.meta["frames"] for o in out] == [3, 4]
    assert [o.meta["padded_frames"] for o in out] == [4, 4]
    assert out[0].meta["fps"] == pytest.approx(0.5) and out[1].meta["fps"] == pytest.approx(2.0)
    prompt0 = model.tokenizer.decode(out[0].prompt_ids)
    assert "0.0s, 2.0s, 4.0s" in prompt0 and "What happens?" in prompt0
    assert "Be brief." in model.tokenizer.decode(out[1].prompt_ids)
    for o in out:
        assert 0 < len(o.completion_ids) <= 6 and len(o.logprobs) == len(o.completion_ids)
        assert o.text == model.tokenizer.decode(o.completion_ids, skip_special_tokens=True)
    singles = [model.describe([r], params)[0] for r in reqs]
    assert [s.completion_ids for s in singles] == [o.completion_ids for o in out]


def test_vision_max_pixels_caps_video_tokens(hub, cache_dir):
    from m1.models.hf import HFVisionModel

    big = VisionRequest(_frames(2, 112, 112, 2), [0.0, 1.0], "What is shown?")
    full = hub.vision("vl").describe([big], SamplingParams(max_new_tokens=2))[0]
    capped_model = HFVisionModel(SPECS["vl"].model_copy(update={"max_pixels": 56 * 56}), "vl-small")
    capped = capped_model.describe([big], SamplingParams(max_new_tokens=2))[0]
    vid = capped_model.tokenizer.convert_tokens_to_ids("<|video_pad|>")
    assert full.prompt_ids.count(vid) == 16 and capped.prompt_ids.count(vid) == 4


def test_vision_rejects_mismatched_timestamps(hub):
    with pytest.raises(ModelError, match="3 frames but 2 timestamps"):
        hub.vision("vl").describe([VisionRequest(_frames(3, 56, 56, 0), [0.0, 1.0], "x")],
                                  SamplingParams(max_new_tokens=2))


# ---------------------------------------------------------------- clip


def test_open_clip_shapes_norms_and_determinism(hub):
    model = hub.clip("clip")
    frames = _frames(5, 48, 72, 3)
    frames[4] = frames[1]
    model.batch_size = 2  # 3 batches
    emb = model.encode_images(frames)
    assert emb.shape == (5, model.dim) and emb.dtype == np.float32
    np.testing.assert_allclose(np.linalg.norm(emb, axis=1), 1.0, atol=1e-5)
    np.testing.assert_allclose(emb[4], emb[1], atol=1e-6)
    assert not np.allclose(emb[0], emb[1])
    model.batch_size = 64
    np.testing.assert_allclose(model.encode_images(frames), emb, atol=1e-5)
    txt = model.encode_texts(["a red square", "a blue circle moves left", "a red square"])
    assert txt.shape == (3, model.dim)
    np.testing.assert_allclose(np.linalg.norm(txt, axis=1), 1.0, atol=1e-5)
    np.testing.assert_allclose(txt[0], txt[2], atol=1e-6)
    assert model.encode_texts([]).shape == (0, model.dim)


def test_open_clip_loads_a_saved_checkpoint_by_config_path(hub, cache_dir):
    from m1.models.clip import OpenClipModel
    from m1.models.tiny import CLIP_CHECKPOINT, clip_config_name, ensure_tiny

    tiny = SPECS["clip"].tiny
    folder = ensure_tiny(tiny)
    spec = ModelSpec(interface="clip", backend="open_clip",
                     clip_name=str(folder / f"{clip_config_name(tiny)}.json"),
                     pretrained=str(folder / CLIP_CHECKPOINT))
    again = OpenClipModel(spec, "clip-by-path")
    frames = _frames(2, 64, 64, 4)
    np.testing.assert_allclose(again.encode_images(frames), hub.clip("clip").encode_images(frames),
                               atol=1e-6)


# ---------------------------------------------------------------- hub


def test_hub_loads_once_and_shares(hub):
    a = hub.chat("q2")
    b = hub.chat("q2")
    assert a is b and hub.loads["q2"] == 1


def test_hub_errors_name_the_key():
    hub = ModelHub({"c": SPECS["q2"], "v": SPECS["vl"]})
    with pytest.raises(ModelError, match=r"unknown model key 'nope' \(known: \['c', 'v'\]\)"):
        hub.chat("nope")
    with pytest.raises(ModelError, match="'v' is a vision model, asked for as a chat model"):
        hub.chat("v")
    with pytest.raises(ModelError, match="'c' is a chat model, asked for as a clip model"):
        hub.clip("c")
    assert hub.loaded() == []  # nothing was built on the way to those errors


def test_hub_missing_backend_module_is_a_model_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "m1.models.vllm_offline", None)  # import now raises ImportError
    hub = ModelHub({"big": ModelSpec(interface="chat", backend="vllm", path="/models/qwen")})
    with pytest.raises(ModelError, match=r"model 'big': backend 'vllm' is unavailable"):
        hub.chat("big")
    hub = ModelHub({"s": ModelSpec(interface="chat", backend="open_clip", clip_name="x")})
    with pytest.raises(ModelError, match=r"model 's': backend 'open_clip' has no chat models"):
        hub.chat("s")


def test_hub_register_injects_a_model():
    class Fake:
        name = "fake"

        def generate(self, requests, params):
            return [Completion(text="##Answer: A") for _ in requests]

    hub = ModelHub({"c": SPECS["q2"]})
    fake = Fake()
    hub.register("c", fake)
    hub.register("extra", fake)
    assert hub.chat("c") is fake and hub.chat("extra") is fake
    assert hub.chat("c").generate([CHATS[0]], SamplingParams())[0].text == "##Answer: A"
    with pytest.raises(ModelError, match="'extra' is a chat model"):
        hub.vision("extra")


def test_building_a_tiny_model_leaves_the_callers_random_state_alone(cache_dir):
    """A cold cache must not change what a run draws afterwards (its losses would differ from a warm-cache run)."""
    import torch

    from m1.models.tiny import ensure_tiny

    torch.manual_seed(123)
    want = torch.rand(3)
    torch.manual_seed(123)
    ensure_tiny(TinySpec(arch="qwen3", hidden_size=32, layers=1, heads=2, kv_heads=1, seed=77), cache_dir)
    assert torch.equal(torch.rand(3), want)


# ---------------------------------------------------------------- distinct rollouts (per-request seeds)
def test_distinct_rollouts_k_copies_differ_and_do_not_depend_on_batching(hub, monkeypatch):
    """K copies of a prompt in one call sample K different completions, and each request's sample depends on its
    seed only: the same call cut into batches of 2 (or run as single requests with the seeds stamped) gives the
    same tokens and log-probs. With one seed per batch, the two batches [q0, q0] and [q0, q0] would be identical."""
    from m1.models.base import with_seeds

    model = hub.chat("q2")
    p = SamplingParams(max_new_tokens=12, temperature=1.0, seed=5)
    k4 = [CHATS[1]] * 4
    whole = model.generate(k4, p)
    assert len({tuple(o.completion_ids) for o in whole}) == 4
    monkeypatch.setattr(model, "max_batch", 2)
    chunked = model.generate(k4, p)
    assert [o.completion_ids for o in chunked] == [o.completion_ids for o in whole]
    stamped = with_seeds(k4, p)
    alone = [model.generate([r], SamplingParams(max_new_tokens=12, temperature=1.0, seed=999))[0] for r in stamped]
    assert [o.completion_ids for o in alone] == [o.completion_ids for o in whole]
    for a, b in zip(alone, whole):
        np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-4)


def test_distinct_rollouts_remote_chat_stamps_seeds_before_splitting_over_ranks(monkeypatch):
    """`RemoteChat` over 2 ranks sends each request with the seed of its place in the whole call: requests ordered
    q0 x4, q1 x4 reach the ranks as [q0 x4] with the call's seeds 0..3 and [q1 x4] with seeds 4..7, so the answers equal what
    one rank would give (here a fake rank echoes the seed it was given)."""
    from m1.models.base import mix_seed

    import m1.marl.actor.groups as groups

    class Rank:
        def __init__(self):
            self.generate = self
            self.seen = []

        def remote(self, requests, params):
            self.seen.append([r.seed for r in requests])
            return [Completion(text=f"{r.messages[0]['content']}:{r.seed}") for r in requests]

    class FakeRay:
        @staticmethod
        def get(refs):
            return refs

    monkeypatch.setattr(groups, "_require_ray", lambda: FakeRay)
    reqs = [ChatRequest([{"role": "user", "content": q}]) for q in ["q0"] * 4 + ["q1"] * 4]
    p = SamplingParams(temperature=1.0, seed=100)
    one, two = groups.RemoteChat("a", [Rank()]), groups.RemoteChat("a", [Rank(), Rank()])
    seeds = [mix_seed(100, i) for i in range(8)]
    want = [f"{q}:{s}" for q, s in zip(["q0"] * 4 + ["q1"] * 4, seeds)]
    assert [c.text for c in one.generate(reqs, p)] == want
    assert [c.text for c in two.generate(reqs, p)] == want
    assert [r.seen for r in two._actors] == [[seeds[:4]], [seeds[4:]]]


@pytest.mark.parametrize("sampler", ["m1", "transformers"])
def test_generation_keeps_no_logits_yet_returns_exact_logprobs(hub, monkeypatch, sampler):
    """Log-probs are recorded step by step (one step's [B, V] held at a time), so `generate` is never asked for every
    step's logits (B x T x 151,936 fp32 at the paper's vocabulary); the values are still the tempered policy's, on
    both samplers (m1/models/sampler.py, and transformers' generate when prefix_cache_mb is 0)."""
    import torch

    model = hub.chat("q3")
    seen = []
    real = model.model.generate

    def spy(**kw):
        out = real(**kw)
        seen.append((kw.get("output_logits"), kw.get("output_scores"), getattr(out, "logits", None)))
        return out

    monkeypatch.setattr(model.model, "generate", spy)
    if sampler == "transformers":
        monkeypatch.setattr(model, "sampler", None)
    out = model.generate([CHATS[1]], SamplingParams(max_new_tokens=6, temperature=0.9, seed=3))[0]
    assert seen == ([(False, None, None)] if sampler == "transformers" else [])
    ids = torch.tensor([out.prompt_ids + out.completion_ids])
    with torch.no_grad():
        logits = model.model(input_ids=ids).logits[0].float()
    n = len(out.prompt_ids)
    want = torch.log_softmax(logits[n - 1:-1] / 0.9, dim=-1).gather(1, torch.tensor(out.completion_ids)[:, None])
    np.testing.assert_allclose(out.logprobs, want[:, 0].tolist(), atol=1e-4)
