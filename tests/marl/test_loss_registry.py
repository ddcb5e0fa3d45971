"""The loss types and old-log-prob modes are registries (m1/marl/algo/reductions.py): the config accepts exactly their
names, the modes give the hand-computed old log-probs and weights, and a loss registered from outside m1/ trains."""
import math
import random
from contextlib import contextmanager

import pytest
import torch
from pydantic import ValidationError

from m1.config import ModelSpec
from m1.marl.config import GRPOSettings, LearnerConfig
from m1.marl.algo.reductions import LOSSES, OLD_LOGPROBS, register_loss
from m1.marl.rollout.episodes import Sample

TOY = "toy-sequence-sum"


@contextmanager
def toy_loss():
    """A length-weighted toy loss: each sequence's summed per-token loss, averaged over the sequences."""

    @register_loss(TOY)
    def sequence_sum(per_token, mask, **_):
        return (per_token * mask).sum() / per_token.size(0)

    try:
        yield
    finally:
        del LOSSES[TOY]


TINY = ModelSpec.model_validate({"interface": "chat", "device": "cpu", "tiny": {
    "arch": "qwen3", "hidden_size": 32, "layers": 1, "heads": 2, "kv_heads": 1, "seed": 1}})


def random_samples(seed: int) -> list[Sample]:
    """Six samples of random prompts and completions, one agent, advantages in [-1, 1]."""
    rng = random.Random(seed)
    return [Sample(agent="alpha", question_id="q", group=0, rollout=i, phase="plan",
                   prompt_ids=[rng.randrange(10, 300) for _ in range(rng.randrange(5, 20))],
                   completion_ids=[rng.randrange(10, 300) for _ in range(rng.randrange(1, 9))],
                   logprobs=None, reward=0.0, advantage=rng.uniform(-1, 1)) for i in range(6)]


def test_config_accepts_exactly_the_registered_names():
    with pytest.raises(ValidationError, match="unknown loss_type"):
        GRPOSettings(loss_type=TOY)
    with toy_loss():
        assert TOY in LOSSES and not LOSSES[TOY].token_level
        for name in LOSSES:
            assert GRPOSettings(loss_type=name).loss_type == name
    with pytest.raises(ValidationError, match="unknown loss_type"):
        GRPOSettings(loss_type=TOY)
    for name in OLD_LOGPROBS:
        assert GRPOSettings(old_logprobs=name).old_logprobs == name
    assert set(OLD_LOGPROBS) == {"policy", "rollout", "sampler"}
    assert GRPOSettings().old_logprobs is None  # decided by m1/marl/resolve.py
    with pytest.raises(ValidationError, match="unknown old_logprobs"):
        GRPOSettings(old_logprobs="stale")
    with pytest.raises(ValueError, match="already registered"):
        register_loss("grpo")(lambda per_token, mask, **_: per_token.sum())


def test_old_logprob_modes_by_hand():
    logp = torch.log(torch.tensor([[0.5, 0.25, 0.1]]))
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    sampled = logp + torch.tensor([[0.0, -1.0, 5.0]])  # the engine agrees, is 1 lower (ratio e > cap 2), padding
    g = GRPOSettings(is_cap=2.0)
    assert OLD_LOGPROBS["policy"](logp, mask, sampled, g) == (None, None, {})
    old, weight, stats = OLD_LOGPROBS["rollout"](logp, mask, sampled, g)
    assert old is sampled and weight is None and stats == {}
    old, weight, stats = OLD_LOGPROBS["sampler"](logp, mask, sampled, g)
    assert old is None
    torch.testing.assert_close(weight, torch.tensor([[1.0, 2.0, 1.0]]))  # truncated at the cap; 1 on padding
    assert stats["is/ratio_mean"] == pytest.approx(1 + math.e, rel=1e-6)  # sums over the masked tokens
    assert stats["is/truncated"] == 1.0
    assert stats["is/ratio_max"] == pytest.approx(math.e, rel=1e-6)
    for mode in ("rollout", "sampler"):
        with pytest.raises(ValueError, match=f"old_logprobs={mode} needs the sampler's log-probs"):
            OLD_LOGPROBS[mode](logp, mask, None, g)


@pytest.mark.slow
def test_a_loss_registered_outside_m1_trains_one_step(m1_cache):
    from m1.marl.actor.learner import AgentLearner

    samples, spec = random_samples(0), TINY
    with toy_loss():
        learner = AgentLearner.build("alpha", "qa", spec, LearnerConfig(finetune="full", lr=1e-2, micro_batch_size=4),
                                     GRPOSettings(beta=0.0, loss_type=TOY))
        before = learner.actor.parameters()
        stats = learner.actor.update(samples, lr=1e-2)  # two micro-batches (4 + 2), one optimizer step
    # on-policy the ratio is 1, so each token's loss is -A; a per-micro-batch loss is weighted by its share of the
    # step's samples, so the step's loss is the toy loss of the whole batch
    want = sum(-s.advantage * len(s.completion_ids) for s in samples) / len(samples)
    assert stats["loss"] == pytest.approx(want, abs=1e-5)
    assert stats["samples"] == 6 and stats["grad_norm"] > 0
    after = learner.actor.parameters()
    assert any(not torch.equal(after[n], before[n]) for n in before)


@pytest.mark.slow
def test_a_loss_family_registered_outside_m1_drives_the_update(m1_cache):
    """A loss family (what the step minimises, beside grpo and sft) is one registration: here plain REINFORCE,
    -A log p summed over each completion and averaged over the step's samples, written with the actor's public
    scoring calls only."""
    from m1.marl.actor.learner import AgentLearner
    from m1.marl.actor.losses import LOSS_FAMILIES, LossFamily, register_loss_family

    calls = []

    def reinforce(actor, micro, micro_rows, step):
        vision, temperature = actor.scoring(micro)
        with actor.autocast():
            logp, mask = actor.compute_logprobs(micro_rows, temperature, vision)
        adv = torch.tensor([s.advantage for s in micro]).unsqueeze(1)
        calls.append(len(micro))
        return -(adv * logp * mask).sum() / step.samples, {"reinforce_tokens": float(mask.sum())}

    samples, spec = random_samples(1), TINY
    learner = AgentLearner.build("alpha", "qa", spec, LearnerConfig(finetune="full", lr=1e-2, micro_batch_size=4),
                                 GRPOSettings(beta=0.0))
    with pytest.raises(ValueError, match=r"unknown loss family 'reinforce'; registered: \['grpo', 'sft'\]"):
        learner.actor.update(samples, lr=1e-2, family="reinforce")
    with torch.no_grad():  # REINFORCE's loss at the weights the step starts from
        actor = learner.actor
        logp, mask = actor.compute_logprobs(actor.scorer.rows(samples), 1.0, model=actor.forward_model())
    want = -sum(s.advantage * float((logp[i] * mask[i]).sum()) for i, s in enumerate(samples)) / len(samples)
    register_loss_family(LossFamily(name="reinforce", loss=reinforce))
    try:
        before = learner.actor.parameters()
        stats = learner.actor.update(samples, lr=1e-2, family="reinforce")
        with pytest.raises(ValueError, match="loss family 'grpo' is already registered"):
            register_loss_family(LossFamily(name="grpo", loss=reinforce))
    finally:
        del LOSS_FAMILIES["reinforce"]
    assert calls == [4, 2]  # two micro-batches of the one step
    assert stats["reinforce_tokens"] == sum(len(s.completion_ids) for s in samples)
    after = learner.actor.parameters()
    assert any(not torch.equal(after[n], before[n]) for n in before)
    assert stats["loss"] == pytest.approx(want, abs=1e-5)


@pytest.mark.slow
def test_token_advantages_reach_the_loss_and_keep_their_samples_in_the_step(m1_cache):
    """Per-token advantages replace the sequence's in the loss: on-policy each token's loss is -A_t, so the token
    mean (`dapo`) of the step is -sum A_t / tokens. A sample whose sequence value is 0 but whose tokens carry
    advantages is not skipped as advantage-free."""
    from dataclasses import replace

    from m1.marl.actor.learner import AgentLearner

    rng = random.Random(2)
    samples = [replace(s, advantage=0.0, token_advantages=[rng.uniform(-1, 1) for _ in s.completion_ids])
               for s in random_samples(2)]
    learner = AgentLearner.build("alpha", "qa", TINY, LearnerConfig(finetune="full", lr=1e-2, micro_batch_size=4),
                                 GRPOSettings(beta=0.0, loss_type="dapo"))
    before = learner.actor.parameters()
    stats = learner.actor.update(samples, lr=1e-2)
    tokens = sum(len(s.completion_ids) for s in samples)
    assert stats["loss"] == pytest.approx(-sum(sum(s.token_advantages) for s in samples) / tokens, abs=1e-5)
    assert stats["samples"] == 6 and stats["grad_norm"] > 0
    after = learner.actor.parameters()
    assert any(not torch.equal(after[n], before[n]) for n in before)
