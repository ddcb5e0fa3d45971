"""The hf chat sampler (m1/models/sampler.py) against transformers' generate on tiny random models: the same tokens
greedy and sampled, log-probs within 1e-5, prompt blocks reused across calls only under the weights that made them."""
from __future__ import annotations

import math
from collections import Counter

import numpy as np
import pytest

from m1.config import ModelSpec, TinySpec
from m1.models.base import SamplingParams
from m1.models.hf import HFChatModel
from m1.models.sampler import BLOCK
from m1.marl.actor.learner_io import load_actor, save_actor


@pytest.fixture(scope="module", params=["qwen2", "qwen3"])
def pair(request, m1_cache):
    """(the model with the sampler, the same weights through transformers' generate)."""
    tiny = TinySpec(arch=request.param, seed=3)
    fast = HFChatModel(ModelSpec(interface="chat", tiny=tiny), "fast")
    slow = HFChatModel(ModelSpec(interface="chat", tiny=tiny, prefix_cache_mb=0), "slow")
    assert fast.sampler is not None and slow.sampler is None
    return fast, slow


def _prompts(seed: int) -> list[list[int]]:
    """K copies of one prompt, a longer prompt that extends it (a later phase), two unrelated ones of other lengths."""
    rng = np.random.default_rng(seed)
    head = rng.integers(5, 300, 3 * BLOCK + 5).tolist()
    return [head] * 3 + [head + rng.integers(5, 300, 2 * BLOCK).tolist(),
                         rng.integers(5, 300, 7).tolist(), rng.integers(5, 300, BLOCK + 1).tolist()]


def _run(model, prompts, temperature, seeds, max_new=12):
    params = SamplingParams(max_new_tokens=max_new, temperature=temperature, seed=1)
    return model._generate_batch(prompts, [{} for _ in prompts], params, seeds)


def _same(a, b, tol=1e-5):
    for x, y in zip(a, b, strict=True):
        assert x.completion_ids == y.completion_ids and x.finish_reason == y.finish_reason
        assert x.text == y.text
        np.testing.assert_allclose(x.logprobs, y.logprobs, atol=tol)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_the_sampler_gives_generates_tokens_and_logprobs_over_calls_that_reuse_prefixes(pair, temperature):
    fast, slow = pair
    for call in range(3):  # later calls find the earlier calls' blocks
        prompts = _prompts(call % 2)
        seeds = [100 * call + i for i in range(len(prompts))] if temperature else [None] * len(prompts)
        _same(_run(fast, prompts, temperature, seeds), _run(slow, prompts, temperature, seeds))
    assert fast.sampler.cache.hits >= 3 * BLOCK * 3  # the repeated prompts ran only their tails


@pytest.mark.parametrize("alone", [True, False])
def test_prompts_run_alone_or_batched_to_the_same_tokens(pair, alone, monkeypatch):
    """On CPU a call's distinct prompts run one at a time on their own cached blocks (`PrefixSampler._alone`) when
    that costs less than one padded batch (`_alone_pays`), else batched: forced either way, both give generate's tokens
    with nothing cached and again on the blocks they kept, and those blocks serve the next call alike."""
    fast, slow = pair
    monkeypatch.setattr(fast.sampler, "_alone_pays", lambda hit, tails: alone)
    fast.sampler.cache.clear()
    prompts = _prompts(11)
    for call in range(3):  # later calls run only the tails, on the blocks the first one kept
        hits = fast.sampler.cache.hits
        more = [p + [7 + call] * (5 * call) for p in prompts]  # tails of different lengths on cached parts
        _same(_run(fast, more, 1.0, list(range(6)), 10), _run(slow, more, 1.0, list(range(6)), 10))
        assert (fast.sampler.cache.hits > hits) == (call > 0)


def test_the_padded_batch_costs_more_than_rows_alone_when_their_lengths_differ(pair):
    """`_alone_pays`: a long tail beside short ones on long cached parts (mixed lengths) runs alone; many short
    tails of the same length (K rollouts' last few tokens) stay one batch, whose one call costs less than many."""
    fast, _ = pair
    fast.sampler.model = fast.model
    assert fast.sampler._alone_pays([0, 480, 480, 0], [[5] * 600, [5] * 20, [5] * 30, [5] * 10])
    assert not fast.sampler._alone_pays([64] * 16, [[5] * 3] * 16)


def test_rows_that_stop_early_leave_the_batch_and_the_rest_are_unchanged(pair):
    """A short max_new budget for every row, then a long one: rows reach eos at different steps."""
    fast, slow = pair
    prompts = _prompts(7)
    for max_new in (1, 2, 40):
        got = _run(fast, prompts, 1.0, list(range(10, 16)), max_new)
        _same(got, _run(slow, prompts, 1.0, list(range(10, 16)), max_new))
    if fast.model.config.model_type == "qwen3":  # rows stopped at different steps, so some left the batch early
        assert {o.finish_reason for o in got} == {"stop", "length"}


def test_changed_weights_empty_the_cache(m1_cache):
    """An in-place weight change (what an optimizer step does) must not reuse keys computed before it."""
    import torch

    tiny = TinySpec(arch="qwen3", seed=4)
    fast = HFChatModel(ModelSpec(interface="chat", tiny=tiny), "fast")
    slow = HFChatModel(ModelSpec(interface="chat", tiny=tiny, prefix_cache_mb=0), "slow")
    prompts = _prompts(2)
    _same(_run(fast, prompts, 0.0, [None] * 6), _run(slow, prompts, 0.0, [None] * 6))
    assert fast.sampler.cache.blocks
    with torch.no_grad():
        for model in (fast.model, slow.model):
            for p in model.parameters():
                p.mul_(1.5)
    hits = fast.sampler.cache.hits
    _same(_run(fast, prompts, 0.0, [None] * 6), _run(slow, prompts, 0.0, [None] * 6))
    assert fast.sampler.cache.hits == hits  # nothing was found: the cache was emptied first


def test_the_cache_stays_within_its_bytes(m1_cache):
    tiny = TinySpec(arch="qwen2", seed=5)
    small = HFChatModel(ModelSpec(interface="chat", tiny=tiny, prefix_cache_mb=1), "small")
    slow = HFChatModel(ModelSpec(interface="chat", tiny=tiny, prefix_cache_mb=0), "slow")
    for call in range(5):
        prompts = _prompts(call % 3)
        if call == 1:  # from here on, room for a few blocks only
            block = next(iter(small.sampler.cache.blocks.values()))
            small.sampler.cache.max_bytes = 6 * block.numel() * block.element_size()
        _same(_run(small, prompts, 0.0, [None] * 6), _run(slow, prompts, 0.0, [None] * 6))
        assert small.sampler.cache.bytes <= small.sampler.cache.max_bytes


def test_sampled_first_tokens_follow_the_policy(m1_cache):
    """2,000 seeded draws of the first token of one prompt: each token's frequency is within 4.5 sigma of its
    probability under softmax(logits / T), and the draws of one seed repeat."""
    import torch

    model = HFChatModel(ModelSpec(interface="chat", tiny=TinySpec(arch="qwen3", seed=6)), "m")
    prompt = list(range(10, 30))
    n, temp = 2000, 1.3
    outs = _run(model, [prompt] * n, temp, list(range(n)), max_new=1)
    assert [o.completion_ids for o in _run(model, [prompt] * 3, temp, [0, 1, 2], 1)] == \
        [o.completion_ids for o in outs[:3]]
    with torch.no_grad():
        logits = model.model(input_ids=torch.tensor([prompt])).logits[0, -1].float()
    probs = torch.softmax(logits / temp, -1).tolist()
    counts = Counter(o.completion_ids[0] for o in outs)
    assert len(counts) > 20  # a spread distribution, so the check has teeth
    for token, p in enumerate(probs):
        assert abs(counts.get(token, 0) - n * p) <= 4.5 * math.sqrt(n * p * (1 - p)) + 1, token


def test_min_new_tokens_of_the_generation_config_holds_eos_back_as_generate_does(pair, monkeypatch):
    fast, slow = pair
    prompts, seeds = _prompts(7), list(range(10, 16))
    free = _run(fast, prompts, 1.0, seeds, 40)
    if fast.model.config.model_type == "qwen3":  # this tiny model stops early on these seeds: the hold has teeth
        assert any(len(o.completion_ids) < 9 for o in free)
    for model in (fast, slow):
        monkeypatch.setattr(model.model.generation_config, "min_new_tokens", 9)
    got, want = _run(fast, prompts, 1.0, seeds, 40), _run(slow, prompts, 1.0, seeds, 40)
    _same(got, want)
    assert all(len(o.completion_ids) >= 9 for o in got)


@pytest.mark.slow
def test_a_learner_update_or_load_empties_its_samplers_cache(m1_cache, tmp_path):
    """The sampler's own check sees in-place writes to the parameters but not writes through `.data` (DeepSpeed
    copies its updated partitions that way): a learner's optimizer step and weight load empty the cache themselves."""
    import torch

    from m1.marl.config import GRPOSettings, LearnerConfig
    from m1.marl.actor.learner import AgentLearner
    from m1.marl.rollout.episodes import Sample
    from m1.models.base import ChatRequest

    spec = ModelSpec(interface="chat", tiny=TinySpec(arch="qwen3", seed=8))
    learner = AgentLearner.build("a", "m", spec, LearnerConfig(finetune="full", lr=1e-2, max_prompt_tokens=512,
                                                         max_completion_tokens=6), GRPOSettings(beta=0.0))
    chat = [{"role": "user", "content": "where is the red square? " * 8}]
    out = learner.sampler.generate([ChatRequest(chat)] * 2, SamplingParams(max_new_tokens=6, temperature=1.0, seed=1))
    cache = learner.sampler.chat.sampler.cache
    assert cache.blocks
    with torch.no_grad():  # a write the version counters do not see
        for p in learner.actor.policy.parameters():
            p.data.mul_(1.0)
    assert cache.blocks
    save_actor(learner.actor, tmp_path / "state")
    samples = [Sample(agent="a", question_id="q", group=0, rollout=i, phase="plan", prompt_ids=o.prompt_ids,
                      completion_ids=o.completion_ids, logprobs=o.logprobs, reward=float(i), advantage=2.0 * i - 1.0)
               for i, o in enumerate(out)]
    learner.actor.update(samples, lr=1e-2)
    assert not cache.blocks
    learner.sampler.generate([ChatRequest(chat)], SamplingParams(max_new_tokens=6))
    assert cache.blocks
    load_actor(learner.actor, tmp_path / "state")
    assert not cache.blocks
