"""Training a vision-language seed-kind policy on the frames it saw (m1/marl/actor/learner.py, `interface: vision` models).

A tiny random Qwen2.5-VL weaver on a tiny M1-Synth world: its samples keep their image-pad tokens, the learner's
forward gets the pixels of exactly those frames (decoded again from the video), and the loss sees reply tokens
only. Each test runs in seconds on a CPU."""
from __future__ import annotations

import pytest

from tests.conftest import make_synth_world, varied_reward

from m1.marl.config import SFTConfig, TrainConfig
from m1.marl.reward.rewards import RewardConfig

NO_CLIP = ["models.clip.clip_name=null", "models.clip.tiny={arch: open_clip}"]  # the world's CLIP takes minutes
TINY_VL = {"arch": "qwen2_5_vl", "hidden_size": 64, "layers": 2, "seed": 5}


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    return make_synth_world(tmp_path_factory.mktemp("world"), 2, 7, 30, 6)


def vl_team(max_turns=2, glance=2):
    return {"name": "weaver_vl_tiny",
            "models": {"policy": {"interface": "vision", "backend": "hf", "device": "cpu", "tiny": TINY_VL},
                       "vision": {"interface": "vision", "backend": "synth"}},
            "agents": [{"name": "weaver", "model": "policy", "kind": "weaver"}], "tools": {"browser": "vision"},
            "seed_system": {"glance_frames": glance, "max_turns": max_turns, "reply_tokens": 10},
            "sampling": {"temperature": 1.0}, "limits": {"batch_episodes": 16}}


@pytest.fixture(scope="module")
def rollout(world, m1_cache):
    """A full-weights VL learner generating a step's episodes itself (as in training), and their samples."""
    from m1.config import ModelSpec, TeamConfig
    from m1.marl.config import GRPOSettings, LearnerConfig
    from m1.marl.actor.learner import AgentLearner
    from m1.marl.algo.advantages import group_advantages
    from m1.marl.rollout.episodes import build_samples, run_rollouts, score
    from m1.models.hub import ModelHub
    from m1.team import topology as topo
    from m1.team.single import SingleAgentTeam

    cfg = TeamConfig.model_validate(vl_team())
    learner = AgentLearner.build("weaver", "policy", ModelSpec(interface="vision", device="cpu", tiny=TINY_VL),
                                 LearnerConfig(finetune="full", max_prompt_tokens=2048, max_completion_tokens=16),
                                 GRPOSettings(beta=0.0))
    hub = ModelHub(cfg.models)
    hub.register("policy", learner.sampler, interface="vision")
    team = SingleAgentTeam(cfg, hub=hub)
    batch = run_rollouts(team, world[2][:2], 2, topo.complete(["weaver"]))
    assert all(e.error is None for e in batch.flat)
    batch = score(batch, ["weaver"], varied_reward)
    rewards = batch.rewards
    samples = build_samples(batch, {a: group_advantages(r) for a, r in rewards.items()}, {"weaver": 1.0})["weaver"]
    return learner, batch, samples


def test_samples_keep_frame_references_not_pixels(rollout):
    """Each sample names its video and the frame of each image part; traces (Generation dumps) hold no pixels."""
    learner, batch, samples = rollout
    pad = learner.sampler.chat.model.config.image_token_id
    assert samples and all(s.frames and s.video for s in samples)
    for ep in batch.flat:
        for gen in ep.generations:
            dumped = gen.model_dump_json()
            assert "pixel" not in dumped and len(dumped) < 20_000
    for s in samples:
        assert s.video.endswith(".mp4")
        assert sum(t == pad for t in s.prompt_ids) == 16 * len(s.frames)  # 112x112 frames: 16 merged patches each
    from m1.models.base import image_frames

    gens = [(ep, g) for ep in batch.flat for g in ep.generations if g.completion_ids]
    assert [s.frames for s in samples] == [image_frames(g.prompt) for _, g in gens]
    assert [s.video for s in samples] == [ep.question.video for ep, _ in gens]


def test_loss_mask_is_the_reply_tokens_only(rollout):
    learner, _, samples = rollout
    config = learner.sampler.chat.model.config
    special = {config.image_token_id, config.video_token_id, config.vision_start_token_id, config.vision_end_token_id}
    vision = learner.actor.scorer.vision_inputs(samples)
    actor = learner.actor
    _, mask = actor.compute_logprobs(actor.scorer.rows(samples), 1.0, vision, model=actor.policy)
    assert mask.sum(1).tolist() == [float(len(s.completion_ids)) for s in samples]
    tok = learner.actor.tokenizer
    for s in samples:
        assert not special & set(s.completion_ids)  # no image (or any vision) token is ever a target
        target = tok.decode(s.completion_ids)
        assert "<frame" not in target and "[trim]" not in target  # observations are context
    rows = learner.actor.scorer.rows(samples)
    assert all(p == s.prompt_ids and c == s.completion_ids for (p, c), s in zip(rows, samples))


def test_learner_logprobs_match_generation_only_with_the_images(rollout):
    """Same weights, same frames: the learner's log-probs are the sampler's; without the pixels (or with other
    pixels) they are not, so the pixels reach the forward pass."""
    import torch

    learner, _, samples = rollout
    learner.actor.policy.eval()
    rows = learner.actor.scorer.rows(samples)
    vision = learner.actor.scorer.vision_inputs(samples)
    with torch.no_grad():
        logp, mask = learner.actor.compute_logprobs(rows, 1.0, vision, model=learner.actor.policy)
        blind, _ = learner.actor.compute_logprobs(rows, 1.0, None, model=learner.actor.policy)
        other = dict(vision, pixel_values=torch.zeros_like(vision["pixel_values"]))
        wrong, _ = learner.actor.compute_logprobs(rows, 1.0, other, model=learner.actor.policy)
    sampled = learner.actor.scorer.padded([s.logprobs for s in samples], logp.shape[1])
    gap = ((logp - sampled).abs() * mask).max().item()
    assert gap < 1e-4, gap
    assert ((blind - sampled).abs() * mask).max().item() > 1e-3
    assert ((wrong - sampled).abs() * mask).max().item() > 1e-3


def test_a_prompt_that_does_not_fit_is_an_error_not_a_cut(rollout):
    from dataclasses import replace

    learner, _, samples = rollout
    short = learner.actor.cfg.model_copy(update={"max_prompt_tokens": 8})
    learner.actor.scorer.cfg, keep = short, learner.actor.scorer.cfg
    try:
        with pytest.raises(ValueError, match="exceeds learner.max_prompt_tokens=8"):
            learner.actor.scorer.rows(samples[:1])
    finally:
        learner.actor.scorer.cfg = keep
    bad = replace(samples[0], frames=samples[0].frames[:-1])
    with pytest.raises(ValueError, match="image-pad tokens but its"):
        learner.actor.scorer.vision_inputs([bad])


# ----------------------------------------------------------------------------- GRPO through the trainer
def train_cfg(out, steps=2, **over):
    data = {"team": vl_team(), "rollout": {"num_generations": 2, "questions_per_step": 2},
            "grpo": {"beta": 0.05},
            "learner": {"finetune": "lora", "lr": 1e-2, "micro_batch_size": 4, "max_completion_tokens": 16,
                        "max_prompt_tokens": 2048, "lora": {"dropout": 0.0}},
            "steps": steps, "out_dir": str(out), "checkpoint": {"every": 2, "keep_last": 1},
            "log": {"progress": False, "backends": []}}
    data.update(over)
    return TrainConfig.model_validate(data)


@pytest.mark.slow
def test_grpo_trains_a_vl_policy_on_its_frames(world, tmp_path, m1_cache):
    """Two GRPO steps (LoRA, beta > 0: the reference is the adapter-off model, fed the same images): every
    trainable parameter moves, and the learner's log-probs equal the sampler's (logp_gap ~ 0)."""
    import torch

    from m1.marl.parts import make_trainer

    tr = make_trainer(train_cfg(tmp_path / "run"), questions=world[2], reward_fn=varied_reward)
    try:
        assert tr.hub.vision("policy") is tr.learners.learners["weaver"].sampler
        before = tr.learners.parameters("weaver")
        rows = tr.train()
        after = tr.learners.parameters("weaver")
    finally:
        tr.close()
    assert [r["step"] for r in rows] == [1, 2]
    assert len(after) >= 10 and not [n for n in after if torch.equal(after[n], before[n])]
    saved = [f.parent.name for f in (tmp_path / "run").rglob("adapter_config.json")]
    assert saved and all(list(f.parent.glob("*processor*.json")) for f in (tmp_path / "run").rglob("adapter_config.json"))
    for r in rows:
        assert r["weaver/samples"] >= 4 and r["weaver/grad_norm"] > 0 and r["weaver/logp_gap"] < 1e-4, r


def test_configs_refuse_vision_policies_the_learner_cannot_train(tmp_path):
    team = vl_team()
    assert train_cfg(tmp_path, team=team).team.models["policy"].interface == "vision"
    synth = vl_team()
    synth["models"]["policy"] = {"interface": "vision", "backend": "synth"}
    with pytest.raises(ValueError, match="a trained vision-language policy needs backend 'hf'"):
        train_cfg(tmp_path, team=synth)
    rollout = {"num_generations": 2, "questions_per_step": 2, "engine": "vllm", "engine_url": "http://x:1"}
    with pytest.raises(ValueError, match="rollout.engine: 'vllm' cannot sample the vision-language policy"):
        train_cfg(tmp_path, rollout=rollout)


# ----------------------------------------------------------------------------- SFT on the rule policy's turns
@pytest.mark.slow
def test_sft_of_a_vl_student_on_the_rule_weaver_lowers_the_loss(world, tmp_path, m1_cache):
    from m1.config import load_team
    from m1.marl.sft import SFTTrainer, build_sft_data, read_examples, write_examples
    from m1.team.engines_registry import make_team

    d, path, qs = world
    teacher = make_team(load_team("weaver_synth", NO_CLIP + ["seed_system.glance_frames=4"]))
    examples, stats = build_sft_data(teacher, qs[:6], RewardConfig())
    assert examples and all(e.video for e in examples)
    write_examples(tmp_path / "examples.jsonl", examples)
    assert read_examples(tmp_path / "examples.jsonl")[0].video == examples[0].video
    cfg = SFTConfig.model_validate({
        "team": vl_team(), "data": {"examples": str(tmp_path / "examples.jsonl")},
        "learner": {"finetune": "full", "lr": 1e-2, "micro_batch_size": 8, "max_prompt_tokens": 4096,
                    "max_completion_tokens": 64, "max_grad_norm": None},
        "batch_size": 8, "max_steps": 6, "out_dir": str(tmp_path / "sft"), "checkpoint": {"every": 6},
        "log": {"progress": False, "backends": []}})
    tr = SFTTrainer(cfg, examples=examples)
    try:
        learner = tr.learners.learners["weaver"]
        sample = learner.actor.scorer.sft_sample(examples[0])
        pad = learner.sampler.chat.model.config.image_token_id
        assert sample.frames and sum(t == pad for t in sample.prompt_ids) == 16 * len(sample.frames)
        rows = tr.train()
    finally:
        tr.close()
    losses = [r["loss"] for r in rows]
    assert len(losses) == 6 and sum(losses[-2:]) / 2 < 0.7 * sum(losses[:2]) / 2, losses
