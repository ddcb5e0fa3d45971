"""Settings that follow from `rollout.engine: vllm`: the engine/trainer correction is on by default (decided by
m1/marl/resolve.py, never by the validator)."""

import pytest

from tests.marl.test_trainer import team_dict
from m1.marl.config import TrainConfig
from m1.marl.resolve import resolve


def _cfg(tmp_path, engine, **grpo):
    rollout = {"num_generations": 2, "questions_per_step": 2}
    if engine == "vllm":
        rollout.update(engine="vllm", engine_url="http://127.0.0.1:1")
    return TrainConfig.model_validate({
        "team": team_dict(), "rollout": rollout, "grpo": grpo, "judge": {"method": "rubric"},
        "train_agents": ["alpha"], "learner": {"finetune": "lora"}, "steps": 1, "out_dir": str(tmp_path)})


def test_sampler_is_the_default_old_logprobs_with_a_vllm_engine(tmp_path):
    assert _cfg(tmp_path, "vllm").grpo.old_logprobs is None  # left to resolve: the config is as written
    assert resolve(_cfg(tmp_path, "vllm")).cfg.grpo.old_logprobs == "sampler"
    assert resolve(_cfg(tmp_path, "hf")).cfg.grpo.old_logprobs == "policy"
    assert resolve(_cfg(tmp_path, "vllm", old_logprobs="rollout")).cfg.grpo.old_logprobs == "rollout"


def test_policy_old_logprobs_with_a_vllm_engine_is_refused_naming_both_keys(tmp_path):
    with pytest.raises(ValueError, match=r"grpo\.old_logprobs: 'policy' with rollout\.engine: 'vllm'"):
        _cfg(tmp_path, "vllm", old_logprobs="policy")
