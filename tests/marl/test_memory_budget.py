"""Memory and time the plan counts: checkpoint bytes as written, one read of each file on resume, the reference copy
a beta = 0 run does without, and the rollout batch fitted to the learners' free memory.

Checks: `checkpoint_bytes` matches what tiny full and LoRA learners really write (plain torch and ZeRO-2 bf16) within
3%, and a full ZeRO-2 bf16 checkpoint is 14 bytes per parameter; resuming a learner reads its weights once and only
its own ZeRO shard, and a Trainer's resume hashes each checkpoint file once; the plan shows what the reference copy
costs and that beta = 0 loads none; `rollout.batch_episodes: auto` grows with the GPU memory, is capped at the step's
episodes, an explicit number is kept, and the Trainer runs the plan's number.
"""
import random
from pathlib import Path

import pytest

from tests.marl.test_trainer import make_trainer, team_dict, train_cfg
from m1.config import ModelSpec
from m1.marl import checkpoint as ckpt
from m1.marl.plan.memory_model import GiB, checkpoint_bytes
from m1.marl.plan.planner import make_plan, rollout_batch
from m1.marl.config import GRPOSettings, LearnerConfig, load_train_config
from m1.marl.rollout.episodes import Sample
from m1.models.shapes import shape_from_config
from m1.marl.actor.learner_io import load_actor, save_actor

TINY = {"interface": "chat", "device": "cpu",
        "tiny": {"arch": "qwen2", "hidden_size": 128, "layers": 2, "heads": 4, "kv_heads": 2, "seed": 1}}


def _samples(n=4, seed=0):
    rng = random.Random(seed)
    return [Sample(agent="a", question_id="q", group=0, rollout=i, phase="plan",
                   prompt_ids=[rng.randrange(10, 300) for _ in range(8)],
                   completion_ids=[rng.randrange(10, 300) for _ in range(4)],
                   logprobs=None, reward=0.0, advantage=rng.uniform(-1, 1)) for i in range(n)]


def _learner(**cfg):
    from m1.marl.actor.learner import AgentLearner

    return AgentLearner.build("a", "m", ModelSpec.model_validate(TINY),
                              LearnerConfig(lr=1e-3, micro_batch_size=4, **cfg),
                              GRPOSettings(beta=0.0))


def _folder_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


# ------------------------------------------------------------------------------------------------ checkpoint size
@pytest.mark.parametrize("kind", [
    dict(finetune="full", precision="bf16", deepspeed="zero2"),
    dict(finetune="full", precision="fp32"),
    dict(finetune="lora", precision="fp32", lora={"r": 64}),
    dict(finetune="lora", precision="bf16", deepspeed="zero2", lora={"r": 64}),
], ids=["full-zero2-bf16", "full-torch-fp32", "lora-torch", "lora-zero2-bf16"])
@pytest.mark.slow
def test_checkpoint_estimate_is_what_a_learner_writes(kind, tmp_path, m1_cache):
    learner = _learner(**kind)
    learner.actor.update(_samples(), lr=1e-3)  # Adam moments exist only after a step
    save_actor(learner.actor, tmp_path / "agent")
    written = _folder_bytes(tmp_path / "agent")
    shape = shape_from_config(learner.sampler.chat.model.config.to_dict(), "tiny")  # its real vocabulary
    estimate = checkpoint_bytes(shape, learner.actor.cfg)
    assert estimate == pytest.approx(written, rel=0.03), (estimate, written)
    if kind["finetune"] == "full" and kind.get("deepspeed"):
        # bf16 weights once (model/) + fp32 master and Adam m, v in the ZeRO shard; no second copy of the weights
        assert estimate == 14 * shape.parameters()
        assert sorted(p.name for p in (tmp_path / "agent").iterdir() if p.suffix == ".pt") == ["zero-rank0.pt"]


def test_plan_checkpoint_per_agent_and_bytes_per_parameter():
    plan = make_plan(load_train_config("videochat_m1_full"), gpus=24, gpu_mem_gb=80)
    assert plan.checkpoint_bytes_per_param == 14
    assert sum(plan.checkpoint_agents_gb.values()) == pytest.approx(plan.checkpoint_one_gb)
    assert plan.checkpoint_agents_gb["qwen3_8b"] * GiB == pytest.approx(14 * 8_190_735_360)
    text = plan.render()
    assert "14 bytes per trained parameter" in text and "qwen3_8b 106.8" in text


# ------------------------------------------------------------------------------------------------ resume reads
@pytest.mark.slow
def test_resume_reads_the_weights_once_and_only_its_own_zero_shard(tmp_path, m1_cache, monkeypatch):
    import safetensors.torch
    import torch

    cfg = dict(finetune="full", precision="bf16", deepspeed="zero2")
    learner = _learner(**cfg)
    learner.actor.update(_samples(), lr=1e-3)
    save_actor(learner.actor, tmp_path / "agent")
    twin = _learner(**cfg)
    reads: list[str] = []
    real_load, real_file = torch.load, safetensors.torch.load_file

    def counting_load(f, *a, **k):
        reads.append(Path(f).relative_to(tmp_path).as_posix())
        return real_load(f, *a, **k)

    def counting_file(f, *a, **k):
        reads.append(Path(f).relative_to(tmp_path).as_posix())
        return real_file(f, *a, **k)

    monkeypatch.setattr(torch, "load", counting_load)
    monkeypatch.setattr(safetensors.torch, "load_file", counting_file)
    load_actor(twin.actor, tmp_path / "agent")
    monkeypatch.undo()
    assert sorted(reads) == ["agent/model/model.safetensors", "agent/zero-rank0.pt"]
    a, b = learner.actor.parameters(), twin.actor.parameters()
    assert all(torch.equal(a[n], b[n]) for n in a)
    nxt = _samples(seed=1)  # the fp32 master and the moments came back too: the next step is the same
    assert twin.actor.update(nxt, lr=1e-3)["loss"] == learner.actor.update(nxt, lr=1e-3)["loss"]
    a, b = learner.actor.parameters(), twin.actor.parameters()
    assert all(torch.equal(a[n], b[n]) for n in a)


@pytest.mark.slow
def test_trainer_resume_hashes_each_checkpoint_file_once(tmp_path, video, m1_cache, monkeypatch):
    cfg = train_cfg(tmp_path / "run", steps=1)
    make_trainer(cfg, video).train()
    folder = ckpt.find_latest_checkpoint(tmp_path / "run")
    files = sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*")
                   if p.is_file() and p.name != ckpt.MANIFEST)
    hashed: list[str] = []
    real = ckpt._sha256

    def counting(path):
        hashed.append(Path(path).relative_to(folder).as_posix())
        return real(path)

    monkeypatch.setattr(ckpt, "_sha256", counting)
    resumed = make_trainer(cfg, video)
    assert resumed.step == 1
    assert sorted(hashed) == files  # every file once: resume_point verified it, the load did not again


# ------------------------------------------------------------------------------------------------ reference copy
def test_plan_shows_what_beta_zero_saves():
    fixed = ["rollout.batch_episodes=8"]  # the same KV cache in both plans
    with_ref = make_plan(load_train_config("videochat_m1_full", fixed), gpus=24, gpu_mem_gb=80)
    no_ref = make_plan(load_train_config("videochat_m1_full", ["grpo.beta=0", *fixed]), gpus=24, gpu_mem_gb=80)
    p8 = 8_190_735_360  # Qwen3-8B
    assert with_ref.reference_gb["qwen3_8b"] * GiB == pytest.approx(2 * p8)  # bf16 copy on every rank
    assert with_ref.unit("learner", "qwen3_8b").memory.reference * GiB == pytest.approx(2 * p8)
    assert no_ref.unit("learner", "qwen3_8b").memory.reference == 0
    saved = with_ref.unit("learner", "qwen3_8b").memory.peak - no_ref.unit("learner", "qwen3_8b").memory.peak
    assert saved == pytest.approx(with_ref.reference_gb["qwen3_8b"], abs=0.01)
    total = sum(with_ref.reference_gb[u.name] * u.gpus for u in with_ref.units if u.role == "learner")
    assert f"{total:.1f} GB in all (none at beta = 0" in with_ref.render()
    assert "reference copy: none at beta = 0" in no_ref.render()
    # the memory it frees holds more rollouts: what no_ref fits is what with_ref says beta = 0 would fit
    assert with_ref.rollout.fits < with_ref.rollout.fits_without_reference == no_ref.rollout.fits
    assert (f"KV cache would hold {no_ref.rollout.fits} rollout episodes instead of {with_ref.rollout.fits}"
            in with_ref.render())
    assert no_ref.reference_gb["qwen3_8b"] == pytest.approx(with_ref.reference_gb["qwen3_8b"], abs=0.01)
    lora = make_plan(load_train_config("videochat_m1_lora"), gpus=24, gpu_mem_gb=80)
    assert lora.reference_gb == {} and "reference copy" not in lora.render()


# ------------------------------------------------------------------------------------------------ rollout batch
def test_auto_rollout_batch_grows_with_free_memory_up_to_the_step():
    cfg = load_train_config("videochat_m1_full", ["rollout.batch_episodes=auto"])
    plans = {mem: make_plan(cfg, gpus=24, gpu_mem_gb=mem) for mem in (80, 96, 141)}
    fits = {mem: plan.rollout for mem, plan in plans.items()}
    assert fits[80].fits < fits[96].fits < fits[141].fits
    # by hand: each learner GPU keeps 90% of its memory, less weights, Adam, gradients, reference, reserve and the
    # training activations, for sequences of max_prompt + max_completion tokens of 2 (k, v) * layers * kv heads *
    # head dim * 2 bytes (bf16); a group of n ranks splits the requests, so it holds n times its rank's count
    seq = cfg.learner.max_prompt_tokens + cfg.learner.max_completion_tokens
    shapes = {"qwen3_8b": (36, 8, 128), "qwen3_4b": (36, 8, 128), "qwen25_7b": (28, 4, 128), "qwen25_3b": (36, 2, 128)}
    for mem, plan in plans.items():
        per_agent = {}
        for agent, (layers, kv_heads, head_dim) in shapes.items():
            m, n = plan.unit("learner", agent).memory, plan.unit("learner", agent).gpus
            free = (0.9 * mem - m.weights - m.optimizer - m.grads - m.reference - m.activations - m.reserve) * GiB
            per_agent[agent] = int(free // (seq * 2 * layers * kv_heads * head_dim * 2)) * n
        assert fits[mem].fits == min(per_agent.values())
        assert plan.fits  # the learners' peaks with that KV cache still fit
    # never more than the step has; the memory decides when the step has more than fit
    assert all(r.episodes == min(r.step, r.fits) for r in fits.values())
    big = load_train_config("videochat_m1_full", ["rollout.batch_episodes=auto", "rollout.questions_per_step=64"])
    plan = make_plan(big, gpus=24, gpu_mem_gb=141)
    assert plan.rollout.step == 256 and plan.rollout.episodes == plan.rollout.fits < 256
    assert (f"rollouts: {plan.rollout.fits} of the step's 256 episodes at once (rollout.batch_episodes: auto"
            in plan.render())
    explicit = make_plan(load_train_config("videochat_m1_full", ["rollout.batch_episodes=12"]), gpus=24,
                         gpu_mem_gb=80).rollout
    assert explicit.episodes == 12 and explicit.setting == "rollout.batch_episodes"
    unset = make_plan(load_train_config("videochat_m1_full", ["rollout.batch_episodes=null"]), gpus=24,
                      gpu_mem_gb=80).rollout
    assert unset.episodes == 8 and unset.setting == "limits.batch_episodes"


def test_vllm_rollouts_refuse_a_batch_number_and_plan_no_learner_batch():
    with pytest.raises(ValueError, match=r"rollout.batch_episodes \(12\) is for rollout.engine: hf"):
        load_train_config("videochat_m1_full", ["rollout.engine=vllm", "rollout.batch_episodes=12"])
    cfg = load_train_config("videochat_m1_full", ["rollout.engine=vllm"])  # auto (the config's) is accepted
    assert cfg.rollout.batch_episodes == "auto" and make_plan(cfg, gpus=24, gpu_mem_gb=80).rollout is None


@pytest.mark.slow
def test_trainer_runs_the_plans_rollout_batch(tmp_path, video, m1_cache, monkeypatch):
    """On the CPU the learners have no GPU memory to fit: auto runs the whole step (2 questions x 2 rollouts) at
    once; an explicit number is kept; the team's episodes come in chunks of that size."""
    cfg = train_cfg(tmp_path / "auto", team=team_dict(batch_episodes=1), rollout={"batch_episodes": "auto"})
    assert rollout_batch(cfg) == 4
    trainer = make_trainer(cfg, video)
    assert trainer.team_cfg.limits.batch_episodes == 4
    sizes: list[int] = []
    from m1.team.cpp import Team

    real = Team.run_batch

    def recording(self, questions, topologies, *rest, **kw):
        sizes.append(len(questions))
        return real(self, questions, topologies, *rest, **kw)

    monkeypatch.setattr(Team, "run_batch", recording)
    trainer.train()
    assert sizes == [4]
    fixed = train_cfg(tmp_path / "two", rollout={"batch_episodes": 2})
    assert make_trainer(fixed, video).team_cfg.limits.batch_episodes == 2
