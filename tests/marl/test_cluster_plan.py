"""The placement plan (m1/marl/plan/planner.py, placement_plan.py, memory_model.py):
shapes, the memory model, GPU assignment, refusals and `--plan`."""
from __future__ import annotations

import pytest

from m1.config_files import ConfigError
from m1.marl.plan.cluster import PlanError
from m1.marl.plan.memory_model import GiB, learner_memory
from m1.marl.plan.placement_plan import GpuSlot
from m1.marl.plan.planner import make_plan, node_sizes
from m1.marl.config import load_sft_config, load_train_config
from m1.models.shapes import TEXT_SHAPES

AGENTS = ["qwen3_8b", "qwen3_4b", "qwen25_7b", "qwen25_3b"]
P_3B = 3_085_938_688  # Qwen2.5-3B-Instruct, counted from its config.json


def _slots(node: int, *gpus: int) -> list[GpuSlot]:
    return [GpuSlot(node, g) for g in gpus]


def _no_gpu_twice(plan) -> None:
    used = [s for u in plan.units for s in u.slots]
    assert len(used) == len(set(used)), "a GPU was given twice"
    for s in used:
        assert 0 <= s.node < len(plan.nodes) and 0 <= s.gpu < plan.nodes[s.node]


@pytest.mark.parametrize("hub_id,expected", [("Qwen/Qwen3-8B", 8.19e9), ("Qwen/Qwen2.5-7B-Instruct", 7.62e9),
                                             ("Qwen/Qwen2.5-3B-Instruct", 3.09e9), ("Qwen/Qwen3-4B", 4.02e9)])
def test_parameter_counts_match_the_published_sizes(hub_id, expected):
    assert abs(TEXT_SHAPES[hub_id].parameters() / expected - 1) < 0.01


def test_lora_parameter_count_by_hand():
    # Qwen2.5-3B: h=2048, kv width 2*128=256, intermediate 11008, 36 layers; r=8 on all seven projections
    per_layer = (2048 + 2048) + 2 * (2048 + 256) + (2048 + 2048) + 3 * (2048 + 11008)
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    assert TEXT_SHAPES["Qwen/Qwen2.5-3B-Instruct"].lora_parameters(8, targets) == 36 * 8 * per_layer == 14_966_784


def test_memory_model_by_hand_qwen25_3b_full_on_two_gpus():
    cfg = load_train_config("videochat_m1_full", ["cluster.learner_gpus.qwen25_3b=2"])
    plan = make_plan(cfg, gpus=16, gpu_mem_gb=80)
    mem = plan.unit("learner", "qwen25_3b").memory
    p = P_3B
    assert mem.weights * GiB == pytest.approx(2 * p)  # bf16 weights on every rank
    assert mem.optimizer * GiB == pytest.approx(12 * p / 2)  # fp32 master + Adam m, v, sharded over 2
    assert mem.grads * GiB == pytest.approx(4 * p / 2)  # fp32 gradient accumulation, sharded
    assert mem.reference * GiB == pytest.approx(2 * p)  # beta > 0: a bf16 reference
    micro, prompt, completion, h, layers, vocab = 2, 4096, 1024, 2048, 36, 151936  # prompt: the shipped budget
    tokens = micro * (prompt + completion)
    act = 2 * tokens * h * layers + 34 * tokens * h + micro * completion * vocab * 8  # checkpointing is on
    assert mem.activations * GiB == pytest.approx(act)
    kv_per_token = 2 * 36 * 2 * 128 * 2  # k and v, 36 layers, 2 kv heads of 128, bf16
    # batch_episodes = 8, the requests split over the group's 2 ranks: 4 sequences on each
    assert mem.kv * GiB == pytest.approx(4 * (prompt + completion) * kv_per_token)
    assert mem.reserve == 3.0
    assert mem.peak == pytest.approx((2 * p + 6 * p + 2 * p + 2 * p + act) / GiB + 3.0)
    assert mem.peak == pytest.approx(41.88, abs=0.01)  # 12P = 34.49 GiB + 4.39 activations + 3 reserve


def test_lora_and_sft_have_no_reference():
    lora_cfg = load_train_config("videochat_m1_lora")
    lora = make_plan(lora_cfg, gpus=8, gpu_mem_gb=80)
    mem = lora.unit("learner", "qwen25_3b").memory
    lora_params = TEXT_SHAPES["Qwen/Qwen2.5-3B-Instruct"].lora_parameters(8, lora_cfg.learner.lora.target_modules)
    assert mem.reference == 0 and mem.grads == 0
    assert mem.optimizer * GiB == pytest.approx(16 * lora_params)  # fp32 adapter + gradient + Adam m, v
    sft = make_plan(load_sft_config("videochat_m1_full"), gpus=16, gpu_mem_gb=80, teacher=False)
    assert all(sft.unit("learner", a).memory.reference == 0 and sft.unit("learner", a).memory.kv == 0
               for a in AGENTS)


def test_without_checkpointing_activations_grow_by_the_layer_count():
    shape = TEXT_SHAPES["Qwen/Qwen3-8B"]
    learner = load_train_config("videochat_m1_full").learner
    ckpt = learner_memory(shape, learner, 4, True, 8, 3.0)
    plain = learner_memory(shape, learner.model_copy(update={"gradient_checkpointing": False}), 4, True, 8, 3.0)
    tokens, logits = 2 * (4096 + 1024), 2 * 1024 * 151936 * 8  # 4,096 prompt tokens: the shipped budget
    assert plain.activations * GiB == pytest.approx(34 * tokens * 4096 * 36 + logits)
    assert ckpt.activations * GiB == pytest.approx(2 * tokens * 4096 * 36 + 34 * tokens * 4096 + logits)


def test_lora_fits_one_node_of_eight():
    plan = make_plan(load_train_config("videochat_m1_lora"), gpus=8, gpu_mem_gb=80)
    assert plan.fits, plan.problems
    assert plan.nodes == [8]
    assert plan.learners == {"qwen3_8b": _slots(0, 0), "qwen3_4b": _slots(0, 1), "qwen25_7b": _slots(0, 2),
                             "qwen25_3b": _slots(0, 3)}
    assert plan.driver == {"browser": _slots(0, 4), "space": _slots(0, 5), "grounding": _slots(0, 6),
                           "clip": _slots(0, 7)}
    assert plan.engines == {a: [] for a in AGENTS}  # rollouts run in the learners
    assert "judge" not in plan.driver  # gpt-4o behind an API
    _no_gpu_twice(plan)


def test_full_fits_two_nodes_with_each_group_on_one_node():
    plan = make_plan(load_train_config("videochat_m1_full"), gpus=16, gpu_mem_gb=80)
    assert plan.fits, plan.problems
    assert plan.nodes == [8, 8] and plan.gpus_needed == 15
    assert plan.learners == {"qwen3_8b": _slots(0, 0, 1, 2, 3), "qwen3_4b": _slots(0, 4, 5),
                             "qwen25_7b": _slots(1, 0, 1, 2, 3), "qwen25_3b": _slots(0, 6)}
    assert plan.driver == {"browser": _slots(0, 7), "space": _slots(1, 4), "grounding": _slots(1, 5),
                           "clip": _slots(1, 6)}
    _no_gpu_twice(plan)
    assert max(u.memory.peak for u, _ in plan.by_gpu().values()) <= plan.usable_gb == pytest.approx(72.0)
    # 14 bytes per parameter (bf16 weights + fp32 master and Adam) for every agent, 3 checkpoints kept
    total = sum(TEXT_SHAPES[h].parameters() for h in ("Qwen/Qwen3-8B", "Qwen/Qwen3-4B", "Qwen/Qwen2.5-7B-Instruct",
                                                       "Qwen/Qwen2.5-3B-Instruct"))
    assert plan.checkpoint_one_gb * GiB == pytest.approx(14 * total)
    assert plan.checkpoint_gb == pytest.approx(3 * plan.checkpoint_one_gb)
    assert "node 1 gpu 0" in str(plan.learners["qwen25_7b"][0])


def test_smallest_cluster_per_config():
    def smallest(cfg, **kw):
        return next(n for n in range(1, 64) if make_plan(cfg, gpus=n, gpu_mem_gb=80, **kw).fits)

    assert smallest(load_train_config("videochat_m1_full")) == 15
    assert smallest(load_train_config("videochat_m1_lora")) == 8
    assert smallest(load_sft_config("videochat_m1_full"), teacher=False) == 9
    assert smallest(load_sft_config("videochat_m1_full"), teacher=True) == 13  # + the teacher's 4 tool models
    assert smallest(load_sft_config("videochat_m1_lora"), teacher=False) == 4


def test_too_few_gpus_is_refused_naming_what_is_left_out():
    plan = make_plan(load_train_config("videochat_m1_full"), gpus=8, gpu_mem_gb=80)
    assert not plan.fits
    [problem] = plan.problems
    assert "needs 15 GPUs" in problem and "the cluster has 8 (short 7)" in problem
    assert "agent qwen25_7b learner (4 GPUs)" in problem
    assert plan.learners["qwen25_7b"] == []
    _no_gpu_twice(plan)


def test_a_learner_too_big_for_its_gpus_is_refused_not_resized():
    cfg = load_train_config("videochat_m1_full", ["learner.gpus=1", "cluster.learner_gpus={}"])
    plan = make_plan(cfg, gpus=24, gpu_mem_gb=80)
    assert not plan.fits
    msg = next(p for p in plan.problems if p.startswith("agent qwen3_8b:"))
    peak = plan.unit("learner", "qwen3_8b").memory.peak
    assert f"needs {peak:.1f} GB per GPU on 1 GPU(s)" in msg
    assert f"short {peak - 72.0:.1f} GB" in msg
    assert "learner.gpus >= 4" in msg  # the suggestion; the plan itself keeps 1 GPU
    assert plan.unit("learner", "qwen3_8b").gpus == 1 and len(plan.learners["qwen3_8b"]) == 1
    assert not any(p.startswith("agent qwen25_3b:") for p in plan.problems)  # a 3B full fine-tune fits one GPU


def test_more_gpus_than_deepspeed_allows_without_zero():
    cfg = load_train_config("videochat_m1_full", ["learner.deepspeed=null"])
    plan = make_plan(cfg, gpus=24, gpu_mem_gb=80)
    assert any("agent qwen3_8b: a learner of 4 GPUs needs learner.deepspeed" in p for p in plan.problems)


def test_a_group_spans_nodes_only_when_no_node_holds_it():
    cfg = load_train_config("videochat_m1_full", ["cluster.learner_gpus.qwen3_8b=12"])
    plan = make_plan(cfg, gpus=24, gpu_mem_gb=80)
    assert plan.fits, plan.problems
    assert {s.node for s in plan.learners["qwen3_8b"]} == {0, 1} and len(plan.learners["qwen3_8b"]) == 12
    assert {s.node for s in plan.learners["qwen25_7b"]} == {2}
    _no_gpu_twice(plan)


def test_engine_rollouts_take_gpus_of_their_own():
    cfg = load_train_config("videochat_m1_lora", ["rollout.engine=vllm", "cluster.engine_gpus=1"])
    plan = make_plan(cfg, gpus=16, gpu_mem_gb=80)
    assert plan.fits, plan.problems
    assert all(len(plan.engines[a]) == 1 for a in AGENTS)
    assert all(plan.unit("learner", a).memory.kv == 0 for a in AGENTS)  # no generation in the learners
    assert plan.gpus_needed == 12
    _no_gpu_twice(plan)
    # servers the user runs (rollout.engine_url) take no GPU of the plan, and the learners still hold no KV cache
    theirs = make_plan(load_train_config("videochat_m1_lora", [
        "rollout.engine=vllm", "rollout.engine_url={qwen3_8b: 'http://a:8000', qwen3_4b: 'http://b:8000', "
        "qwen25_7b: 'http://c:8000', qwen25_3b: 'http://d:8000'}"]), gpus=16, gpu_mem_gb=80)
    assert theirs.gpus_needed == 8 and not any(theirs.engines.values())
    assert all(theirs.unit("learner", a).memory.kv == 0 for a in AGENTS)


def test_a_vision_model_gets_two_gpus_only_when_one_is_too_small():
    plan = make_plan(load_train_config("videochat_m1_lora"), gpus=64, gpu_mem_gb=24)
    assert len(plan.driver["browser"]) == 2 and len(plan.driver["clip"]) == 1


def test_ray_bundles_map_every_rank_to_its_gpu():
    plan = make_plan(load_train_config("videochat_m1_full"), gpus=16, gpu_mem_gb=80)
    rb = plan.ray_bundles(node_ips=["10.0.0.1", "10.0.0.2"])
    assert len(rb.bundles) == plan.gpus_needed == 15
    assert rb.bundles[0] == {"GPU": 1, "CPU": 4, "node:10.0.0.1": 0.001}
    by_gpu = plan.by_gpu()
    for (role, name, rank), i in rb.index.items():
        slot = plan.unit(role, name).slots[rank]
        assert by_gpu[slot] == (plan.unit(role, name), rank) and rb.nodes[i] == slot.node
    assert rb.of("learner", "qwen25_7b") == [rb.index[("learner", "qwen25_7b", r)] for r in range(4)]
    assert all(rb.nodes[i] == 1 for i in rb.of("learner", "qwen25_7b"))
    assert sorted(rb.index.values()) == list(range(15))


def test_cpu_configs_plan_trivially_and_keep_their_dumps():
    for name in ("mini", "mini_deepspeed"):
        cfg = load_train_config(name)
        plan = make_plan(cfg, gpus=0)
        assert plan.fits and plan.units == [] and plan.gpus_needed == 0
        dump = cfg.recorded()
        assert "cluster" not in dump and "gpus" not in dump["learner"]  # unset: recorded run settings unchanged
    assert make_plan(load_sft_config("mini"), gpus=0).fits


def test_cluster_section_is_strict():
    with pytest.raises(ConfigError, match="cluster.gpu_per_node"):
        load_train_config("videochat_m1_full", ["cluster.gpu_per_node=4"])
    with pytest.raises(ConfigError, match="learner.gpus"):
        load_train_config("videochat_m1_full", ["learner.gpus=0"])
    with pytest.raises(PlanError, match="'qwen9b' is not a trained agent"):
        make_plan(load_train_config("videochat_m1_full", ["cluster.learner_gpus.qwen9b=2"]), gpus=8, gpu_mem_gb=80)
    with pytest.raises(PlanError, match="'judge' is not a model the driver loads on a GPU"):
        make_plan(load_train_config("videochat_m1_full", ["cluster.driver_gpus.judge=1"]), gpus=8, gpu_mem_gb=80)
    with pytest.raises(PlanError, match="--gpu-mem"):
        make_plan(load_train_config("videochat_m1_full"), gpus=8)


def test_node_sizes():
    assert node_sizes(24, 8) == [8, 8, 8] and node_sizes(13, 8) == [8, 5] and node_sizes(0, 8) == []


def _cli(*args):
    from typer.testing import CliRunner

    from m1.cli import app

    result = CliRunner().invoke(app, list(args))
    return result.exit_code, result.output + (getattr(result, "stderr", "") or "")


def test_cli_plan_refuses_eight_gpus_and_accepts_24():
    code, out = _cli("train", "--config", "videochat_m1_full", "--plan", "--gpus", "8", "--gpu-mem", "80")
    assert code == 2
    assert "qwen25_7b" in out and "short 7" in out and "fits: NO" in out
    code, out = _cli("train", "--config", "videochat_m1_full", "--plan", "--gpus", "24", "--gpu-mem", "80")
    assert code == 0, out
    assert "fits: yes" in out and "learner qwen3_8b" in out and "driver  grounding" in out


def test_cli_sft_plan():
    code, out = _cli("sft", "--config", "videochat_m1_lora", "--plan", "--gpus", "8", "--gpu-mem", "80")
    assert code == 0, out
    assert "learner qwen25_3b" in out


def test_cluster_gpus_from_ray():
    ray = pytest.importorskip("ray")
    from m1.marl.plan.cluster import cluster_gpus_from_ray

    ray.init(num_cpus=1, num_gpus=2, include_dashboard=False, logging_level="ERROR")
    try:
        info = cluster_gpus_from_ray()
    finally:
        ray.shutdown()
    assert info.gpus_per_node == [2] and len(info.node_ips) == 1
