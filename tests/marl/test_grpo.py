"""Tests for m1/marl/algo/reductions.py, the group and greedy estimators (m1/marl/algo/advantages.py) and the clip
objectives through `grpo_loss` (m1/marl/algo/objectives.py): hand-computed values plus parity with TRL 1.16.0's own GRPO
loss code. The other objectives and estimators: tests/marl/test_objectives.py."""

import math
import os
from collections import defaultdict
from contextlib import nullcontext
from types import SimpleNamespace

import pytest
import torch

from m1.marl.algo.advantages import ESTIMATORS, estimate_advantages, group_advantages
from m1.marl.config import GRPOSettings
from m1.marl.algo.reductions import LOSSES, kl_k3, token_logprobs
from m1.marl.algo.objectives import grpo_loss


os.environ.setdefault("HF_HUB_OFFLINE", "1")

EPS = 1e-4


def settings(**kw):
    """The GRPO settings of a direct `grpo_loss` call: beta 0 unless given."""
    return GRPOSettings(**{"beta": 0.0, **kw})


# --------------------------------------------------------------------------------------------- advantages


def test_advantages_plus_minus_one_bessel():
    adv = group_advantages([1.0, -1.0, 1.0, -1.0])
    # mean 0, unbiased variance 4/3 (population variance would be 1)
    expected = 1.0 / (math.sqrt(4.0 / 3.0) + EPS)
    assert adv.shape == (4,)
    assert expected == pytest.approx(0.86596, abs=1e-5)
    torch.testing.assert_close(adv, torch.tensor([expected, -expected, expected, -expected]), atol=1e-6, rtol=0)


def test_advantages_one_of_three_correct():
    adv = group_advantages(torch.tensor([[1.0, 0.0, 0.0]]))
    std = math.sqrt(((2 / 3) ** 2 + 2 * (1 / 3) ** 2) / 2)  # = sqrt(1/3)
    expected = torch.tensor([[2 / 3, -1 / 3, -1 / 3]]) / (std + EPS)
    assert adv.shape == (1, 3)
    torch.testing.assert_close(adv, expected, atol=1e-6, rtol=0)
    assert float(adv.sum()) == pytest.approx(0.0, abs=1e-6)


def test_advantages_degenerate_groups_are_exactly_zero():
    single = group_advantages([[3.0]])
    equal = group_advantages([[0.1, 0.1, 0.1], [7.0, 7.0, 7.0]])
    assert single.shape == (1, 1) and single.item() == 0.0
    assert torch.equal(equal, torch.zeros(2, 3))
    # eps=0 with zero spread would be 0/0 without the explicit guard
    assert torch.equal(group_advantages([[2.0, 2.0]], eps=0.0), torch.zeros(1, 2))
    assert torch.equal(group_advantages([[2.0, 2.0]], scale=False), torch.zeros(1, 2))


def test_advantages_nan_marks_missing_sample():
    adv = group_advantages([[1.0, float("nan"), 0.0], [float("nan"), 5.0, float("nan")]])
    e = 0.5 / (math.sqrt(0.5) + EPS)
    torch.testing.assert_close(adv, torch.tensor([[e, 0.0, -e], [0.0, 0.0, 0.0]]), atol=1e-6, rtol=0)
    assert not torch.isnan(adv).any()


def test_advantages_unscaled_and_the_baselines():
    r = torch.tensor([[1.0, 2.0, 6.0]])
    unscaled = settings(scale_rewards=False)
    torch.testing.assert_close(group_advantages(r, scale=False), torch.tensor([[-2.0, -1.0, 3.0]]))
    torch.testing.assert_close(estimate_advantages(ESTIMATORS["group"], {"a": r}, None, unscaled)["a"],
                               torch.tensor([[-2.0, -1.0, 3.0]]))  # Dr. GRPO: the group mean, unscaled
    greedy = estimate_advantages(ESTIMATORS["greedy"], {"a": [[1.0, 2.0, 6.0]]}, {"a": [[2.0]]}, unscaled)["a"]
    torch.testing.assert_close(greedy, torch.tensor([[-1.0, 0.0, 4.0]]))  # rewards minus the greedy run's
    with pytest.raises(ValueError, match="needs the greedy run's rewards"):
        estimate_advantages(ESTIMATORS["greedy"], {"a": [[1.0, 2.0, 6.0]]}, None, unscaled)


def test_advantages_rows_are_independent_and_match_torch_std_and_trl_nanstd():
    from trl.trainer.utils import nanstd

    g = torch.Generator().manual_seed(0)
    r = torch.randn(5, 6, generator=g)
    adv = group_advantages(r)
    expected = (r - r.mean(1, keepdim=True)) / (r.std(1, keepdim=True) + EPS)
    torch.testing.assert_close(adv, expected, atol=1e-6, rtol=0)
    expected_trl = (r - r.mean(1, keepdim=True)) / (nanstd(r, dim=1).unsqueeze(1) + EPS)
    torch.testing.assert_close(adv, expected_trl, atol=1e-6, rtol=0)
    # changing one group leaves the others untouched
    r2 = r.clone()
    r2[2, 0] += 5.0  # (an affine change of a whole row would leave its z-scores unchanged)
    adv2 = group_advantages(r2)
    torch.testing.assert_close(adv2[[0, 1, 3, 4]], adv[[0, 1, 3, 4]])
    assert not torch.allclose(adv2[2], adv[2], atol=1e-3)


def test_estimated_advantages_are_per_agent_independent():
    rewards = {"qwen3-8b": torch.tensor([[1.0, -1.0, 1.0, -1.0]]), "qwen2.5-3b": torch.tensor([[0.0, 0.0, 9.0, 3.0]])}
    group = ESTIMATORS["group"]
    out = estimate_advantages(group, rewards, None, settings())
    assert set(out) == set(rewards)
    torch.testing.assert_close(out["qwen3-8b"], group_advantages(rewards["qwen3-8b"]))
    torch.testing.assert_close(out["qwen2.5-3b"], group_advantages(rewards["qwen2.5-3b"]))
    # a huge reward of another agent does not change this agent's advantages
    out2 = estimate_advantages(group, {**rewards, "qwen2.5-3b": torch.tensor([[0.0, 0.0, 900.0, 3.0]])}, None,
                               settings())
    torch.testing.assert_close(out2["qwen3-8b"], out["qwen3-8b"])
    with pytest.raises(ValueError, match="mapping"):
        estimate_advantages(group, [[1.0, 2.0]], None, settings())


def test_greedy_baseline_advantages_are_reward_minus_the_greedy_run():
    from m1.marl.algo.advantages import baseline_advantages

    nan = float("nan")
    got = baseline_advantages([[1.0, -1.0, 1.0], [-1.0, 1.0, nan], [0.5, 0.5, 0.5]], [-1.0, 1.0, nan])
    # beating greedy counts double a group's spread, matching greedy counts 0, a missing value gives 0
    assert torch.equal(got, torch.tensor([[2.0, 0.0, 2.0], [-2.0, 0.0, 0.0], [0.0, 0.0, 0.0]]))
    with pytest.raises(ValueError, match=r"\[G, K\]"):
        baseline_advantages([[1.0, 2.0]], [1.0, 2.0])


def test_advantages_bad_shape_errors():
    with pytest.raises(ValueError, match=r"\[K\] or \[G, K\]"):
        group_advantages(torch.zeros(2, 2, 2))
    with pytest.raises(ValueError, match="rectangular"):
        group_advantages([[1.0, 2.0], [3.0]])


# --------------------------------------------------------------------------------------------- log-probs


def _naive_logprobs(logits, tokens, temperature=1.0):
    return torch.log_softmax(logits.double() / temperature, -1).gather(-1, tokens.unsqueeze(-1)).squeeze(-1)


def test_token_logprobs_matches_naive_and_trl():
    from trl.trainer.utils import selective_log_softmax

    g = torch.Generator().manual_seed(1)
    logits = torch.randn(3, 5, 11, generator=g) * 4
    tokens = torch.randint(0, 11, (3, 5), generator=g)
    for t in (1.0, 0.5, 1.7):
        out = token_logprobs(logits, tokens, temperature=t)
        assert out.shape == (3, 5) and out.dtype == torch.float32
        torch.testing.assert_close(out.double(), _naive_logprobs(logits, tokens, t), atol=1e-5, rtol=0)
        torch.testing.assert_close(out, selective_log_softmax(logits, tokens, temperature=t), atol=1e-6, rtol=0)
    # temperature changes the value (sharper distribution -> the argmax token gets closer to log 1)
    top = logits.argmax(-1)
    assert (token_logprobs(logits, top, 0.5) > token_logprobs(logits, top, 1.0)).all()


def test_token_logprobs_bf16_is_computed_in_float32():
    g = torch.Generator().manual_seed(2)
    logits = (torch.randn(2, 4, 7, generator=g) * 3).to(torch.bfloat16)
    tokens = torch.randint(0, 7, (2, 4), generator=g)
    out = token_logprobs(logits, tokens)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out.double(), _naive_logprobs(logits.float(), tokens), atol=1e-5, rtol=0)


def test_token_logprobs_validation():
    with pytest.raises(ValueError, match="temperature"):
        token_logprobs(torch.zeros(1, 2, 3), torch.zeros(1, 2, dtype=torch.long), temperature=0.0)
    with pytest.raises(ValueError, match=r"\[B, T, V\]"):
        token_logprobs(torch.zeros(1, 2, 3), torch.zeros(1, 3, dtype=torch.long))


# --------------------------------------------------------------------------------------------- policy loss


def _hand_example():
    """Two sequences; ratios chosen so one token is clipped high (A>0) and one clipped low (A<0)."""
    ratios = torch.tensor([[1.1, 1.5, 2.0], [0.9, 0.5, 1.05]])
    old = torch.full((2, 3), -1.3)
    logp = (old + ratios.log()).requires_grad_(True)
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])  # ratio 2.0 sits on a padding token
    adv = torch.tensor([1.0, -0.5])
    return logp, old, adv, mask


# per-token losses: seq0 [-1.1, -1.2 (clipped from -1.5)], seq1 [0.45, 0.4 (clipped from 0.25), 0.525]
HAND_POLICY_LOSS = [
    ("grpo", {}, ((-1.1 - 1.2) / 2 + (0.45 + 0.4 + 0.525) / 3) / 2),
    ("token-mean", {}, (-2.3 + 1.375) / 5),
    ("bnpo", {}, (-2.3 + 1.375) / 5),
    ("dr_grpo", {"max_completion_length": 4}, (-2.3 + 1.375) / (2 * 4)),
    ("dapo", {}, (-2.3 + 1.375) / 5),
    ("dapo", {"num_items_in_batch": 10}, (-2.3 + 1.375) / 10),
    ("bnpo", {"num_items_in_batch": 10}, (-2.3 + 1.375) / 10),  # one token-level loss: the step's count when given
]


@pytest.mark.parametrize("loss_type, kwargs, expected", HAND_POLICY_LOSS)
def test_policy_term_hand_computed(loss_type, kwargs, expected):
    logp, old, adv, mask = _hand_example()
    loss, stats = grpo_loss(logp, old, None, adv, mask, settings(loss_type=loss_type), **kwargs)
    assert loss.item() == pytest.approx(expected, abs=1e-6)
    assert stats["policy_loss"] == pytest.approx(expected, abs=1e-6)
    assert stats["clip_frac"] == pytest.approx(2 / 5)
    assert stats["clip_frac_low"] == pytest.approx(1 / 5)
    assert stats["clip_frac_high"] == pytest.approx(1 / 5)
    assert stats["ratio_mean"] == pytest.approx((1.1 + 1.5 + 0.9 + 0.5 + 1.05) / 5, abs=1e-6)
    assert stats["num_tokens"] == 5
    # clipped tokens and padding get no gradient, the others do
    loss.backward()
    zero = torch.tensor([[False, True, True], [False, True, False]])
    assert torch.all(logp.grad[zero] == 0)
    assert torch.all(logp.grad[~zero] != 0)


def test_policy_term_clip_higher():
    logp, old, adv, mask = _hand_example()
    loss, stats = grpo_loss(logp, old, None, adv, mask,
                            settings(objective="clip_higher", clip_eps_high=0.6, loss_type="token-mean"))
    assert loss.item() == pytest.approx((-1.1 - 1.5 + 1.375) / 5, abs=1e-6)
    assert stats["clip_frac_high"] == 0.0 and stats["clip_frac_low"] == pytest.approx(0.2)


def test_policy_term_on_policy_no_clipping_gradient():
    logp, _, adv, mask = _hand_example()
    loss, stats = grpo_loss(logp, None, None, adv, mask, settings(loss_type="grpo"))
    assert loss.item() == pytest.approx((-1.0 + 0.5) / 2, abs=1e-6)
    assert stats["clip_frac"] == 0.0 and stats["ratio_mean"] == pytest.approx(1.0)
    loss.backward()
    expected = torch.tensor([[-1.0 / 2 / 2, -1.0 / 2 / 2, 0.0], [0.5 / 3 / 2] * 3])
    torch.testing.assert_close(logp.grad, expected, atol=1e-6, rtol=0)


def test_grpo_loss_errors():
    logp, old, adv, mask = _hand_example()
    unchecked = SimpleNamespace(objective="clip", beta=0.0, loss_type="sum", clip_eps_low=0.2, delta=None)
    with pytest.raises(ValueError, match="unknown loss_type 'sum'"):
        grpo_loss(logp, old, None, adv, mask, unchecked)
    with pytest.raises(ValueError, match="unknown objective 'ppo'"):
        grpo_loss(logp, old, None, adv, mask, SimpleNamespace(**{**vars(unchecked), "objective": "ppo"}))
    with pytest.raises(ValueError, match="max_completion_length"):
        grpo_loss(logp, old, None, adv, mask, settings(loss_type="dr_grpo"))
    with pytest.raises(ValueError, match="advantages"):
        grpo_loss(logp, old, None, torch.ones(3), mask, settings())
    with pytest.raises(ValueError, match="mask"):
        grpo_loss(logp, old, None, adv, mask[:, :2], settings())
    assert set(LOSSES) >= {"grpo", "token-mean", "bnpo", "dr_grpo", "dapo"}
    assert {name for name, loss in LOSSES.items() if loss.token_level} == {"token-mean", "bnpo", "dapo"}


# --------------------------------------------------------------------------------------------- KL


def test_kl_k3_by_hand():
    logp = torch.log(torch.tensor([0.5, 0.25, 0.3]))
    ref = torch.log(torch.tensor([0.25, 0.5, 0.3]))
    kl = kl_k3(logp, ref)
    expected = torch.tensor([0.5 + math.log(2) - 1, 2 - math.log(2) - 1, 0.0])
    torch.testing.assert_close(kl, expected, atol=1e-6, rtol=0)
    assert kl[2].item() == 0.0
    g = torch.Generator().manual_seed(3)
    a, b = torch.randn(50, generator=g) - 2, torch.randn(50, generator=g) - 2
    assert (kl_k3(a, b) >= 0).all()
    assert torch.equal(kl_k3(a, a), torch.zeros(50))
    with pytest.raises(ValueError, match="shape"):
        kl_k3(a, b[:3])


def test_grpo_loss_adds_beta_kl_with_same_aggregation():
    logp, old, adv, mask = _hand_example()
    ref = logp.detach() + math.log(0.5)  # k3 = 0.5 + log 2 - 1 on every token
    k = 0.5 + math.log(2) - 1
    hand = {loss_type: (kw, pol) for loss_type, kw, pol in HAND_POLICY_LOSS[:4]}  # the policy term alone
    for loss_type, kl_weight in (("grpo", 1.0), ("token-mean", 1.0), ("dr_grpo", 5 / 8)):  # dr_grpo: 5 / (2 * 4)
        kw, pol = hand[loss_type]
        loss, stats = grpo_loss(logp, old, ref, adv, mask, settings(beta=0.1, loss_type=loss_type), **kw)
        assert loss.item() == pytest.approx(pol + 0.1 * k * kl_weight, abs=1e-6)
        assert stats["kl"] == pytest.approx(k, abs=1e-6)
        assert stats["policy_loss"] == pytest.approx(pol, abs=1e-6)
    loss0, stats0 = grpo_loss(logp, old, None, adv, mask, settings())
    assert "kl" not in stats0 and loss0.item() == pytest.approx(HAND_POLICY_LOSS[0][2], abs=1e-6)
    with pytest.raises(ValueError, match="ref_logp"):
        grpo_loss(logp, old, None, adv, mask, settings(beta=0.1))


# --------------------------------------------------------------------------------------------- TRL parity


class _Accel:
    """Single-process stand-in for accelerate.Accelerator: gather/reduce are identities."""

    def __init__(self, num_processes=1):
        self.num_processes = num_processes
        self.sync_gradients = True
        self.is_main_process = True  # read by TRL's profiling decorator

    def gather(self, x):
        return x

    gather_for_metrics = gather

    def reduce(self, x, reduction="sum"):
        return x

    def autocast(self):
        return nullcontext()


def _trl_self(loss_type, beta, eps_low, eps_high, logp=None, max_len=None, delta=None, isl="token",
              num_processes=1, grad_accum=1, steps_per_generation=1):
    """The attributes GRPOTrainer._compute_loss reads, with every optional feature (vLLM IS, entropy masks,
    entropy bonus, off-policy masking, MoE aux loss) switched off."""
    from trl.trainer.grpo_trainer import GRPOTrainer

    stub = SimpleNamespace(
        loss_type=loss_type, beta=beta, epsilon_low=eps_low, epsilon_high=eps_high,
        importance_sampling_level=isl, top_entropy_quantile=1.0, off_policy_mask_threshold=None,
        use_vllm=False, vllm_importance_sampling_correction=False, aux_loss_enabled=False,
        _entropy_bonus_enabled=False, model=SimpleNamespace(training=True),
        current_gradient_accumulation_steps=grad_accum, max_completion_length=max_len,
        accelerator=_Accel(num_processes), _metrics={"train": defaultdict(list), "eval": defaultdict(list)},
        args=SimpleNamespace(use_bias_correction_kl=False, delta=delta, steps_per_generation=steps_per_generation),
        get_off_policy_mask=GRPOTrainer.get_off_policy_mask,
    )
    if logp is not None:  # feed our exact per-token log-probs instead of running a model
        stub._get_per_token_logps_and_entropies = lambda *a, **k: (logp, torch.zeros_like(logp), None)
    else:
        stub._get_per_token_logps_and_entropies = (
            lambda *a, **k: GRPOTrainer._get_per_token_logps_and_entropies(stub, *a, **k)
        )
    return stub


def _trl_inputs(mask, adv, old, ref, num_items=None, prompt=None):
    B, T = mask.shape
    prompt_ids = torch.zeros(B, 1, dtype=torch.long) if prompt is None else prompt
    return {
        "prompt_ids": prompt_ids,
        "prompt_mask": torch.ones_like(prompt_ids),
        "completion_ids": torch.zeros(B, T, dtype=torch.long),
        "completion_mask": mask,
        "advantages": adv,
        "old_per_token_logps": old,
        "ref_per_token_logps": ref,
        "num_items_in_batch": torch.tensor(float(mask.sum()) if num_items is None else float(num_items)),
    }


def _random_batch(seed, B=4, T=6, empty_row=False):
    g = torch.Generator().manual_seed(seed)
    logp = torch.log_softmax(torch.randn(B, T, 9, generator=g), -1)[..., 0]
    old = logp + 0.35 * torch.randn(B, T, generator=g)  # wide enough to hit both clip bounds
    ref = logp + 0.5 * torch.randn(B, T, generator=g)
    lengths = torch.randint(1, T + 1, (B,), generator=g)
    if empty_row:
        lengths[1] = 0
    mask = (torch.arange(T).unsqueeze(0) < lengths.unsqueeze(1)).long()
    adv = group_advantages(torch.randn(B, generator=g))
    return logp, old, ref, adv, mask


TRL_CASES = [
    # (trl loss_type, our loss_type, beta, eps_low, eps_high, extra)
    ("grpo", "grpo", 0.0, 0.2, 0.2, {}),
    ("grpo", "grpo", 0.04, 0.2, 0.2, {}),
    ("grpo", "grpo", 0.04, 0.2, 0.28, {"empty_row": True}),
    ("bnpo", "token-mean", 0.0, 0.2, 0.2, {}),
    ("bnpo", "bnpo", 0.1, 0.2, 0.28, {}),
    ("dr_grpo", "dr_grpo", 0.0, 0.2, 0.2, {"max_len": 8}),
    ("dr_grpo", "dr_grpo", 0.04, 0.1, 0.3, {"max_len": 8}),
    ("dapo", "dapo", 0.0, 0.2, 0.28, {}),
    ("dapo", "dapo", 0.04, 0.2, 0.2, {"empty_row": True}),
    ("grpo", "grpo", 0.04, 0.2, 0.2, {"delta": 1.3}),
    ("grpo", "grpo", 0.04, 0.2, 0.2, {"isl": "sequence"}),
]


@pytest.mark.parametrize("trl_type, our_type, beta, eps_low, eps_high, extra", TRL_CASES)
def test_parity_with_trl_compute_loss(trl_type, our_type, beta, eps_low, eps_high, extra):
    from trl.trainer.grpo_trainer import GRPOTrainer

    logp, old, ref, adv, mask = _random_batch(seed=len(str(extra)) + int(beta * 100), empty_row=extra.get("empty_row"))
    max_len, delta, isl = extra.get("max_len"), extra.get("delta"), extra.get("isl", "token")

    logp_trl = logp.clone().requires_grad_(True)
    stub = _trl_self(trl_type, beta, eps_low, eps_high, logp=logp_trl, max_len=max_len, delta=delta, isl=isl)
    trl_loss = GRPOTrainer._compute_loss(stub, None, _trl_inputs(mask, adv, old, ref if beta else None))
    trl_loss.backward()

    logp_ours = logp.clone().requires_grad_(True)
    objective = "gspo" if isl == "sequence" else "clip" if eps_high == eps_low else "clip_higher"
    loss, stats = grpo_loss(
        logp_ours, old, ref, adv, mask,
        settings(objective=objective, beta=beta, clip_eps_low=eps_low, loss_type=our_type, delta=delta,
                 clip_eps_high=None if eps_high == eps_low else eps_high),
        max_completion_length=max_len,
    )
    loss.backward()

    torch.testing.assert_close(loss, trl_loss, atol=1e-6, rtol=0)
    torch.testing.assert_close(logp_ours.grad, logp_trl.grad, atol=1e-6, rtol=0)
    m = stub._metrics["train"]
    if beta:
        assert stats["kl"] == pytest.approx(m["kl"][-1], abs=1e-6)
    if isl == "token":  # TRL counts sequence-level clipping per sequence, we count per token: compare token level
        assert stats["clip_frac"] == pytest.approx(m["clip_ratio/region_mean"][-1], abs=1e-6)
        assert stats["clip_frac_low"] == pytest.approx(m["clip_ratio/low_mean"][-1], abs=1e-6)
        assert stats["clip_frac_high"] == pytest.approx(m["clip_ratio/high_mean"][-1], abs=1e-6)
    if trl_type == "grpo" and not extra:
        assert stats["clip_frac"] > 0, "fixture should exercise clipping"


def test_parity_with_trl_dapo_global_normaliser():
    """TRL rescales num_items_in_batch by ranks, accumulation and steps_per_generation; our caller passes the
    resulting per-rank token count of one optimizer step."""
    from trl.trainer.grpo_trainer import GRPOTrainer

    logp, old, ref, adv, mask = _random_batch(seed=11)
    generation_tokens = 4 * float(mask.sum())  # e.g. 2 ranks x 2 micro-batches of similar size
    stub = _trl_self("dapo", 0.04, 0.2, 0.28, logp=logp, num_processes=2, grad_accum=2, steps_per_generation=2)
    trl_loss = GRPOTrainer._compute_loss(stub, None, _trl_inputs(mask, adv, old, ref, num_items=generation_tokens))
    dapo = settings(objective="clip_higher", beta=0.04, clip_eps_high=0.28, loss_type="dapo")
    ours, _ = grpo_loss(logp, old, ref, adv, mask, dapo, num_items_in_batch=generation_tokens / 2)
    torch.testing.assert_close(ours, trl_loss, atol=1e-6, rtol=0)
    assert ours.item() != pytest.approx(grpo_loss(logp, old, ref, adv, mask, dapo)[0].item())


def test_parity_with_trl_end_to_end_tiny_model():
    """TRL's fused LM head (temperature-scaled log-probs from the model) + _compute_loss vs our token_logprobs on
    the model's logits + grpo_loss: same log-probs, same loss, same parameter gradients."""
    from transformers import Qwen2Config, Qwen2ForCausalLM
    from trl.trainer.grpo_trainer import GRPOTrainer
    from trl.trainer.utils import add_fused_lm_head

    torch.manual_seed(0)
    model = Qwen2ForCausalLM(Qwen2Config(
        vocab_size=40, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, max_position_embeddings=64, tie_word_embeddings=True,
    ))
    temperature = 0.7
    add_fused_lm_head(model, temperature=temperature, outputs=("log_probs", "entropy"))
    g = torch.Generator().manual_seed(5)
    B, P, T = 4, 3, 5
    prompt = torch.randint(0, 40, (B, P), generator=g)
    completion = torch.randint(0, 40, (B, T), generator=g)
    mask = (torch.arange(T).unsqueeze(0) < torch.tensor([[5], [3], [4], [1]])).long()
    with torch.no_grad():
        logits = model(input_ids=torch.cat([prompt, completion], 1),
                       attention_mask=torch.cat([torch.ones_like(prompt), mask], 1)).logits
        cur = token_logprobs(logits[:, P - 1 : -1], completion, temperature)
    old = cur + 0.3 * torch.randn(B, T, generator=g)
    ref = cur + 0.3 * torch.randn(B, T, generator=g)
    adv = group_advantages(torch.tensor([[1.0, 0.0, 0.0, 1.0]]))[0]

    stub = _trl_self("grpo", 0.04, 0.2, 0.2, logp=None)
    inputs = _trl_inputs(mask, adv, old, ref, prompt=prompt)
    inputs["completion_ids"] = completion
    # TRL's own log-probs agree with ours on the loss tokens
    trl_logp, _, _ = GRPOTrainer._get_per_token_logps_and_entropies(
        stub, model, torch.cat([prompt, completion], 1), torch.cat([torch.ones_like(prompt), mask], 1), T
    )
    torch.testing.assert_close(trl_logp.detach()[mask.bool()], cur[mask.bool()], atol=1e-5, rtol=0)

    model.zero_grad()
    trl_loss = GRPOTrainer._compute_loss(stub, model, inputs)
    trl_loss.backward()
    trl_grads = {n: p.grad.clone() for n, p in model.named_parameters()}

    model.zero_grad()
    logits = model(input_ids=torch.cat([prompt, completion], 1),
                   attention_mask=torch.cat([torch.ones_like(prompt), mask], 1)).logits
    logp = token_logprobs(logits[:, P - 1 : -1], completion, temperature)
    loss, _ = grpo_loss(logp, old, ref, adv, mask, settings(beta=0.04, loss_type="grpo"))
    loss.backward()

    torch.testing.assert_close(loss, trl_loss, atol=1e-6, rtol=0)
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, trl_grads[name], atol=1e-6, rtol=1e-4, msg=name)
    assert any(float(g.abs().sum()) > 0 for g in trl_grads.values())
