"""How an update cuts its step into micro-batches: samples sorted by length, micro-batches capped by padded
tokens, zero-advantage samples not run at beta 0. All of it must leave the mathematics alone: the same loss, gradient
norm and weights as one joint micro-batch over the step in its own order. `learner.prompt_grad: false` is the one
change of estimator here: same log-prob values, another gradient.
"""
import random
from types import SimpleNamespace

import pytest

from m1.marl.config import LearnerConfig
from m1.marl.actor.learner import Actor
from tests.marl.test_prefix_sharing import ForwardLog, grouped_rows, learner, samples


def old_path(**cfg):
    """The plain update the cut one must match: one micro-batch in the step's order, every sample run."""
    return learner("qwen2", micro_batch_tokens=None, skip_zero_advantage=False, micro_batch_size=64, **cfg)


def mixed_batch(zero_share: float = 0.0, seed: int = 7):
    """Rows of very different lengths (as plan vs communicate prompts), some advantages exactly 0."""
    rng = random.Random(seed)
    rows = grouped_rows(seed)
    for p_len, k in ((40, 2), (3, 3), (25, 1)):
        prompt = [rng.randrange(10, 300) for _ in range(p_len)]
        rows += [(prompt, [rng.randrange(10, 300) for _ in range(rng.randrange(1, 6))]) for _ in range(k)]
    rng.shuffle(rows)
    batch = samples(rows)
    for s in batch:
        if rng.random() < zero_share:
            s.advantage = 0.0
    return batch


def update_results(lrn, batch, family="grpo"):
    stats = lrn.update(batch, lr=1e-2, family=family)
    return stats, lrn.parameters()


def assert_same_step(a, b):
    import torch

    (sa, pa), (sb, pb) = a, b
    assert sa["loss"] == pytest.approx(sb["loss"], abs=1e-6)
    assert sa["grad_norm"] == pytest.approx(sb["grad_norm"], rel=1e-5) and sa["grad_norm"] > 0
    for n, p in pa.items():
        torch.testing.assert_close(p, pb[n], atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("family", ["grpo", "sft"])
@pytest.mark.slow
def test_sorted_token_budgeted_micro_batches_give_the_old_step(family, m1_cache):
    batch = mixed_batch(zero_share=0.3)
    # eps=1 keeps Adam's first step smooth in the gradient (see test_prefix_sharing)
    old = update_results(old_path(lr=1e-2, eps=1.0), batch, family)
    new_lrn = learner("qwen2", lr=1e-2, eps=1.0, micro_batch_size=64, micro_batch_tokens=120)
    log = ForwardLog(new_lrn.policy)
    new = update_results(new_lrn, batch, family)
    assert_same_step(new, old)
    assert len(log.shapes) > 2  # the budget really split the step
    if family == "grpo":  # the zero-advantage samples were not run, but counted
        assert new[0]["samples_run"] == sum(s.advantage != 0 for s in batch) < len(batch) == new[0]["samples"]
    else:
        assert new[0]["samples_run"] == len(batch)


@pytest.mark.slow
def test_a_step_of_only_zero_advantages_moves_the_weights_as_before(m1_cache):
    batch = mixed_batch(zero_share=1.0)
    old = old_path(lr=1e-2, eps=1.0)
    before = old.parameters()
    stats_old, after_old = update_results(old, batch)
    new = learner("qwen2", lr=1e-2, eps=1.0)
    log = ForwardLog(new.policy)
    stats_new, after_new = update_results(new, batch)
    assert stats_new["samples_run"] == 0 and stats_new["loss"] == stats_old["loss"] == 0.0
    assert len(log.shapes) == 1  # one zero-weight micro-batch of one row, so every parameter has a (zero) gradient
    assert log.shapes[0][0] == 1
    for n, p in after_new.items():
        assert (p == after_old[n]).all() and (p == before[n]).all()


def plan(n_rows, lengths, world=1, rank=0, mb=64, budget=None):
    fake = SimpleNamespace(cfg=LearnerConfig(micro_batch_size=mb, micro_batch_tokens=budget), world=world, rank=rank)
    rows = [([7] * p, [1] * c) for p, c in lengths]  # same length, same prompt
    batch = [SimpleNamespace(i=i) for i in range(n_rows)]
    return Actor._micro_batches(fake, batch, rows, (batch[:1], rows[:1]))


def test_plan_sorts_by_length_keeps_the_budget_and_pads_ranks_alike():
    rng = random.Random(3)
    lengths = [(rng.randrange(5, 200), rng.randrange(1, 9)) for _ in range(50)] + [(900, 4)]
    out = plan(51, lengths, budget=1000)
    seen = [s.i for micro, _, w in out for s in micro]
    assert sorted(seen) == list(range(51))  # every sample once
    def cost(r):  # each distinct prompt once, every completion
        return len({tuple(p) for p, _ in r}) * max(len(p) for p, _ in r) + len(r) * max(len(c) for _, c in r)

    assert all(cost(r) <= 1000 or len(r) == 1 for _, r, _ in out)
    assert cost(out[0][1] + [out[1][1][0]]) > 1000  # each micro-batch is as full as the budget allows
    starts = [len(r[0][0]) for _, r, _ in out]
    assert starts == sorted(starts)  # ascending prompt length across micro-batches
    # two ranks: the same micro-batches, a contiguous share each, padded to the same count with weight 0
    ranks = [plan(51, lengths, world=2, rank=r, budget=1000) for r in (0, 1)]
    assert len(ranks[0]) == len(ranks[1])
    run = [[s.i for micro, _, w in part if w for s in micro] for part in ranks]
    assert sorted(run[0] + run[1]) == list(range(51)) and not set(run[0]) & set(run[1])
    # a single row over the budget still goes, alone
    assert [len(m) for m, _, _ in plan(3, [(10, 1), (10, 1), (5000, 1)], budget=100)] == [2, 1]


def test_identical_prompts_stay_in_one_micro_batch_for_the_shared_prompt_pass():
    lengths = [(30, 5), (12, 3), (30, 1), (12, 8), (30, 2)]
    out = plan(5, lengths)
    assert [[s.i for s in m] for m, _, _ in out] == [[1, 3, 2, 4, 0]]


def test_prompt_without_gradient_keeps_the_values_and_changes_the_gradient(m1_cache):
    import torch

    from tests.marl.test_prefix_sharing import scores_and_grads

    rows = grouped_rows(seed=9)
    lrn = learner("qwen3", prompt_grad=False)
    lrn.policy.train()
    log = ForwardLog(lrn.policy)
    cheap = scores_and_grads(lrn, rows, 0.7)
    # one no-grad pass over the 4 distinct prompts less their last token, one over [last prompt token] + completion
    c_len = max(len(c) for _, c in rows)
    assert log.shapes == [(4, 11), (10, c_len)]
    lrn.cfg.prompt_grad = True
    full = scores_and_grads(lrn, rows, 0.7)
    torch.testing.assert_close(cheap[0], full[0], atol=1e-5, rtol=0)
    assert torch.equal(cheap[1], full[1])
    differs = 0
    for n, g in full[2].items():
        assert torch.linalg.vector_norm(cheap[2][n]) > 0 or "embed" in n, f"{n}: no gradient"
        differs += not torch.allclose(cheap[2][n], g, atol=1e-6)
    assert differs > 0  # a different estimator
    lrn.policy.eval()  # not in training (a reference pass): the exact path
    lrn.cfg.prompt_grad = False
    with torch.no_grad():
        lrn.compute_logprobs(rows, 0.7, model=lrn.policy)
    assert log.shapes[-2] == (4, 12)


@pytest.mark.slow
def test_prompt_loss_adds_the_prompts_token_mean_and_keeps_the_completions(m1_cache):
    """`learner.prompt_loss: w` (SFT): loss = completion NLL mean + w x prompt NLL mean, each over the step's own
    tokens; the completion's log-probs are exactly the completion-only path's, and the prompt's are the model's
    next-token log-probs of the unpadded prompt (its first token unscored)."""
    import torch

    from m1.marl.algo.reductions import token_logprobs

    rows = grouped_rows(seed=11)
    lrn = learner("qwen3", micro_batch_size=64, micro_batch_tokens=None)
    lrn.policy.eval()
    with torch.no_grad():
        want, want_mask = lrn.scorer._joint_logprobs(lrn.policy, rows, 1.0)
        c_logp, c_mask, p_logp, p_mask = lrn.scorer.sequence_logprobs(lrn.policy, rows)
        torch.testing.assert_close(c_logp * c_mask, want * want_mask, atol=1e-5, rtol=0)
        assert torch.equal(c_mask, want_mask)
        assert p_mask.sum() == sum(len(p) - 1 for p, _ in rows)
        p, _ = rows[0]  # one prompt alone, unpadded: its own next-token log-probs
        alone = token_logprobs(lrn.policy(input_ids=torch.tensor([p])).logits[:, :-1], torch.tensor([p[1:]]))
        got = p_logp[0][p_mask[0] > 0]
        torch.testing.assert_close(got, alone[0], atol=1e-5, rtol=0)
        n_c, n_p = float(c_mask.sum()), float(p_mask.sum())
        expect = float(-(c_logp * c_mask).sum() / n_c - 0.5 * (p_logp * p_mask).sum() / n_p)
    batch = samples(rows)
    lrn.cfg.prompt_loss = 0.5
    stats = lrn.update(batch, lr=1e-2, family="sft")
    assert stats["loss"] == pytest.approx(expect, rel=1e-5)
    assert stats["prompt_nll"] == pytest.approx(float(-(p_logp * p_mask).sum() / n_p), rel=1e-5)
    plain = learner("qwen3", micro_batch_size=64, micro_batch_tokens=None)
    assert plain.update(samples(rows), lr=1e-2, family="sft")["loss"] == pytest.approx(
        float(-(c_logp * c_mask).sum() / n_c), rel=1e-5)
