"""The policy objectives (m1/marl/algo/objectives.py) and advantage estimators (m1/marl/algo/advantages.py) are
registries: each shipped entry against its defining formula on hand-computed tensors and, where TRL 1.16 implements it,
against TRL's own `_compute_loss`; the rules each entry declares are what the config refuses; and an objective, an
estimator and a token-level estimator registered here, outside m1/, train one MARL step.

TRL parity: clip_higher is TRL's `epsilon_high` (its cases run in tests/marl/test_grpo.py TRL_CASES, which route
asymmetric bounds to clip_higher), gspo is `importance_sampling_level="sequence"`, cispo is `loss_type="cispo"`
with TRL's `epsilon_high` = 1 + our `clip_eps_high`. RLOO is pinned against its formula only: TRL's RLOOTrainer
computes the leave-one-out baseline inline in its generation step, with no function to call on a reward table.
"""
import math

import pytest
import torch

from m1.marl.algo.advantages import ESTIMATORS, AdvantageEstimator, anchor_state_advantages, \
    discounted_token_advantages, estimate_advantages, register_estimator, rloo_advantages, token_advantages
from m1.marl.config import GRPOSettings
from m1.marl.algo.objectives import OBJECTIVES, PolicyObjective, grpo_loss, masked_mean, register_objective
from m1.marl.rollout.episodes import Sample
from tests.core.test_registry import registries  # noqa: F401 (the fixture)
from tests.marl.test_grpo import _random_batch, _trl_inputs, _trl_self
from tests.marl.test_trainer import AGENTS, make_trainer, train_cfg


def settings(**kw):
    return GRPOSettings(**{"beta": 0.0, **kw})


def _batch(log_ratios, logp, mask, adv):
    """(logp with gradient, old log-probs, advantages, mask) with old = logp - log_ratio."""
    logp = torch.tensor(logp)
    old = logp - torch.tensor(log_ratios)
    return logp.requires_grad_(True), old, torch.tensor(adv), torch.tensor(mask)


# ------------------------------------------------------------------------------------------------ by hand
def test_clip_higher_bounds_the_ratio_above_at_1_plus_eps_high():
    # seq 0 (A = 1): ratios 1.25 (inside [0.8, 1.28]) and 1.3 (clipped to 1.28); seq 1 (A = -1): ratio 0.7, the
    # clipped term -0.8 is the smaller one, so the token is clipped below
    logp, old, adv, mask = _batch([[math.log(1.25), math.log(1.3)], [math.log(0.7), 0.0]],
                                  [[-1.0, -1.0], [-1.0, -1.0]], [[1.0, 1.0], [1.0, 0.0]], [1.0, -1.0])
    grpo = settings(objective="clip_higher", clip_eps_high=0.28, loss_type="token-mean")
    loss, stats = grpo_loss(logp, old, None, adv, mask, grpo)
    assert loss.item() == pytest.approx((-1.25 - 1.28 + 0.8) / 3, abs=1e-6)
    loss.backward()
    torch.testing.assert_close(logp.grad, torch.tensor([[-1.25 / 3, 0.0], [0.0, 0.0]]), atol=1e-6, rtol=0)
    assert stats["clip_frac_high"] == pytest.approx(1 / 3) and stats["clip_frac_low"] == pytest.approx(1 / 3)
    # the symmetric clip bounds the first token too: 1.25 -> 1.2
    symmetric, _ = grpo_loss(logp, old, None, adv, mask, settings(loss_type="token-mean"))
    assert symmetric.item() == pytest.approx((-1.2 - 1.2 + 0.8) / 3, abs=1e-6)


def test_gspo_takes_one_ratio_per_sequence_from_its_mean_token_log_ratio():
    # seq 0 (A = 1): log-ratios 0.1, 0.3 (and 5.0 on padding): s = exp(0.2) = 1.2214 > 1.2, clipped, no gradient.
    # seq 1 (A = -0.5): log-ratios -0.5, 0, 0.5 (token ratios 0.61 and 1.65, which a token-level clip would
    # clip): s = exp(0) = 1, inside the bounds
    logp, old, adv, mask = _batch([[0.1, 0.3, 5.0], [-0.5, 0.0, 0.5]], [[-1.0, -2.0, -3.0], [-1.0, -0.5, -2.0]],
                                  [[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]], [1.0, -0.5])
    loss, stats = grpo_loss(logp, old, None, adv, mask, settings(objective="gspo"))
    assert loss.item() == pytest.approx((-1.2 + 0.5) / 2, abs=1e-6)  # mean over sequences of -min(s A, clip(s) A)
    loss.backward()
    # d(-A s)/dlogp_t = -A s / |y| for each of seq 1's tokens, then the mean over the two sequences
    torch.testing.assert_close(logp.grad, torch.tensor([[0.0, 0.0, 0.0], [0.5 / 3 / 2] * 3]), atol=1e-6, rtol=0)
    s0 = math.exp(0.2)
    assert stats["ratio_mean"] == pytest.approx((2 * s0 + 3 * 1.0) / 5, abs=1e-6)  # per token, as the learner logs
    assert stats["clip_frac"] == stats["clip_frac_high"] == pytest.approx(2 / 5) and stats["clip_frac_low"] == 0
    token, _ = grpo_loss(logp, old, None, adv, mask, settings())
    assert token.item() != pytest.approx(loss.item(), abs=1e-3)  # the token-level clip differs


def test_cispo_weights_log_probs_by_the_capped_ratio_without_its_gradient():
    # seq 0 (A = 1): ratios 0.5, 1, 3 (capped at 1 + 1.0 = 2), log-probs -1, -2, -0.5; seq 1 (A = -1): ratio 1.5
    logp, old, adv, mask = _batch([[math.log(0.5), 0.0, math.log(3.0)], [math.log(1.5), 0.0, 0.0]],
                                  [[-1.0, -2.0, -0.5], [-1.0, -1.0, -1.0]], [[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]],
                                  [1.0, -1.0])
    grpo = settings(objective="cispo", clip_eps_high=1.0, loss_type="dapo")
    loss, stats = grpo_loss(logp, old, None, adv, mask, grpo)
    # -sg(w) A logp per token: 0.5, 2.0, 1.0 and -1.5; the token mean over the batch's 4 tokens
    assert loss.item() == pytest.approx((0.5 + 2.0 + 1.0 - 1.5) / 4, abs=1e-6)
    loss.backward()
    # every token keeps its gradient -w A / 4, the capped one too (w = 2 there)
    torch.testing.assert_close(logp.grad, torch.tensor([[-0.5 / 4, -1.0 / 4, -2.0 / 4], [1.5 / 4, 0.0, 0.0]]),
                               atol=1e-6, rtol=0)
    assert stats["clip_frac"] == pytest.approx(1 / 4)  # the capped token with A > 0
    assert stats["ratio_mean"] == pytest.approx((0.5 + 1.0 + 3.0 + 1.5) / 4, abs=1e-6)


def _reply(group: int, rollout: int, tokens: int, value: float) -> Sample:
    return Sample(agent="a", question_id=f"q{group}", group=group, rollout=rollout, phase="plan", prompt_ids=[1],
                  completion_ids=[7] * tokens, logprobs=None, reward=value, advantage=value)


def test_reinforce_pp_discounts_over_the_agents_later_replies_and_whitens_over_the_step():
    # episode (0, 0): a plan of 2 tokens, then an answer of 3, value 1; episode (0, 1): one token, value 0
    rows = [_reply(0, 0, 2, 1.0), _reply(0, 0, 3, 1.0), _reply(0, 1, 1, 0.0)]
    returns = [0.5 ** 4, 0.5 ** 3, 0.5 ** 2, 0.5, 1.0, 0.0]  # tokens after each, in its episode: 4 3 2 1 0; 0
    r = torch.tensor(returns, dtype=torch.float64)
    want = ((r - r.mean()) / torch.sqrt(r.var() + 1e-8)).tolist()
    got = discounted_token_advantages(rows, 0.5)
    assert [len(g) for g in got] == [2, 3, 1]
    assert [x for g in got for x in g] == pytest.approx(want, abs=1e-12)
    flat = [x for g in discounted_token_advantages(rows, 1.0) for x in g]  # no discount: the reward, whitened
    assert flat[:5] == pytest.approx([flat[0]] * 5) and flat[0] > 0 > flat[5]
    assert discounted_token_advantages([_reply(0, 0, 3, 1.0)], 1.0) == [[0.0, 0.0, 0.0]]  # no spread: zeros
    # through the registry: the sequence value is the reward itself, 0 where a sample is missing
    entry = ESTIMATORS["reinforce_pp"]
    seq = estimate_advantages(entry, {"a": [[1.0, float("nan")]]}, None, settings(baseline="reinforce_pp"))
    assert seq["a"].tolist() == [[1.0, 0.0]]
    out = token_advantages(entry, {"a": rows}, settings(baseline="reinforce_pp", gamma=0.5))["a"]
    assert [s.token_advantages for s in out] == [pytest.approx(g) for g in got]
    assert [s.advantage for s in out] == [1.0, 1.0, 0.0] and rows[0].token_advantages is None  # copies
    assert not out[0].zero_advantage and Sample(**{**vars(rows[2]), "token_advantages": [0.0]}).zero_advantage


def test_gigpo_compares_the_replies_written_from_one_state():
    """Question 0, three rollouts: the plans share a prompt (one state), two of the communicate decisions share
    another (the same notes), the third was written from other notes; question 1 has one rollout."""
    def reply(group, rollout, phase, prompt, reward, adv, tokens=2):
        return Sample(agent="a", question_id=f"q{group}", group=group, rollout=rollout, phase=phase,
                      prompt_ids=prompt, completion_ids=[7] * tokens, logprobs=None, reward=reward, advantage=adv)

    rows = [reply(0, 0, "plan", [1, 2], 1.0, 0.5), reply(0, 1, "plan", [1, 2], 0.0, -0.5),
            reply(0, 2, "plan", [1, 2], 0.5, 0.0),
            reply(0, 0, "communicate", [1, 2, 3], 1.0, 0.5, tokens=3), reply(0, 1, "communicate", [1, 2, 3], 0.0, -0.5),
            reply(0, 2, "communicate", [1, 2, 4], 0.5, 0.0), reply(1, 0, "plan", [1, 2], 1.0, 0.0)]
    got = anchor_state_advantages(rows, weight=0.5, scale=False)
    # plans: rewards 1, 0, 0.5 against their mean 0.5; the two decisions from notes [1, 2, 3]: 1, 0 against 0.5;
    # the decision from other notes and question 1's lone plan get no step term
    assert got == [[0.75] * 2, [-0.75] * 2, [0.0] * 2, [0.75] * 3, [-0.75] * 2, [0.0] * 2, [0.0] * 2]
    assert anchor_state_advantages(rows, weight=0.0, scale=False) == [[s.advantage] * len(s.completion_ids)
                                                                       for s in rows]
    scaled = anchor_state_advantages(rows[3:5], weight=1.0, scale=True)  # std of (1, 0) is 0.707
    assert scaled[0][0] == pytest.approx(0.5 + 0.5 / (0.5 ** 0.5 + 1e-4))
    out = token_advantages(ESTIMATORS["gigpo"], {"a": rows}, settings(baseline="gigpo", step_weight=0.5,
                                                                     scale_rewards=False))["a"]
    assert [s.token_advantages for s in out] == got and out[5].zero_advantage and not out[3].zero_advantage


def test_a_token_estimator_that_returns_the_wrong_shape_is_named():
    bad = AdvantageEstimator(name="short", estimate=lambda r, ref, s: r, tokens=lambda rows, s: [[1.0] for _ in rows])
    with pytest.raises(ValueError, match=r"estimator 'short': tokens\(\) must return one list per sample.*'a'"):
        token_advantages(bad, {"a": [_reply(0, 0, 2, 1.0)]}, settings())


def test_rloo_compares_each_reward_with_the_mean_of_the_others():
    nan = float("nan")
    rewards = torch.tensor([[1.0, 0.0, 0.0, 1.0], [2.0, 2.0, 2.0, nan], [3.0, nan, nan, nan], [1.0, 4.0, nan, 7.0]])
    adv = rloo_advantages(rewards)
    # row 0: 1 - 1/3 and 0 - 2/3; row 1 ties and row 2 has one sample: 0; row 3: 1 - 5.5, 4 - 4, 7 - 2.5
    want = torch.tensor([[2 / 3, -2 / 3, -2 / 3, 2 / 3], [0.0] * 4, [0.0] * 4, [-4.5, 0.0, 0.0, 4.5]])
    torch.testing.assert_close(adv, want, atol=1e-6, rtol=0)
    # = n / (n - 1) times the group-mean advantage
    torch.testing.assert_close(adv[0], 4 / 3 * (rewards[0] - rewards[0].mean()), atol=1e-6, rtol=0)
    got = estimate_advantages(ESTIMATORS["rloo"], {"a": rewards.tolist()}, None, settings(scale_rewards=False))
    torch.testing.assert_close(got["a"], want, atol=1e-6, rtol=0)
    assert torch.equal(rloo_advantages([[0.1, 0.1, 0.1]]), torch.zeros(1, 3))  # exact zeros for a tied group


# ------------------------------------------------------------------------------------------------ TRL parity
def _parity(trl_type, trl_eps_high, grpo, isl="token", seed=3, empty_row=False):
    """Our loss and gradient under `grpo` against TRL's `_compute_loss` with the same batch; returns both metric
    sets."""
    from trl.trainer.grpo_trainer import GRPOTrainer

    logp, old, ref, adv, mask = _random_batch(seed=seed, empty_row=empty_row)
    logp_trl = logp.clone().requires_grad_(True)
    stub = _trl_self(trl_type, grpo.beta, grpo.clip_eps_low, trl_eps_high, logp=logp_trl, delta=grpo.delta, isl=isl)
    trl_loss = GRPOTrainer._compute_loss(stub, None, _trl_inputs(mask, adv, old, ref if grpo.beta else None))
    trl_loss.backward()
    logp_ours = logp.clone().requires_grad_(True)
    loss, stats = grpo_loss(logp_ours, old, ref, adv, mask, grpo)
    loss.backward()
    torch.testing.assert_close(loss, trl_loss, atol=1e-6, rtol=0)
    torch.testing.assert_close(logp_ours.grad, logp_trl.grad, atol=1e-6, rtol=0)
    return stats, stub._metrics["train"]


@pytest.mark.parametrize("beta, eps_low, eps_high, delta, empty_row", [
    (0.0, 3e-4, 4e-4, None, False),  # the GSPO paper's bounds
    (0.04, 3e-4, 4e-4, None, True),
    (0.04, 0.2, None, 1.3, False),
])
def test_gspo_matches_trl_sequence_level_importance_sampling(beta, eps_low, eps_high, delta, empty_row):
    grpo = settings(objective="gspo", beta=beta, clip_eps_low=eps_low, clip_eps_high=eps_high, delta=delta)
    stats, trl = _parity("grpo", eps_low if eps_high is None else eps_high, grpo, isl="sequence", empty_row=empty_row)
    if beta:
        assert stats["kl"] == pytest.approx(trl["kl"][-1], abs=1e-6)
    if eps_low < 0.01:
        assert stats["clip_frac"] > 0, "the fixture should clip some sequences"


@pytest.mark.parametrize("beta, eps_high, seed", [(0.0, 0.5, 3), (0.04, 0.5, 4), (0.04, 3.0, 5)])
def test_cispo_matches_trl(beta, eps_high, seed):
    grpo = settings(objective="cispo", beta=beta, clip_eps_high=eps_high, loss_type="dapo")
    stats, trl = _parity("cispo", 1 + eps_high, grpo, seed=seed)
    assert stats["clip_frac"] == pytest.approx(trl["cispo_clip_ratio"][-1], abs=1e-6)
    if eps_high < 1:
        assert stats["clip_frac"] > 0, "the fixture should cap some weights"


# ------------------------------------------------------------------------------------------------ the entries' rules
@pytest.mark.parametrize("grpo, words", [
    ({"clip_eps_high": 0.28}, r"grpo.clip_eps_high=0.28 is not read by grpo.objective 'clip'.*clip_higher"),
    ({"objective": "clip_higher"}, "cannot run with grpo.clip_eps_high=None"),
    ({"objective": "gspo", "loss_type": "dapo"}, "'gspo' cannot run with grpo.loss_type='dapo'"),
    ({"objective": "gspo", "old_logprobs": "sampler"}, "'gspo' cannot run with grpo.old_logprobs='sampler'"),
    ({"objective": "cispo", "clip_eps_high": 4.0}, "'cispo' cannot run with grpo.loss_type='grpo'"),
    ({"objective": "cispo", "clip_eps_high": 4.0, "loss_type": "dapo", "delta": 2.0},
     "grpo.delta=2.0 is not read by grpo.objective 'cispo'"),
    ({"objective": "cispo", "clip_eps_high": 4.0, "loss_type": "dapo", "clip_eps_low": 0.1}, "clip_eps_low"),
    ({"baseline": "rloo"}, "'rloo' cannot run with grpo.scale_rewards=True"),
    ({"objective": "ppo"},
     r"unknown objective 'ppo'; registered: \['cispo', 'clip', 'clip_cov', 'clip_higher', 'gspo', 'kl_cov'\]"),
    ({"baseline": "mean"},
     r"unknown baseline 'mean'; registered: \['gigpo', 'greedy', 'group', 'reinforce_pp', 'rloo'\]"),
    ({"gamma": 0.9}, "grpo.gamma=0.9 is not read by grpo.baseline 'group'"),
    ({"step_weight": 0.5}, "grpo.step_weight=0.5 is not read by grpo.baseline 'group'"),
])
def test_the_config_refuses_what_the_chosen_entry_refuses(tmp_path, grpo, words):
    with pytest.raises(ValueError, match=words):
        train_cfg(tmp_path, grpo=grpo)


def test_reinforce_pp_refuses_dynamic_sampling(tmp_path):
    with pytest.raises(ValueError, match="'reinforce_pp' cannot run with rollout.dynamic_sampling=True"):
        train_cfg(tmp_path, grpo={"baseline": "reinforce_pp"}, rollout={"dynamic_sampling": True})


def test_gspo_refuses_the_sampler_weight_a_vllm_engine_would_default_to(tmp_path):
    """The rules read grpo.old_logprobs as the run will use it: unset, max_staleness > 0 means sampler."""
    with pytest.raises(ValueError, match="old_logprobs='sampler'"):
        train_cfg(tmp_path, grpo={"objective": "gspo"}, rollout={"max_staleness": 1})
    cfg = train_cfg(tmp_path, grpo={"objective": "gspo", "old_logprobs": "rollout"}, rollout={"max_staleness": 1})
    assert cfg.grpo.objective == "gspo"


@pytest.mark.parametrize("grpo", [
    {}, {"objective": "clip", "delta": 1.5}, {"objective": "clip_higher", "clip_eps_high": 0.28},
    {"objective": "gspo", "clip_eps_low": 3e-4, "clip_eps_high": 4e-4},
    {"objective": "cispo", "clip_eps_high": 4.0, "loss_type": "dapo"},
    {"objective": "clip_cov", "cov_ratio": 0.01, "cov_bounds": (0.5, 4.0)},
    {"objective": "kl_cov", "old_logprobs": "rollout", "cov_ratio": 0.01, "kl_cov_coef": 0.5},
    {"baseline": "rloo", "scale_rewards": False}, {"baseline": "greedy", "scale_rewards": False},
    {"baseline": "reinforce_pp", "gamma": 0.99}, {"baseline": "gigpo", "step_weight": 0.5, "scale_rewards": False},
])
def test_the_config_accepts_each_entry_with_its_settings(tmp_path, grpo):
    cfg = train_cfg(tmp_path, grpo=grpo)
    assert cfg.grpo.objective in OBJECTIVES and cfg.grpo.baseline in ESTIMATORS
    changed = {k for k, v in grpo.items() if v != GRPOSettings.model_fields[k].default}
    assert set(cfg.recorded()["grpo"]) == {"beta", *changed}  # new keys at their defaults leave records alone


def test_an_entry_gets_only_its_own_settings_and_names_are_not_taken_twice(registries):  # noqa: F811
    clip = OBJECTIVES["clip"]
    assert vars(clip.own_settings(settings(delta=1.5))) == {"clip_eps_low": 0.2, "delta": 1.5}
    assert register_objective(clip) is clip  # the same spec again: a no-op
    with pytest.raises(ValueError, match="policy objective 'clip' is already registered"):
        register_objective(PolicyObjective(name="clip", loss=clip.loss))
    with pytest.raises(ValueError, match="advantage estimator 'group' is already registered"):
        register_estimator(AdvantageEstimator(name="group", estimate=lambda r, ref, s: r))


# ------------------------------------------------------------------------------------------------ from outside m1/
def _reinforce(calls):
    """Plain REINFORCE, -A log p per token, with one metric of its own."""

    def loss(logp, old_logp, advantages, mask, own):
        calls.append("objective")
        assert vars(own) == {}  # it declared no settings, so none reach it
        return -advantages * logp, {"logp_mean": masked_mean(logp.detach(), mask)}

    return PolicyObjective(name="reinforce", loss=loss)


def _sign_of_gap(calls):
    """+1 above the group's mean reward, -1 below, 0 for a missing sample."""

    def estimate(rewards, reference, own):
        calls.append("estimator")
        assert reference is None and vars(own) == {"scale_rewards": False}
        return torch.nan_to_num(torch.sign(rewards - rewards.nanmean(dim=-1, keepdim=True)), nan=0.0)

    return AdvantageEstimator(name="sign_of_gap", estimate=estimate, settings=("scale_rewards",))


def _last_token(calls):
    """A token-level estimator: each reply's sign-of-gap advantage on its last token alone."""
    sign = _sign_of_gap([])

    def tokens(rows, own):
        calls.append("token_estimator")
        assert vars(own) == {"scale_rewards": False}
        return [[0.0] * (len(s.completion_ids) - 1) + [s.advantage] for s in rows]

    return AdvantageEstimator(name="last_token", estimate=sign.estimate, settings=("scale_rewards",), tokens=tokens)


@pytest.mark.slow
@pytest.mark.parametrize("new", ["objective", "estimator", "token_estimator"])
def test_an_entry_registered_here_trains_one_step(registries, new, tmp_path, video, m1_cache):  # noqa: F811
    """A policy objective, an advantage estimator or a token-level estimator registered from this file: one MARL
    step selects it by name (beside the shipped default of the other registry), calls it, and moves every trained
    agent's parameters; the objective's own metric reaches the step's row."""
    calls: list[str] = []
    grpo = {"beta": 0.0, "scale_rewards": False}
    if new == "objective":
        register_objective(_reinforce(calls))
        grpo["objective"] = "reinforce"
    elif new == "estimator":
        register_estimator(_sign_of_gap(calls))
        grpo["baseline"] = "sign_of_gap"
    else:
        register_estimator(_last_token(calls))
        grpo["baseline"] = "last_token"
    tr = make_trainer(train_cfg(tmp_path / "run", grpo=grpo), video)
    before = {a: tr.learners.parameters(a) for a in AGENTS}
    row = tr.train_step()
    assert calls.count(new) >= (len(AGENTS) if new != "estimator" else 1)
    for a in AGENTS:
        after = tr.learners.parameters(a)
        assert row[f"{a}/adv_abs_mean"] > 0
        assert any(not torch.equal(after[n], before[a][n]) for n in after), a
        assert (row[f"{a}/logp_mean"] < 0) if new == "objective" else f"{a}/logp_mean" not in row


# ------------------------------------------------------------------------------------------------ Clip-Cov, KL-Cov
def _cov_batch(old_shift=((0.0, 0.0), (0.0, 0.0))):
    """Two sequences of two tokens, A = 2 and -2: the covariances are 2.95, -2.85 (sequence 0) and -2.75, 2.85
    (sequence 1), mean 0.05, so the band (1, 5) holds the first token of sequence 0 and the second of sequence 1."""
    logp = torch.tensor([[-0.1, -3.0], [-0.2, -3.0]])
    old = logp - torch.tensor(old_shift)
    return logp.requires_grad_(True), old, torch.tensor([2.0, -2.0]), torch.ones(2, 2)


def test_clip_cov_cuts_the_gradient_of_the_band_tokens_and_keeps_the_loss_value():
    logp, old, adv, mask = _cov_batch()
    grpo = settings(objective="clip_cov", cov_ratio=0.5, loss_type="token-mean")
    loss, stats = grpo_loss(logp, old, None, adv, mask, grpo)
    assert loss.item() == pytest.approx(0.0, abs=1e-6)  # mean of -r A with r = 1: the cut tokens still count
    loss.backward()
    # -A / 4 per token, 0 where cut: both band tokens (0.5 of 4 tokens = 2)
    torch.testing.assert_close(logp.grad, torch.tensor([[0.0, -0.5], [0.5, 0.0]]), atol=1e-6, rtol=0)
    assert stats["cov_cut_frac"] == pytest.approx(0.5) and stats["cov_mean"] == pytest.approx(0.05, abs=1e-6)
    # the share rounds down to at least one token, drawn the same way every time
    cuts = []
    for _ in range(3):
        logp, old, adv, mask = _cov_batch()
        loss, stats = grpo_loss(logp, old, None, adv, mask, settings(objective="clip_cov", loss_type="token-mean"))
        loss.backward()
        cuts.append(tuple((logp.grad == 0).flatten().tolist()))
        assert stats["cov_cut_frac"] == pytest.approx(0.25)
    assert len(set(cuts)) == 1 and sum(cuts[0]) == 1 and (cuts[0][0] or cuts[0][3])
    # a band that holds no token cuts nothing: the objective is clip
    logp, old, adv, mask = _cov_batch()
    cov_loss, stats = grpo_loss(logp, old, None, adv, mask, settings(objective="clip_cov", cov_bounds=(3.0, 5.0)))
    cov_loss.backward()
    assert stats["cov_cut_frac"] == 0.0 and bool((logp.grad != 0).all())


def test_kl_cov_holds_the_highest_covariance_token_near_the_old_policy():
    logp, old, adv, mask = _cov_batch(old_shift=((0.1, 0.0), (0.0, -0.2)))
    grpo = settings(objective="kl_cov", cov_ratio=0.25, kl_cov_coef=1.0, old_logprobs="rollout",
                    loss_type="token-mean")
    loss, stats = grpo_loss(logp, old, None, adv, mask, grpo)
    r = torch.exp(torch.tensor([[0.1, 0.0], [0.0, -0.2]]))
    want = (-r * torch.tensor([[2.0], [-2.0]])).sum() + 0.1  # the unclipped surrogate, |0.1| on token (0, 0)
    assert loss.item() == pytest.approx(want.item() / 4, abs=1e-6)
    loss.backward()
    grad = -r * torch.tensor([[2.0], [-2.0]])
    grad[0, 0] += 1.0  # d|logp - old| = sign(0.1)
    torch.testing.assert_close(logp.grad, grad / 4, atol=1e-6, rtol=0)
    assert stats["cov_penalised_frac"] == pytest.approx(0.25)


@pytest.mark.parametrize("grpo, words", [
    ({"objective": "kl_cov"}, "'kl_cov' cannot run with grpo.old_logprobs=.*set grpo.old_logprobs: rollout"),
    ({"cov_ratio": 0.01}, r"grpo.cov_ratio=0.01 is not read by grpo.objective 'clip'.*clip_cov"),
    ({"objective": "kl_cov", "old_logprobs": "rollout", "cov_bounds": [0.5, 2.0]}, "cov_bounds"),
])
def test_the_config_refuses_covariance_settings_the_objective_does_not_read(tmp_path, grpo, words):
    with pytest.raises(ValueError, match=words):
        train_cfg(tmp_path, grpo=grpo)
