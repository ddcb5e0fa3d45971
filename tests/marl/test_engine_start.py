"""Rollout engines launched by M1, against the CPU stand-in server (tests/engine_standin.py): all
agents' engines start at once, a failed start names its agent and stops the others, and an agent seated with an SFT
adapter is served its merged weights, not its base."""

import os
import sys
import threading
from pathlib import Path

import pytest

import m1.marl.rollout_engines as engines_mod
from tests.marl.test_trainer import team_dict
from m1.marl.config import TrainConfig
from m1.marl.rollout_engines import RolloutEngines
from m1.models.vllm_client import EngineError
from m1.models.vllm_server import CPU_BIND_ENV, cpu_core_shares

STANDIN = str(Path(__file__).resolve().parents[1] / "engine_standin.py")
COMMAND = [sys.executable, STANDIN, "--model", "{model}", "--port", "{port}", "--host", "{host}"]


def _cfg(tmp_path, team=None, command=COMMAND):
    return TrainConfig.model_validate({
        "team": team or team_dict(), "judge": {"method": "rubric"}, "steps": 1, "out_dir": str(tmp_path),
        "rollout": {"num_generations": 2, "questions_per_step": 2, "engine": "vllm", "engine_command": command},
        "learner": {"finetune": "lora", "max_completion_tokens": 8}})


def _specs(cfg):
    team = cfg.team_config()
    return {a.name: (a.model, team.models[a.model]) for a in team.agents}


def test_engines_start_in_parallel(tmp_path, monkeypatch):
    """Each launch waits at a barrier that only all agents' launches together pass: one after another, the first
    would wait alone and the barrier would break."""
    cfg = _cfg(tmp_path)
    specs = _specs(cfg)
    barrier, events, lock = threading.Barrier(len(specs), timeout=60), [], threading.Lock()
    real = RolloutEngines._launch

    def launch(self, agent, model, logs, placement):
        with lock:
            events.append(("start", agent))
        barrier.wait()
        url = real(self, agent, model, logs, placement)
        with lock:
            events.append(("ready", agent))
        return url

    monkeypatch.setattr(RolloutEngines, "_launch", launch)
    engines = RolloutEngines(cfg, specs, learners=None)
    try:
        assert sorted(engines.chats) == sorted(specs)
        kinds = [k for k, _ in events]
        assert kinds[:len(specs)] == ["start"] * len(specs) and kinds[len(specs):] == ["ready"] * len(specs)
    finally:
        engines.close()


def test_a_failed_start_names_its_agent_and_stops_the_started_engines(tmp_path, monkeypatch):
    cfg = _cfg(tmp_path)
    started, stopped = [], []
    real_start, real_stop = engines_mod.EngineServer.start, engines_mod.EngineServer.stop

    def start(self, *a, **k):
        if "beta" in self.name:
            raise EngineError(f"{self.name}: exited before it was ready (stand-in failure)")
        started.append(self)
        return real_start(self, *a, **k)

    def stop(self, *a, **k):
        stopped.append(self)
        return real_stop(self, *a, **k)

    monkeypatch.setattr(engines_mod.EngineServer, "start", start)
    monkeypatch.setattr(engines_mod.EngineServer, "stop", stop)
    with pytest.raises(EngineError, match=r"1 of 2 rollout engines failed to start.*agent beta: rollout engine: "
                                          r"exited before it was ready"):
        RolloutEngines(cfg, _specs(cfg), learners=None)
    assert len(started) == 1 and started[0] in stopped and not started[0].alive()


def _adapter(tmp_path, spec, key):
    """A peft LoRA adapter for the tiny model with nonzero B (a fresh adapter is a no-op), as an SFT run saves it."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from m1.models.hf import resolve_source

    base = AutoModelForCausalLM.from_pretrained(resolve_source(spec, key)[0], torch_dtype=torch.float32)
    model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    torch.manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.5)
    folder = tmp_path / "sft-adapter"
    model.save_pretrained(folder)
    return str(folder)


def _hf_logprobs(spec, key, prompt, completion):
    import torch

    from m1.models.hf import HFChatModel

    model = HFChatModel(spec.model_copy(update={"dtype": "float32"}), key).model
    ids = torch.tensor([prompt + completion])
    with torch.no_grad():
        logp = torch.log_softmax(model(ids).logits[0, :-1].float(), -1)
    return [logp[len(prompt) - 1 + i, t].item() for i, t in enumerate(completion)]


def test_an_agent_seated_with_an_adapter_is_served_the_merged_weights(tmp_path):
    team = team_dict()
    team["models"]["qa"]["dtype"] = "float32"
    bare = _cfg(tmp_path / "bare", team=team)
    key, spec = _specs(bare)["alpha"]
    adapter = _adapter(tmp_path, spec, key)
    team["models"]["qa"]["adapter"] = adapter
    cfg = _cfg(tmp_path / "run", team=team)
    seated = _specs(cfg)["alpha"][1]
    engines = RolloutEngines(cfg, {"alpha": (key, seated)}, learners=None)
    try:
        prompt, completion = [1, 2, 3, 4, 5], [6, 7, 8]
        served = engines.chats["alpha"].score(prompt, completion)
        merged = _hf_logprobs(seated, key, prompt, completion)
        base = _hf_logprobs(spec, key, prompt, completion)
        assert served == pytest.approx(merged, abs=1e-4)
        assert max(abs(a - b) for a, b in zip(served, base)) > 1e-2  # the adapter moved them: not the base's
        assert (tmp_path / "run" / "engines" / "seated-alpha" / "config.json").is_file()
    finally:
        engines.close()


def test_core_shares_are_disjoint_and_take_turns_when_cores_run_short():
    assert cpu_core_shares(2, range(8)) == ["0,1,2,3", "4,5,6,7"]
    assert cpu_core_shares(3, [4, 5, 6, 7]) == ["4", "5", "6"]
    assert cpu_core_shares(4, [0, 1]) == ["0", "1", "0", "1"]
    with pytest.raises(ValueError, match="no core shares"):
        cpu_core_shares(2, [])


def test_engines_launched_here_get_cores_of_their_own_unless_the_user_binds_them(tmp_path, monkeypatch):
    """vLLM-CPU's default binds every engine's compute threads to the same cores; M1 gives each engine it launches
    its own share (round-robin on a small host), and leaves VLLM_CPU_OMP_THREADS_BIND alone when the user set it."""
    monkeypatch.delenv(CPU_BIND_ENV, raising=False)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 3})
    cfg = _cfg(tmp_path / "own")
    engines = RolloutEngines(cfg, _specs(cfg), learners=None)
    try:
        binds = {a: s.env.get(CPU_BIND_ENV) for a, s in engines._servers.items()}
        assert binds == {"alpha": "0,1", "beta": "2,3"}
    finally:
        engines.close()
    monkeypatch.setenv(CPU_BIND_ENV, "nobind")
    cfg = _cfg(tmp_path / "user")
    engines = RolloutEngines(cfg, _specs(cfg), learners=None)
    try:
        assert {s.env[CPU_BIND_ENV] for s in engines._servers.values()} == {"nobind"}
    finally:
        engines.close()
