"""Learner groups across processes, on CPU: a 2-rank ZeRO-2 group (gloo) against one process, Ray actors in the
bundles the placement plan gave them (GPUs declared to Ray, none real), a killed 2-rank run resumed, and the
shared-storage check. The GPU-only parts (NCCL, real devices) ran in scripts/gpu_check.py on an H200."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import varied_reward
from tests.marl.test_trainer import _synthetic_samples, questions, team_dict
from m1.config import TeamConfig
from m1.marl.config import GRPOSettings, LearnerConfig, TrainConfig

ROOT = Path(__file__).resolve().parents[2]
# eps=1 makes Adam's first step ~ g / (|g| + 1): smooth in g, so float rounding in the ranks' gradient sum stays
# at rounding size (with eps=1e-8 the step is ~sign(g), and a near-zero entry can flip)
LEARNER = {"finetune": "full", "lr": 1e-2, "eps": 1.0, "micro_batch_size": 2, "precision": "fp32",
           "deepspeed": "zero2", "max_grad_norm": None}


@pytest.fixture(scope="module")
def ray_cluster(m1_cache):
    """A local Ray with 4 GPUs declared (this machine has none: actors see CUDA_VISIBLE_DEVICES and run on CPU)."""
    ray = pytest.importorskip("ray", reason="ray is not installed (pip install ray==2.60.0)")

    ray.init(num_cpus=2, num_gpus=4, include_dashboard=False, object_store_memory=200 * 2**20,
             runtime_env={"env_vars": {"OMP_NUM_THREADS": "1", "M1_CACHE": m1_cache, "HF_HUB_OFFLINE": "1"}})
    yield ray
    ray.shutdown()


def gpu_team():
    """The test team with alpha's model on `auto`, so the plan gives alpha's learner GPUs."""
    team = team_dict()
    team["models"]["qa"]["device"] = "auto"
    return team


@pytest.mark.slow
def test_two_rank_zero2_group_matches_one_process_in_the_planned_bundles(ray_cluster, tmp_path):
    import torch

    from m1.marl.actor.groups import LocalLearners, RayLearners, reserve_placement

    cfg = TrainConfig.model_validate({
        "team": gpu_team(), "train_agents": ["alpha"], "judge": {"method": "rubric"}, "grpo": {"beta": 0.05},
        "learner": {**LEARNER, "gpus": 2}, "placement": "ray", "out_dir": str(tmp_path),
        "cluster": {"gpu_mem_gb": 80, "cpus_per_gpu": 0}})
    placement = reserve_placement(cfg)
    assert placement is not None and [str(s) for s in placement.plan.learners["alpha"]] == ["node 0 gpu 0", "node 0 gpu 1"]
    spec = TeamConfig.model_validate(gpu_team()).models["qa"]
    grpo = GRPOSettings(beta=0.05)
    group = RayLearners({"alpha": ("qa", spec)}, cfg.learner, grpo, 0, cfg.ray, tmp_path, {"alpha": 2}, placement)
    try:
        # the ranks sit in the bundles the plan gave them and nowhere else: Ray takes 0.001 of a bundle's
        # `bundle_group_<index>_<group id>` resource for each actor placed in it
        pg = placement.group.id.hex()
        free = ray_cluster.available_resources()
        taken = {i for i in range(len(placement.bundles.bundles)) if free.get(f"bundle_group_{i}_{pg}", 1000) < 1000}
        assert taken == {placement.bundles.index[("learner", "alpha", r)] for r in (0, 1)}
        assert all(group.where[("alpha", r)]["placement_group"] == pg for r in (0, 1))
        assert [group.where[("alpha", r)]["world"] for r in (0, 1)] == [2, 2]  # one process group of two ranks
        assert len({tuple(group.where[("alpha", r)]["gpu_ids"]) for r in (0, 1)}) == 2  # two different GPUs
        one = LocalLearners({"alpha": ("qa", spec)}, LearnerConfig(**LEARNER), grpo, 0)
        before = one.parameters("alpha")
        # 5 samples, micro-batches of 2: rank 0 runs 2+1, rank 1 runs 2 and a zero-weight padding micro-batch
        samples = {"alpha": _synthetic_samples(5)}
        got, want = group.update(samples, 1e-2)["alpha"], one.update(samples, 1e-2)["alpha"]
        assert got["samples"] == want["samples"] == 5 and got["tokens"] == want["tokens"]
        assert got["loss"] == pytest.approx(want["loss"], abs=1e-6)
        assert got["kl"] == pytest.approx(want["kl"], abs=1e-7)
        after_group, after_one = group.parameters("alpha"), one.parameters("alpha")
        for name, p in after_one.items():
            assert not torch.equal(p, before[name])
            torch.testing.assert_close(after_group[name], p, atol=1e-5, rtol=1e-5)
        # generation is split across the two ranks and comes back in request order
        from m1.models.base import ChatRequest, SamplingParams

        reqs = [ChatRequest([{"role": "user", "content": f"question {i}"}]) for i in range(3)]
        outs = group.chat_models()["alpha"].generate(reqs, SamplingParams(max_new_tokens=4, temperature=0.0))
        local = one.chat_models()["alpha"].generate(reqs, SamplingParams(max_new_tokens=4, temperature=0.0))
        assert [o.prompt_ids for o in outs] == [o.prompt_ids for o in local]
        # a full reload's probe is answered by rank 0 at the updated weights (not "did not move" from the driver)
        probe = (outs[0].prompt_ids, outs[0].completion_ids)
        got_lp, got_tol = group.probe_logprobs("alpha", probe)
        want_lp, want_tol = one.probe_logprobs("alpha", probe)
        assert len(got_lp) == len(probe[1]) and got_tol == want_tol == 1e-3
        assert got_lp == pytest.approx(want_lp, abs=1e-4)
    finally:
        group.shutdown()
        placement.release()


@pytest.mark.slow
def test_killed_two_rank_run_resumes_with_the_same_losses(ray_cluster, tmp_path, video):
    from m1.marl.parts import make_trainer

    def run(out, stop_after=None):
        cfg = TrainConfig.model_validate({
            "team": team_dict(), "train_agents": ["alpha"], "judge": {"method": "rubric"}, "grpo": {"beta": 0.05},
            "rollout": {"num_generations": 2, "questions_per_step": 2}, "learner": {**LEARNER, "gpus": 2},
            "placement": "ray", "steps": 2, "out_dir": str(out), "checkpoint": {"every": 1, "keep_last": 2},
            "log": {"progress": False, "backends": []}})
        tr = make_trainer(cfg, questions=questions(video), reward_fn=varied_reward)
        try:
            return tr.train(stop_after=stop_after)
        finally:
            tr.close()

    whole = run(tmp_path / "whole")
    first = run(tmp_path / "cut", stop_after=1)  # "killed" after its step-1 checkpoint
    ckpt = tmp_path / "cut" / "checkpoints" / "step-000001" / "agents" / "alpha"
    assert (ckpt / "rng.pt").is_file() and (ckpt / "rng-rank1.pt").is_file()
    assert sorted(p.name for p in ckpt.glob("zero-rank*.pt")) == ["zero-rank0.pt", "zero-rank1.pt"]  # one per rank
    rest = run(tmp_path / "cut")
    assert len(whole) == 2 and len(first) == 1 and len(rest) == 1
    for got, want in zip(first + rest, whole):
        assert got["loss"] == pytest.approx(want["loss"], abs=1e-7)
        assert got["alpha/grad_norm"] == pytest.approx(want["alpha/grad_norm"], rel=1e-6)


def test_out_dir_on_two_nodes_disks_is_refused(tmp_path):
    from m1.marl.actor.distributed import DistributedError
    from m1.marl.actor.groups import check_shared_storage, write_storage_marker

    shared, other_disk = tmp_path / "run", tmp_path / "node1-local"
    same = lambda folder, name, token: write_storage_marker(folder, name, token)  # noqa: E731

    def elsewhere(folder, name, token):  # the same path resolved on another node's own disk
        write_storage_marker(str(other_disk / Path(folder).relative_to(tmp_path)), name, token)
        return "node1"

    check_shared_storage(shared, {"agent alpha rank 0": same, "agent alpha rank 1": same})  # one file system: ok
    with pytest.raises(DistributedError, match=r"not shared storage.*agent alpha rank 1 wrote on host node1"):
        check_shared_storage(shared, {"agent alpha rank 0": same, "agent alpha rank 1": elsewhere})
    assert not list((shared / ".storage-check").glob("*"))  # the check leaves nothing behind


def test_several_gpus_need_ray_and_deepspeed(m1_cache):
    from m1.marl.actor.distributed import DistributedError
    from m1.marl.actor.groups import build_learners
    from m1.marl.actor.learner import AgentLearner

    spec = TeamConfig.model_validate(team_dict()).models["qa"]
    with pytest.raises(DistributedError, match="placement: ray"):
        build_learners({"alpha": ("qa", spec)}, LearnerConfig(**{**LEARNER, "gpus": 2}), GRPOSettings(), 0,
                       worlds={"alpha": 2})
    with pytest.raises(ValueError, match="set learner.deepspeed"):
        AgentLearner.build("alpha", "qa", spec, LearnerConfig(finetune="full"), GRPOSettings(), rank=0, world=2)


@pytest.mark.slow
def test_gpu_check_tiny_runs_every_step_on_cpu():
    """scripts/gpu_check.py --tiny: the GPU check's steps with tiny models (the paper's run is in the README)."""
    # a fresh process: not the rendezvous variables this test process set for its own one-process DeepSpeed runs
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "gpu_check.py"), "--tiny"], capture_output=True,
                          text=True, timeout=300, env={**env, "HF_HUB_OFFLINE": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout)
    steps = out["steps"]
    assert out["ok"] and set(steps) == {"lora_learner", "generate_8", "generate_32", "grpo_update", "resume",
                                        "full_3b"}
    assert steps["lora_learner"]["deepspeed"] and steps["lora_learner"]["weights_dtype"] == "bfloat16"
    up = steps["grpo_update"]
    assert up["base_dtype"] == "torch.bfloat16" and up["master_dtype"] == "torch.float32"
    assert up["samples"] == 4 and up["base_probes_unchanged"] > 0
    assert steps["resume"]["loss_after_save"] == steps["resume"]["loss_after_reload"]
    full = steps["full_3b"]
    assert full["fits"] and full["reference_dtype"] == "torch.bfloat16" and full["fp32_masters_moved"]
    assert steps["generate_32"]["tokens_per_s"] > 0


def test_deepspeed_config_fills_auto_values_and_accumulates_bf16_gradients_in_fp32(tmp_path):
    from m1.marl.actor.distributed import DistributedError, resolve_ds_config

    bf16 = resolve_ds_config("zero2", micro_batch_size=4, max_grad_norm=1.0, bf16=True)
    assert bf16["bf16"]["enabled"] and bf16["data_types"]["grad_accum_dtype"] == "fp32"
    assert bf16["train_micro_batch_size_per_gpu"] == 4 and bf16["gradient_clipping"] == 1.0
    assert bf16["zero_optimization"]["stage"] == 2 and bf16["gradient_accumulation_steps"] == 1
    fp32 = resolve_ds_config("zero2", micro_batch_size=2, max_grad_norm=None, bf16=False)
    assert not fp32["bf16"]["enabled"] and "data_types" not in fp32 and fp32["gradient_clipping"] == 0.0
    bad = tmp_path / "z3.json"
    bad.write_text(json.dumps({"zero_optimization": {"stage": 3}}))
    with pytest.raises(DistributedError, match="ZeRO-3"):
        resolve_ds_config(bad, micro_batch_size=1, max_grad_norm=None, bf16=True)


@pytest.mark.parametrize("finetune", ["lora", "full"])
def test_bf16_learner_dtypes_without_deepspeed(finetune, m1_cache):
    """bf16 training in plain torch: LoRA keeps a bf16 base and fp32 adapter weights; a full fine-tune keeps fp32
    weights (a 1e-7 step would round away in bf16) and a bf16 reference."""
    import torch

    from m1.marl.actor.learner import AgentLearner

    spec = TeamConfig.model_validate(team_dict()).models["qa"]
    learner = AgentLearner.build("alpha", "qa", spec, LearnerConfig(finetune=finetune, precision="bf16"),
                                 GRPOSettings(beta=0.05))
    trainable = {p.dtype for p in learner.actor.optim.params}
    frozen = {p.dtype for p in learner.actor.policy.parameters() if not p.requires_grad}
    assert trainable == {torch.float32}
    if finetune == "lora":
        assert learner.actor.weights_dtype == "bfloat16" and frozen == {torch.bfloat16} and learner.actor.ref is None
    else:
        assert learner.actor.weights_dtype == "float32" and not frozen
        assert {p.dtype for p in learner.actor.ref.parameters()} == {torch.bfloat16}


@pytest.mark.slow
def test_async_rollouts_with_a_two_rank_ray_group_and_engines(ray_cluster, tmp_path, video):
    """rollout.max_staleness 1 under the placement plan: alpha's learner a 2-rank ZeRO-2 LoRA group of Ray actors,
    its rollouts on a stand-in vLLM engine; the producer samples step 1 with version 0 while the group updates, and
    the adapter rank 0 exports is what the engine serves next."""
    from tests.marl.test_engine_training import STANDIN
    from m1.marl.parts import make_trainer

    cfg = TrainConfig.model_validate({
        "team": team_dict(), "train_agents": ["alpha"], "judge": {"method": "rubric"}, "grpo": {"beta": 0.05},
        "rollout": {"num_generations": 2, "questions_per_step": 2, "max_staleness": 1, "engine": "vllm",
                    "engine_command": [sys.executable, STANDIN, "--model", "{model}", "--port", "{port}",
                                       "--host", "{host}"]},
        "learner": {**LEARNER, "finetune": "lora", "gpus": 2}, "placement": "ray", "steps": 3,
        "out_dir": str(tmp_path), "checkpoint": {"every": 1, "keep_last": 2}, "log": {"progress": False,
                                                                                   "backends": []}})
    tr = make_trainer(cfg, questions=questions(video), reward_fn=varied_reward)
    try:
        rows = tr.train()
        assert [r["async/staleness"] for r in rows] == [0, 1, 1]
        assert all(r["alpha/samples"] > 0 and r["loss"] == r["loss"] for r in rows)
        assert tr.engines.chats["alpha"].served_model == "alpha-v1"  # step 2 sampled with rank 0's adapter v1
    finally:
        tr.close()
