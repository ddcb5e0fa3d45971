"""Prompt-prefix sharing in the GRPO update: each distinct prompt is run once and its key/value cache serves its K
completions. It must be a pure speed-up: the same log-probs, masks and gradients as the joint prompt+completion
pass, for Qwen2 and Qwen3, full and LoRA, the no-grad reference pass, and a whole `AgentLearner.update`.
"""
import random

import pytest

from m1.config import ModelSpec
from m1.marl.config import GRPOSettings, LearnerConfig, LoraSettings
from m1.marl.rollout.episodes import Sample


def spec(arch: str) -> ModelSpec:
    return ModelSpec.model_validate({"interface": "chat", "device": "cpu", "tiny": {
        "arch": arch, "hidden_size": 32, "layers": 2, "heads": 2, "kv_heads": 1, "seed": 3}})


def learner(arch: str = "qwen3", finetune: str = "full", share: bool = True, beta: float = 0.0, **cfg):
    from m1.marl.actor.learner import AgentLearner

    # LoRA dropout 0: dropout masks are drawn per forward, so two ways of computing would draw different ones
    config = LearnerConfig(finetune=finetune, lora=LoraSettings(dropout=0.0), share_prompt_forward=share, **cfg)
    return AgentLearner.build("alpha", "m", spec(arch), config, GRPOSettings(beta=beta)).actor


def grouped_rows(seed: int = 0) -> list[tuple[list[int], list[int]]]:
    """Prompts of lengths 7, 12, 4, 9 with 3, 2, 1 (a singleton) and 4 completions of lengths 1..8, shuffled."""
    rng = random.Random(seed)
    rows = []
    for p_len, k in ((7, 3), (12, 2), (4, 1), (9, 4)):
        prompt = [rng.randrange(10, 300) for _ in range(p_len)]
        rows += [(prompt, [rng.randrange(10, 300) for _ in range(rng.randrange(1, 9))]) for _ in range(k)]
    rng.shuffle(rows)
    return rows


class ForwardLog:
    """Batch shape of every forward the wrapped model runs (to tell the shared path from the joint one)."""

    def __init__(self, model):
        self.shapes: list[tuple[int, int]] = []
        self.handle = model.register_forward_hook(self.hook, with_kwargs=True)

    def hook(self, module, args, kwargs, out):
        self.shapes.append(tuple(kwargs["input_ids"].shape))


def scores_and_grads(lrn, rows, temperature):
    lrn.policy.zero_grad(set_to_none=True)
    logp, mask = lrn.compute_logprobs(rows, temperature, model=lrn.policy)
    (logp * mask).sum().backward()
    grads = {n: p.grad.clone() for n, p in lrn.policy.named_parameters() if p.requires_grad}
    return logp.detach(), mask, grads


def assert_same_grads(a: dict, b: dict) -> None:
    import torch

    assert a.keys() == b.keys() and a
    for n in a:
        scale = torch.linalg.vector_norm(b[n])
        assert scale > 0, f"{n}: no gradient"
        rel = float(torch.linalg.vector_norm(a[n] - b[n]) / scale)
        assert rel <= 1e-5, f"{n}: relative gradient difference {rel:.2e}"


@pytest.mark.parametrize("arch", ["qwen2", "qwen3"])
def test_shared_prompt_pass_matches_the_joint_pass(arch, m1_cache):
    import torch

    rows = grouped_rows()
    lrn = learner(arch)
    lrn.policy.train()  # as in `update`; the tiny configs have no dropout
    log = ForwardLog(lrn.policy)
    shared = scores_and_grads(lrn, rows, 0.7)
    # one pass over the 4 distinct prompts (longest 12), one over the 10 completions minus their last token
    assert log.shapes == [(4, 12), (10, 7)]
    lrn.cfg.share_prompt_forward = False
    joint = scores_and_grads(lrn, rows, 0.7)
    assert log.shapes[2:] == [(10, 12 + 8)]
    assert shared[0].shape == joint[0].shape == (10, 8)
    # where a row has a token (a padded column's value is whatever its pass computed there, masked out)
    torch.testing.assert_close(shared[0] * shared[1], joint[0] * joint[1], atol=1e-5, rtol=0)
    assert torch.equal(shared[1], joint[1])
    assert shared[1].sum().item() == sum(len(c) for _, c in rows)
    assert_same_grads(shared[2], joint[2])


def test_lora_adapter_and_reference_pass_match(m1_cache):
    import torch

    rows = grouped_rows(seed=1)
    lrn = learner("qwen2", finetune="lora")
    lrn.policy.train()
    # a zero-initialised LoRA B makes the adapter a no-op: move it so the adapter changes the log-probs
    with torch.no_grad():
        for n, p in lrn.policy.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.5)
    shared = scores_and_grads(lrn, rows, 1.0)
    with torch.no_grad(), lrn.reference_model() as ref:
        ref_shared, _ = lrn.compute_logprobs(rows, 1.0, model=ref)
    lrn.cfg.share_prompt_forward = False
    joint = scores_and_grads(lrn, rows, 1.0)
    with torch.no_grad(), lrn.reference_model() as ref:
        ref_joint, _ = lrn.compute_logprobs(rows, 1.0, model=ref)
    assert all("lora_" in n for n in shared[2]) and len(shared[2]) == 2 * 2 * 7  # A and B, 2 layers, 7 modules
    torch.testing.assert_close(shared[0] * shared[1], joint[0] * joint[1], atol=1e-5, rtol=0)
    torch.testing.assert_close(ref_shared * shared[1], ref_joint * joint[1], atol=1e-5, rtol=0)
    assert (shared[0] - ref_shared).abs().max() > 1e-3  # the reference really ran without the adapter
    assert_same_grads(shared[2], joint[2])


def test_distinct_prompts_and_single_token_completions(m1_cache):
    import torch

    rng = random.Random(2)
    lrn = learner("qwen3")
    log = ForwardLog(lrn.policy)
    distinct = [([rng.randrange(10, 300) for _ in range(n)], [rng.randrange(10, 300) for _ in range(3)])
                for n in (3, 5, 4)]
    lrn.compute_logprobs(distinct, 1.0, model=lrn.policy)
    assert log.shapes == [(3, 8)]  # nothing to share: the joint pass
    prompt = [rng.randrange(10, 300) for _ in range(6)]
    single = [(prompt, [t]) for t in (11, 12, 13)]
    with torch.no_grad():
        logp, mask = lrn.compute_logprobs(single, 1.0, model=lrn.policy)
        assert log.shapes[1:] == [(1, 6)]  # only the prompt pass: its last column scores every completion
        lrn.cfg.share_prompt_forward = False
        joint, joint_mask = lrn.compute_logprobs(single, 1.0, model=lrn.policy)
    torch.testing.assert_close(logp, joint, atol=1e-5, rtol=0)
    assert torch.equal(mask, joint_mask) and mask.shape == (3, 1)


def samples(rows) -> list[Sample]:
    rng = random.Random(4)
    return [Sample(agent="alpha", question_id="q", group=0, rollout=i, phase="plan", prompt_ids=p,
                   completion_ids=c, logprobs=None, reward=0.0, advantage=rng.uniform(-1, 1))
            for i, (p, c) in enumerate(rows)]


@pytest.mark.parametrize("finetune", ["full", "lora"])
@pytest.mark.slow
def test_update_step_is_the_same_with_and_without_sharing(finetune, m1_cache):
    import torch

    batch = samples(grouped_rows(seed=5))
    results = []
    for share in (True, False):
        # eps=1: Adam's first step ~ g / (|g| + 1) is smooth in g (with eps=1e-8 it is ~sign(g), which turns float
        # rounding in near-zero gradient entries into full-size steps); micro-batches of 6 split the groups
        lrn = learner("qwen2", finetune=finetune, share=share, beta=0.05, lr=1e-2, eps=1.0, micro_batch_size=6)
        calls = []
        inner = lrn.scorer._shared_prompt_logprobs
        lrn.scorer._shared_prompt_logprobs = lambda model, rows, *a: calls.append(len(rows)) or inner(model, rows, *a)
        stats = lrn.update(batch, lr=1e-2)
        results.append((stats, lrn.parameters()))
        # share on: the first micro-batch (6 rows, 4 distinct prompts) repeats a prompt, in the policy and
        # the reference pass; share off: never
        assert (calls[:2] == [6, 6]) if share else not calls
    (on, p_on), (off, p_off) = results
    assert on["loss"] == pytest.approx(off["loss"], abs=1e-6)
    assert on["grad_norm"] == pytest.approx(off["grad_norm"], rel=1e-5) and on["grad_norm"] > 0
    assert on["kl"] == pytest.approx(off["kl"], abs=1e-7)
    for n, p in p_on.items():
        torch.testing.assert_close(p, p_off[n], atol=1e-6, rtol=1e-5)


def test_gradient_checkpointing_keeps_the_joint_pass_in_training(m1_cache):
    import torch

    rows = grouped_rows(seed=6)
    lrn = learner("qwen3", gradient_checkpointing=True)
    log = ForwardLog(lrn.policy)
    lrn.policy.train()  # checkpointed layers drop the cache in training: sharing must not be attempted
    logp, mask = lrn.compute_logprobs(rows, 1.0, model=lrn.policy)
    c_len = max(len(c) for _, c in rows)
    assert log.shapes == [(10, 12 + c_len)]
    lrn.policy.eval()  # the checkpointing wrapper is inactive in eval (the full-model reference): sharing again
    with torch.no_grad():
        shared, shared_mask = lrn.compute_logprobs(rows, 1.0, model=lrn.policy)
    assert log.shapes[1:] == [(4, 12), (10, c_len - 1)]
    torch.testing.assert_close(shared * mask, logp.detach() * mask, atol=1e-5, rtol=0)
    assert torch.equal(shared_mask, mask)


@pytest.mark.parametrize("arch", ["qwen2", "qwen3"])
def test_the_joint_pass_padded_after_each_row_matches_the_left_padded_masked_pass(arch, m1_cache):
    """`_right_padded_logprobs` (no mask: the causal kernel) against the left-padded pass with an explicit mask
    (`sequence_logprobs`, every column's logits): the same completion log-probs and the same gradients, over rows
    of different prompt and completion lengths."""
    import torch

    rows = grouped_rows(seed=7)
    lrn = learner(arch, share=False)
    lrn.policy.train()
    log = ForwardLog(lrn.policy)
    right = scores_and_grads(lrn, rows, 1.0)
    assert log.shapes == [(10, 12 + max(len(c) for _, c in rows))]
    lrn.policy.zero_grad(set_to_none=True)
    logp, mask, _, _ = lrn.scorer.sequence_logprobs(lrn.policy, rows)
    (logp * mask).sum().backward()
    left = {n: p.grad.clone() for n, p in lrn.policy.named_parameters() if p.requires_grad}
    torch.testing.assert_close(right[0] * right[1], logp.detach() * mask, atol=1e-5, rtol=0)
    assert torch.equal(right[1], mask)
    assert_same_grads(right[2], left)


def test_the_attention_loss_pass_without_prompt_logits_scores_completions_alike(m1_cache):
    """`sequence_logprobs(prompt=False)` (the evidence attention loss without learner.prompt_loss): logits at the
    completion's columns only, the same completion log-probs and gradients as the pass with every column's."""
    import torch

    rows = grouped_rows(seed=8)
    lrn = learner("qwen3", share=False)
    lrn.policy.train()
    got = []
    for prompt in (True, False):
        lrn.policy.zero_grad(set_to_none=True)
        logp, mask, p_logp, p_mask = lrn.scorer.sequence_logprobs(lrn.policy, rows, prompt=prompt)
        assert (p_logp is None and p_mask is None) != prompt
        (logp * mask).sum().backward()
        got.append((logp.detach(), mask, {n: p.grad.clone() for n, p in lrn.policy.named_parameters()}))
    (full, full_mask, full_grads), (only, only_mask, only_grads) = got
    torch.testing.assert_close(only * only_mask, full * full_mask, atol=1e-5, rtol=0)
    assert torch.equal(only_mask, full_mask)
    assert_same_grads(only_grads, full_grads)
