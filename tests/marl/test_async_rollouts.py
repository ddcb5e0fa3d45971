"""Asynchronous rollouts (rollout.max_staleness, m1/marl/producer.py): the producer never samples a step before its
weight version is staged, hands steps over in order, and an error in its thread is raised in the trainer's naming
the step; on the stand-in engines a k = 1 run samples step t with version max(0, t - 1), its first step equals the
synchronous run's, and a run stopped after a checkpoint resumes to the uninterrupted run's losses."""
import threading
import time

import pytest

from m1.marl.config import TrainConfig
from m1.marl.producer import Producer, StepItem, sampling_version
from m1.marl.rollout.episodes import RolloutError


def _trained(trainer, **train):
    """Train `trainer` and close it; its metrics rows."""
    try:
        return trainer.train(**train)
    finally:
        trainer.close()


def test_sampling_version_lags_by_k_from_version_zero():
    assert [sampling_version(t, 0) for t in range(4)] == [0, 1, 2, 3]
    assert [sampling_version(t, 1) for t in range(4)] == [0, 0, 1, 2]
    assert [sampling_version(t, 2) for t in range(5)] == [0, 0, 0, 1, 2]


class FakeTrainer:
    """Records which version was staged when each step was produced."""

    def __init__(self, producer_ref, fail_at=None, seconds=0.01):
        self.ref, self.fail_at, self.seconds = producer_ref, fail_at, seconds
        self.produced: list[tuple[int, int, int]] = []  # (step, version asked, newest staged then)

    def produce_step(self, step, version):
        if step == self.fail_at:
            raise ValueError("engine answered nonsense")
        self.produced.append((step, version, self.ref[0]._staged))
        time.sleep(self.seconds)
        return StepItem(step, version, None, {}, None, step + 1, 0, {"rollout": self.seconds})


def _run(k, steps, update_s=0.02, fail_at=None):
    ref = [None]
    fake = FakeTrainer(ref, fail_at)
    producer = ref[0] = Producer(fake, k, 0, steps, poll_s=0.05)
    producer.begin(0)
    got = []
    try:
        for step in range(steps):
            item = producer.get(step)
            got.append(item.step)
            time.sleep(update_s)  # the update
            producer.publish(step + 1)  # version step + 1 staged
    finally:
        producer.stop()
    return fake, got


@pytest.mark.parametrize("k", [1, 2])
def test_producer_waits_for_each_steps_version_and_keeps_the_order(k):
    fake, got = _run(k, 6)
    assert got == list(range(6))
    for step, version, staged in fake.produced:
        assert version == sampling_version(step, k)
        assert staged >= version  # never sampled before its weights were on the engines
    # it ran ahead: some step was produced while the update of the step before it had not been published
    assert any(staged < step for step, _, staged in fake.produced)


def test_a_failing_rollout_is_raised_in_the_trainers_thread_naming_the_step():
    with pytest.raises(RolloutError, match=r"rollouts of step 3 failed: ValueError: engine answered nonsense"):
        _run(1, 5, fail_at=2)


def test_stop_ends_the_thread_while_it_waits_for_weights():
    ref = [None]
    producer = ref[0] = Producer(FakeTrainer(ref), 1, 0, 10, poll_s=0.05)
    producer.begin(0)
    producer.get(0)
    producer.get(1)  # step 2 needs version 1, never published
    producer.stop(timeout=5)
    assert not any(t.name == "m1-rollout-producer" and t.is_alive() for t in threading.enumerate())


def test_max_staleness_refuses_the_learners_own_log_probs_and_hf_samplers_under_ray():
    from tests.marl.test_trainer import team_dict

    with pytest.raises(ValueError, match=r"grpo.old_logprobs: 'policy' with rollout.max_staleness 1"):
        TrainConfig.model_validate({"team": team_dict(), "rollout": {"max_staleness": 1},
                                    "grpo": {"old_logprobs": "policy"}})
    with pytest.raises(ValueError, match=r"rollout.max_staleness 2 with rollout.engine hf needs placement: local"):
        TrainConfig.model_validate({"team": team_dict(), "rollout": {"max_staleness": 2}, "placement": "ray"})


@pytest.mark.slow
def test_hf_k1_samples_with_a_copy_one_version_behind_and_resumes_to_the_same_losses(tmp_path, video, m1_cache):
    """On the hf engine the producer samples with copies of the learners' models: step 0 equals the synchronous
    run's (same weights, same samples), later steps are one version behind (the IS weight corrects them), and a run
    cut after step 2 resumes from the checkpoint's saved sampler weights to the uninterrupted run's losses."""
    from tests.marl.test_trainer import make_trainer, train_cfg

    def cfg(out, k, steps=3):
        return train_cfg(out, finetune="lora", steps=steps, rollout={"max_staleness": k},
                         learner={"lr": 5e-2}, grpo={"old_logprobs": "sampler"})

    want0 = _trained(make_trainer(cfg(tmp_path / "sync", 0, steps=1), video))
    want = _trained(make_trainer(cfg(tmp_path / "whole", 1), video))
    assert [r["async/staleness"] for r in want] == [0, 1, 1]
    assert want[0]["loss"] == pytest.approx(want0[0]["loss"], abs=1e-6)
    assert want[0]["alpha/is/ratio_mean"] == pytest.approx(1.0, abs=1e-4)  # the copy at version 0 = the learner
    assert abs(want[2]["alpha/is/ratio_mean"] - 1.0) > 1e-4  # one update behind: the weights differ

    first = _trained(make_trainer(cfg(tmp_path / "cut", 1), video), stop_after=2)
    assert (tmp_path / "cut" / "checkpoints" / "step-000002" / "versions" / "alpha" / "v000001").is_dir()
    rest = _trained(make_trainer(cfg(tmp_path / "cut", 1), video))
    for got, ref in zip(first + rest, want):
        assert got["loss"] == pytest.approx(ref["loss"], abs=1e-7)


# ------------------------------------------------------------------------------------------------ stand-in engines
def _cfg(out, k, steps=3):
    from tests.marl.test_engine_training import engine_cfg

    cfg = engine_cfg(out, steps=steps)
    return cfg.model_copy(update={"rollout": cfg.rollout.model_copy(update={"max_staleness": k})})


@pytest.mark.slow
def test_k1_on_engines_lags_one_version_stops_mid_flight_and_resumes_to_the_same_losses(tmp_path, video, m1_cache):
    import signal

    from tests.marl.test_engine_training import make
    from m1.marl.checkpoint import StopFlag

    want0 = _trained(make(_cfg(tmp_path / "sync", 0, steps=1), video))
    want = _trained(make(_cfg(tmp_path / "whole", 1), video))
    assert [r["async/staleness"] for r in want] == [0, 1, 1]
    # every model that shaped a sample's prompt (teammates' replies too) was that old, per agent
    assert [(r["alpha/staleness_max"], r["beta/staleness_mean"]) for r in want] == [(0, 0), (1, 1), (1, 1)]
    # step 0 samples with version 0 in both modes: the same samples, the same loss
    assert want[0]["loss"] == pytest.approx(want0[0]["loss"], abs=1e-7)
    assert all(r["time/wait_rollout"] >= 0 and r["time/wait_weights"] >= 0 for r in want)
    # each side's own CPU seconds: the learners' forward and backward run on the trainer's thread
    assert all(0 < r["time/producer_cpu"] and 0 < r["time/learner_cpu"] <= r["time/update"] + 1 for r in want)
    assert not (tmp_path / "whole" / "engine_weights" / "alpha" / "v000000").exists()  # pruned once unused

    # a stop (SIGTERM) while the producer is sampling step 2: the run checkpoints the step it finished and returns
    cut = make(_cfg(tmp_path / "cut", 1), video)
    flag = StopFlag()
    real = cut.produce_step

    def stopped_mid_flight(step, version):
        if step == 2:
            flag.signum = signal.SIGTERM
        return real(step, version)

    cut.produce_step = stopped_mid_flight
    try:
        first = cut.train(stop=flag)
    finally:
        cut.close()
    assert 1 <= len(first) <= 2
    ckpt = tmp_path / "cut" / "checkpoints" / f"step-{len(first):06d}"
    # the checkpoint keeps the older version its next step samples with
    assert sorted(p.name for p in (ckpt / "versions" / "alpha").iterdir()) == [f"v{len(first) - 1:06d}"]

    with pytest.raises(ValueError, match=r"max_staleness 1, the config says 0"):
        make(_cfg(tmp_path / "cut", 0), video)
    again = make(_cfg(tmp_path / "cut", 1), video)
    try:
        assert again.step == len(first)
        rest = again.train()
    finally:
        again.close()
    assert len(first) + len(rest) == 3
    for got, ref in zip(first + rest, want):
        assert got["loss"] == pytest.approx(ref["loss"], abs=1e-7)
        assert got["alpha/grad_norm"] == pytest.approx(ref["alpha/grad_norm"], rel=1e-6)


@pytest.mark.slow
def test_an_engine_dying_mid_flight_is_one_error_naming_the_agent(tmp_path, video, m1_cache):
    from tests.marl.test_engine_training import make
    from m1.models.vllm_client import EngineError

    tr = make(_cfg(tmp_path / "dies", 1), video)
    server = tr.engines._servers["beta"]
    real = tr.produce_step

    def dies(step, version):
        if step == 1:
            server.proc.kill()
            server.proc.wait()
        return real(step, version)

    tr.produce_step = dies
    try:
        # raised by the producer (sampling step 2) or by the trainer (staging version 1), whichever reaches it first
        with pytest.raises((RolloutError, EngineError), match=r"agent beta: rollout engine .* is not answering"):
            tr.train()
    finally:
        tr.close()
    assert not any(t.name == "m1-rollout-producer" and t.is_alive() for t in threading.enumerate())
