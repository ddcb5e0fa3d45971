"""MARL with `rollout.engine: vllm` against the CPU stand-in server (tests/engine_standin.py, the same HTTP API):
the run trains and its adapters move every step, samples carry the engine's ids, log-probs and weight version, after
every sync the engine scores a fixed completion as the learner does, and a server killed mid-step gives a clear
error while the resumed run repeats the uninterrupted one's losses."""
import sys
from pathlib import Path

import pytest

from tests.conftest import varied_reward
from tests.marl.test_trainer import questions, team_dict
from m1.marl.config import TrainConfig

STANDIN = str(Path(__file__).resolve().parents[1] / "engine_standin.py")
AGENTS = ["alpha", "beta"]


def engine_cfg(out, steps=2, engine="vllm", learner=None, **grpo):
    data = {"team": team_dict(), "rollout": {"num_generations": 2, "questions_per_step": 2},
            "grpo": {"beta": 0.05, "old_logprobs": "sampler", **grpo}, "judge": {"method": "rubric"},
            "learner": {"finetune": "lora", "lr": 5e-2, "micro_batch_size": 4, "max_completion_tokens": 16,
                        **(learner or {})},
            "steps": steps, "out_dir": str(out), "checkpoint": {"every": 1, "keep_last": 3},
            "log": {"progress": False, "backends": []}}
    if engine == "vllm":
        data["rollout"].update(engine="vllm", engine_command=[
            sys.executable, STANDIN, "--model", "{model}", "--port", "{port}", "--host", "{host}"])
    return TrainConfig.model_validate(data)


def make(cfg, video):
    from m1.marl.parts import make_trainer

    return make_trainer(cfg, questions=questions(video), reward_fn=varied_reward)


def _logprobs(learner, prompt, completion):
    import torch

    learner.actor.policy.eval()  # no LoRA dropout: the engine serves the weights as they are
    with torch.no_grad():
        logp, _ = learner.actor.compute_logprobs([(prompt, completion)], 1.0, model=learner.actor.policy)
    return logp[0].tolist()


@pytest.mark.slow
def test_engine_run_trains_syncs_and_matches_the_learner(tmp_path, video, m1_cache, monkeypatch):
    import torch

    tr = make(engine_cfg(tmp_path / "vllm"), video)
    seen = []
    real_update = tr.learners.update
    monkeypatch.setattr(tr.learners, "update", lambda samples, *a: seen.append(samples) or real_update(samples, *a))
    try:
        assert tr.team_cfg.limits.batch_episodes >= 4  # the step's episodes go to each engine at once
        fixed = {a: ([11, 12, 13, 14, 15, 16], [20, 21, 22, 23]) for a in AGENTS}
        before = {a: tr.learners.parameters(a) for a in AGENTS}
        for step in range(2):
            row = tr.train_step()
            assert all(row[f"{a}/samples"] > 0 for a in AGENTS) and torch.isfinite(torch.tensor(row["loss"]))
            assert "alpha/is/ratio_mean" in row and row["alpha/is/ratio_max"] >= 1.0
            if step == 0:  # later steps' weights were synced by the check below, before their step began
                assert all(row[f"{a}/sync_seconds"] > 0 for a in AGENTS)
            # the samples came from the engine at this step's weights, with its token ids and log-probs
            for agent in AGENTS:
                rows = seen[-1][agent]
                assert {s.weight_version for s in rows} == {step}
                assert all(s.logprobs is not None and len(s.logprobs) == len(s.completion_ids) for s in rows)
            # the adapters move every step, and after the sync the engine scores as the learner does
            after = {a: tr.learners.parameters(a) for a in AGENTS}
            for agent in AGENTS:
                moved = [n for n in after[agent] if not torch.equal(after[agent][n], before[agent][n])]
                assert moved and all("lora_" in n for n in after[agent])
            before = after
            tr.engines.sync(tr.step)
            for agent in AGENTS:
                prompt, completion = fixed[agent]
                engine = tr.engines.chats[agent].score(prompt, completion)
                learner = _logprobs(tr.learners.learners[agent], prompt, completion)
                assert engine == pytest.approx(learner, abs=1e-4)
        # only the adapter of the current version is kept, on the engine and on disk
        for agent in AGENTS:
            assert [p.name for p in (tmp_path / "vllm" / "engine_weights" / agent).iterdir()] == ["v000002"]
            assert tr.engines.chats[agent].models()[1:] == [f"{agent}-v2"]
    finally:
        tr.close()
    # the same fields as samples from the learners' own generate (hf), apart from the weight version
    hf = make(engine_cfg(tmp_path / "hf", engine="hf"), video)
    seen_hf = []
    real_hf = hf.learners.update
    monkeypatch.setattr(hf.learners, "update", lambda samples, *a: seen_hf.append(samples) or real_hf(samples, *a))
    try:
        hf.train_step()
    finally:
        hf.close()
    for agent in AGENTS:
        a, b = seen[0][agent][0], seen_hf[0][agent][0]
        assert set(vars(a)) == set(vars(b))
        assert b.weight_version is None and a.weight_version == 0
        assert {type(getattr(a, f)) for f in ("prompt_ids", "completion_ids", "logprobs")} == {list}
        assert {type(getattr(b, f)) for f in ("prompt_ids", "completion_ids", "logprobs")} == {list}


@pytest.mark.slow
def test_engine_killed_mid_step_is_a_clear_error_and_the_resumed_run_repeats_the_losses(tmp_path, video, m1_cache):
    from m1.models.vllm_client import EngineError

    whole = make(engine_cfg(tmp_path / "whole", steps=3), video)
    try:
        want = whole.train()
    finally:
        whole.close()

    cut = make(engine_cfg(tmp_path / "cut", steps=3), video)
    try:
        first = cut.train(stop_after=1)
        chat, server = cut.engines.chats["alpha"], cut.engines._servers["alpha"]
        real = chat.generate

        def dies_mid_step(requests, params):  # the engine process dies while step 2's rollouts are under way
            server.proc.kill()
            server.proc.wait()
            return real(requests, params)

        chat.generate = dies_mid_step
        with pytest.raises(EngineError, match=rf"agent alpha: rollout engine {server.url}.*resumes"):
            cut.train()
    finally:
        cut.close()
    assert cut.step == 1
    again = make(engine_cfg(tmp_path / "cut", steps=3), video)  # the same command again: new engines, resumed
    try:
        assert again.step == 1
        rest = again.train()
    finally:
        again.close()
    assert len(first) == 1 and len(rest) == 2
    for got, ref in zip(first + rest, want):
        assert got["loss"] == pytest.approx(ref["loss"], abs=1e-7)
        assert got["alpha/grad_norm"] == pytest.approx(ref["alpha/grad_norm"], rel=1e-6)


@pytest.mark.slow
def test_full_finetune_engine_serves_its_own_copy_and_every_reload_is_checked(tmp_path, video, m1_cache):
    """Full fine-tuning: each launched engine serves a copy of the model that M1 owns (the sync overwrites its
    weight files, never the model's own folder), the stand-in answers update_config with vLLM 0.32's HTTP 500 and
    the sync does not use it, and after every sync the engine scores as the learner does (checked by the sync's own
    probe too)."""
    import hashlib

    from m1.models.tiny import ensure_tiny

    tr = make(engine_cfg(tmp_path / "full", steps=2, learner={"finetune": "full", "lr": 1e-3}), video)
    originals = {a: ensure_tiny(tr.team_cfg.models[k].tiny) for a, k in (("alpha", "qa"), ("beta", "qb"))}
    digest = {a: hashlib.sha256((f / "model.safetensors").read_bytes()).hexdigest() for a, f in originals.items()}
    try:
        for agent in AGENTS:
            assert tr.engines.chats[agent].engine_folder() == (tmp_path / "full" / "engines" / f"model-{agent}")
        for step in range(2):
            row = tr.train_step()
            if step == 0:  # later steps' weights were synced by the check below, before their step began
                assert all(row[f"{a}/sync_seconds"] > 0 for a in AGENTS)
            tr.engines.sync(tr.step)
            for agent in AGENTS:
                prompt, completion = [11, 12, 13, 14, 15, 16], [20, 21, 22, 23]
                engine = tr.engines.chats[agent].score(prompt, completion)
                assert engine == pytest.approx(_logprobs(tr.learners.learners[agent], prompt, completion), abs=1e-4)
                assert tr.engines.chats[agent].weight_version == tr.step
    finally:
        tr.close()
    for agent, f in originals.items():  # the model's own folder was never written
        assert hashlib.sha256((f / "model.safetensors").read_bytes()).hexdigest() == digest[agent]
