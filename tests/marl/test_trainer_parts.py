"""A trainer is built from values (m1/marl/parts.py): `prepare_run` decides the settings before anything loads,
`build_parts` loads the learners and releases them when a later part fails, and `Trainer` only stores what it is
given, so it can be built around stand-ins without loading a model."""
import pytest

from m1.marl import parts
from m1.marl.rollout.stream import QuestionStream
from m1.marl.trainer import Trainer, prepare_run
from m1.models.hub import ModelHub
from tests.conftest import varied_reward
from tests.marl.test_trainer import AGENTS, questions, train_cfg


class Learners:
    """A learner group that loads nothing and records its shutdown."""

    def __init__(self):
        self.down = False

    def chat_models(self):
        return {}

    def shutdown(self):
        self.down = True


def test_prepare_run_decides_the_settings_and_loads_nothing(tmp_path, monkeypatch):
    monkeypatch.setattr(parts, "build_learners", lambda *a, **k: pytest.fail("a model loaded"))
    run = prepare_run(train_cfg(tmp_path / "run"))
    assert run.placement is None and run.resume is None
    assert run.settings.cfg.grpo.old_logprobs == "policy"  # decided from the hf engine, synchronous
    assert run.settings.trained == AGENTS and run.settings.model_keys == {"alpha": "qa", "beta": "qb"}


def test_the_trainer_stores_the_values_it_is_given(tmp_path):
    run = prepare_run(train_cfg(tmp_path / "run"))
    learners, hub = Learners(), ModelHub(run.settings.team.models)
    data = QuestionStream(questions("v.mp4"), seed=0, shuffle=False)
    tr = Trainer(run, learners, None, hub, varied_reward, data)
    assert tr.learners is learners and tr.hub is hub and tr.data is data and tr.reward_fn is varied_reward
    assert tr.step == 0 and tr.trained == AGENTS and not hub.loaded()
    tr.close()
    assert learners.down


def test_build_parts_shuts_the_learners_down_when_a_later_part_fails(tmp_path, monkeypatch):
    group = Learners()
    monkeypatch.setattr(parts, "build_learners", lambda *a, **k: group)

    def broken(*a, **k):
        raise RuntimeError("the engines did not start")

    monkeypatch.setattr(parts, "RolloutEngines", broken)
    run = prepare_run(train_cfg(tmp_path / "run", rollout={"engine": "vllm"}))
    with pytest.raises(RuntimeError, match="the engines did not start"):
        parts.build_parts(run, reward_fn=varied_reward)
    assert group.down
