"""The MARL options that explore and credit the team's decisions. The entropy bonus (`grpo.entropy_coef`,
`grpo.entropy_phases`): its sampled-token estimate has the entropy's gradient in expectation, it reaches only the
phases named, and it trains decision samples whose advantage is 0, which the GRPO loss alone skips. Distinct plans
(`rollout.distinct_plans`) reach the team the rollouts run on. GiGPO's estimator runs a step beside the bonus."""
import dataclasses

import pytest
import torch
from pydantic import ValidationError

from m1.marl.actor.losses import StepSize, decision_entropy_bonus
from m1.marl.config import GRPOSettings, LearnerConfig
from tests.marl.test_loss_registry import TINY, random_samples


def test_the_estimate_has_minus_the_entropys_gradient_in_expectation():
    """Over a categorical policy, sum_a p(a) grad[sg(log p(a)) log p(a)] = -grad H (exact enumeration)."""
    theta = torch.tensor([0.3, -1.2, 2.0, 0.1], requires_grad=True)
    logp = torch.log_softmax(theta, -1)
    p = logp.detach().exp()
    one = StepSize(samples=1, tokens=1, prompt_tokens=0, run_tokens=1)
    expected = sum(p[a] * decision_entropy_bonus(logp[a].view(1, 1), torch.ones(1, 1), [True], one)
                   for a in range(4))
    (grad,) = torch.autograd.grad(expected, theta)
    fresh = torch.log_softmax(theta, -1)
    (entropy_grad,) = torch.autograd.grad(-(fresh.exp() * fresh).sum(), theta)
    torch.testing.assert_close(grad, -entropy_grad)


def test_only_the_named_phases_get_a_gradient():
    theta = torch.randn(3, 5, 7, generator=torch.Generator().manual_seed(0), requires_grad=True)
    logp = torch.log_softmax(theta, -1)[:, :, 0]  # [3, 5]: the log-prob of one token of seven at each position
    mask = torch.tensor([[1.0] * 5, [1.0] * 5, [1.0, 1.0, 0.0, 0.0, 0.0]])
    step = StepSize(samples=3, tokens=12, prompt_tokens=0, run_tokens=12)
    bonus = decision_entropy_bonus(logp, mask, [True, False, True], step)
    (grad,) = torch.autograd.grad(bonus, theta)
    assert grad[1].abs().sum() == 0  # a row of another phase
    assert grad[2, 2:].abs().sum() == 0  # padding
    assert (grad[0].abs().sum(-1) > 0).all() and (grad[2, :2].abs().sum(-1) > 0).all()
    want = float((logp.detach() ** 2 * mask)[[0, 2]].sum()) / 12
    assert float(bonus) == pytest.approx(want, rel=1e-6)


def test_settings_name_known_phases():
    assert GRPOSettings().entropy_coef == 0 and GRPOSettings().entropy_phases == ("plan", "communicate")
    assert GRPOSettings(entropy_phases=["act"]).entropy_phases == ("act",)
    with pytest.raises(ValidationError, match="entropy_phases: each once"):
        GRPOSettings(entropy_phases=["plan", "answers"])
    with pytest.raises(ValidationError, match="entropy_phases: each once"):
        GRPOSettings(entropy_phases=["plan", "plan"])
    assert "entropy_coef" not in GRPOSettings().recorded()  # a default is no part of a stored identity


@pytest.mark.slow
def test_zero_advantage_decisions_train_only_under_the_bonus(m1_cache):
    """With every advantage 0 the GRPO loss has no gradient and skips all samples; with the bonus the plan samples
    run (the answer samples still do not) and the weights move."""
    from m1.marl.actor.learner import AgentLearner

    samples = [dataclasses.replace(s, advantage=0.0, phase="plan" if i < 2 else "answer")
               for i, s in enumerate(random_samples(2))]
    cfg = LearnerConfig(finetune="full", lr=1e-2, micro_batch_size=8)
    runs = {}
    for coef in (0.0, 0.5):
        learner = AgentLearner.build("alpha", "qa", TINY, cfg, GRPOSettings(beta=0.0, entropy_coef=coef))
        before = learner.actor.parameters()
        stats = learner.actor.update(samples, lr=1e-2)
        after = learner.actor.parameters()
        runs[coef] = (stats, any(not torch.equal(after[n], before[n]) for n in before))
    (plain, moved_plain), (bonus, moved_bonus) = runs[0.0], runs[0.5]
    assert plain["samples_run"] == 0 and not moved_plain and "entropy_bonus" not in plain
    assert bonus["samples_run"] == 2 and moved_bonus and bonus["grad_norm"] > 0
    assert bonus["entropy_bonus"] > 0  # the weight times sum (log p)^2 / tokens: the term as the loss adds it


@pytest.mark.slow
def test_a_marl_step_with_gigpo_and_the_bonus_moves_every_agent(tmp_path, video, m1_cache):
    """The shipped decision options together in one MARL step: the anchor-state estimator (token advantages) and
    the entropy bonus, whose term reaches each agent's row."""
    from tests.marl.test_trainer import AGENTS, make_trainer, train_cfg

    grpo = {"beta": 0.0, "baseline": "gigpo", "scale_rewards": False, "entropy_coef": 0.1}
    tr = make_trainer(train_cfg(tmp_path / "run", grpo=grpo), video)
    before = {a: tr.learners.parameters(a) for a in AGENTS}
    row = tr.train_step()
    for a in AGENTS:
        after = tr.learners.parameters(a)
        assert any(not torch.equal(after[n], before[a][n]) for n in after), a
        assert row[f"{a}/entropy_bonus"] > 0


def test_distinct_plans_reach_the_rollout_team_and_keep_a_questions_rollouts_in_one_batch(tmp_path):
    from m1.marl.resolve import resolve
    from tests.marl.test_trainer import team_dict, train_cfg

    run = resolve(train_cfg(tmp_path, rollout={"num_generations": 3, "distinct_plans": 4},
                            team={**team_dict(), "limits": {**team_dict().get("limits", {}), "batch_episodes": 8}}))
    assert run.team.sampling.distinct_plans == 4 and run.team.limits.batch_episodes == 6  # a multiple of K = 3
    assert run.team.greedy().sampling.distinct_plans == 0  # the greedy baseline run and evaluation draw one plan
    plain = resolve(train_cfg(tmp_path, rollout={"num_generations": 3},
                              team={**team_dict(), "limits": {**team_dict().get("limits", {}), "batch_episodes": 8}}))
    assert plain.team.sampling.distinct_plans == 0 and plain.team.limits.batch_episodes == 8
    from m1.config_files import ConfigError
    from m1.marl.config import load_train_config

    with pytest.raises(ConfigError, match="rollout.distinct_plans: a weaver agent writes no plan"):
        load_train_config("weaver_synth", ["rollout.distinct_plans=2"])


def test_plan_fill_reaches_the_rollout_team_and_needs_the_policys_old_logprobs(tmp_path):
    from m1.config_files import ConfigError
    from m1.marl.config import load_train_config
    from m1.marl.resolve import resolve
    from tests.marl.test_trainer import train_cfg

    run = resolve(train_cfg(tmp_path, rollout={"num_generations": 3, "distinct_plans": 4, "plan_fill": "uniform"}))
    assert run.team.sampling.plan_fill == "uniform" and run.team.greedy().sampling.plan_fill == "repeat"
    assert resolve(train_cfg(tmp_path, rollout={"num_generations": 3})).team.sampling.plan_fill == "repeat"
    with pytest.raises(ConfigError, match="rollout.plan_fill: 'uniform' fills a group of distinct plans"):
        load_train_config("mini_recipe", ["rollout.plan_fill=uniform"])
    with pytest.raises(ConfigError, match="no sampler log-probs for grpo.old_logprobs: 'sampler'"):
        load_train_config("mini_recipe", ["rollout.plan_fill=uniform", "rollout.distinct_plans=4",
                                          "grpo.old_logprobs=sampler"])
