"""Multi-agent GRPO trainer on CPU with two tiny random agents (Qwen3 + Qwen2) and the synth browser.

Checks, in the spirit of TRL's and torchtune's trainer tests: one step moves every trainable parameter (full) or
only the adapter (LoRA); a killed-and-resumed run reproduces the uninterrupted run's losses exactly; the per-step
DAG follows the configured probabilities; gradient accumulation does not change the update; a DeepSpeed ZeRO-2
step runs on CPU; the paper's configs load with the paper's numbers.
"""
import json
import random
from pathlib import Path

import pytest
import yaml

from tests.conftest import is_dag, varied_reward
from tests.fakes import FakeChat, FakeVision, scripted_reply
from m1.config import TeamConfig
from m1.marl.config import GRPOSettings, LearnerConfig, TrainConfig, load_train_config
from m1.marl.rollout.episodes import Sample, build_samples, run_rollouts, sample_topology, score, training_team_config
from m1.schema import Question
from m1.team import topology as topo
from m1.marl.actor.learner_io import load_actor, save_actor

AGENTS = ["alpha", "beta"]


def team_dict(**limits):
    return {
        "name": "mini-test",
        "models": {
            "qa": {"interface": "chat", "device": "cpu",
                   "tiny": {"arch": "qwen3", "hidden_size": 32, "layers": 1, "heads": 2, "kv_heads": 1, "seed": 1}},
            "qb": {"interface": "chat", "device": "cpu",
                   "tiny": {"arch": "qwen2", "hidden_size": 32, "layers": 1, "heads": 2, "kv_heads": 1, "seed": 2}},
            "vlm": {"interface": "vision", "backend": "synth"},
        },
        "agents": [{"name": "alpha", "model": "qa"}, {"name": "beta", "model": "qb"}],
        "tools": {"enabled": ["Global Sampling", "Rough Browser"], "browser": "vlm", "global_frames": 4,
                  "rough_frames": 4},
        "limits": {"max_turns": 2, "max_tool_calls": 3, "plan_tokens": 12, "comm_tokens": 6, "answer_tokens": 8,
                   "summary_tokens": 8, "batch_episodes": 16, **limits},
    }


def questions(video, n=3):
    return [Question(id=f"q{i}", video=video, text=f"What colour is the square in scene {i}?",
                     options=["white", "red"], task="mcq", answer="A") for i in range(n)]


def train_cfg(out, finetune="full", steps=1, **over):
    data = {"team": team_dict(), "rollout": {"num_generations": 2, "questions_per_step": 2},
            "grpo": {"beta": 0.05}, "judge": {"method": "rubric"},
            "learner": {"finetune": finetune, "lr": 1e-2, "micro_batch_size": 4, "max_completion_tokens": 16},
            "steps": steps, "out_dir": str(out), "checkpoint": {"every": 1, "keep_last": 2},
            "log": {"progress": False, "backends": []}}
    for k, v in over.items():
        data[k] = {**data[k], **v} if isinstance(data.get(k), dict) else v
    return TrainConfig.model_validate(data)


def group_all(rewards):
    """GRPO's group advantages (std-scaled) of every agent's [G, K] rewards."""
    from m1.marl.algo.advantages import group_advantages

    return {a: group_advantages(r) for a, r in rewards.items()}


def make_trainer(cfg, video, reward_fn=varied_reward):
    from m1.marl import parts

    return parts.make_trainer(cfg, questions=questions(video), reward_fn=reward_fn)


# ------------------------------------------------------------------------------------------------ parameters move
@pytest.mark.slow
def test_full_step_changes_every_trainable_parameter(tmp_path, video, m1_cache):
    import torch

    # a prompt cap under the longest prompts (~770 tokens, plans ~600): the team trims the peers' notes to it (its budget is the
    # learner's), and the update scores exactly the trimmed context the rollouts were generated from
    tr = make_trainer(train_cfg(tmp_path / "run", learner={"max_prompt_tokens": 700}), video)
    before = {a: tr.learners.parameters(a) for a in AGENTS}
    ref_before = {n: p.clone() for n, p in tr.learners.learners["alpha"].actor.ref.named_parameters()}
    rows = tr.train()
    assert [r["step"] for r in rows] == [1]
    assert 0 <= rows[0]["prompts/trimmed"] < 1 and rows[0]["prompts/dropped"] == 0  # trimmed when peers are visible
    for a in AGENTS:
        after = tr.learners.parameters(a)
        assert set(after) == set(before[a]) and len(after) >= 10
        unchanged = [n for n in after if torch.equal(after[n], before[a][n])]
        assert not unchanged, f"{a}: parameters that did not move: {unchanged}"
        row = rows[0]
        assert row[f"{a}/samples"] > 0 and row[f"{a}/grad_norm"] > 0
        # the learner's recomputed log-probs are the sampler's (same temperature, same positions)
        assert row[f"{a}/logp_gap"] < 1e-4
        assert row[f"{a}/kl"] == pytest.approx(0.0, abs=1e-6)  # policy == reference before the update
    ref = dict(tr.learners.learners["alpha"].actor.ref.named_parameters())
    assert all(torch.equal(ref[n], p) for n, p in ref_before.items())  # the frozen reference never moves
    lines = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(x)["step"] for x in lines] == [1]
    ckpt = tmp_path / "run" / "checkpoints" / "step-000001"
    for a in AGENTS:
        assert (ckpt / "agents" / a / "model" / "config.json").is_file()
        assert (ckpt / "agents" / a / "optimizer.pt").is_file()
    # a new trainer on the same out_dir resumes: full weights (tied embeddings) and Adam state load exactly
    back = make_trainer(train_cfg(tmp_path / "run", learner={"max_prompt_tokens": 700}), video)
    assert back.step == 1
    for a in AGENTS:
        trained, loaded = tr.learners.parameters(a), back.learners.parameters(a)
        assert all(torch.equal(trained[n], loaded[n]) for n in trained)
        opt_a = tr.learners.learners[a].actor.optim.optimizer.state_dict()["state"]
        opt_b = back.learners.learners[a].actor.optim.optimizer.state_dict()["state"]
        assert all(torch.equal(opt_a[i]["exp_avg_sq"], opt_b[i]["exp_avg_sq"]) for i in opt_a)


@pytest.mark.slow
def test_lora_changes_only_adapter_parameters(tmp_path, video, m1_cache):
    import torch

    tr = make_trainer(train_cfg(tmp_path / "run", finetune="lora", steps=2), video)
    policies = {a: tr.learners.learners[a].actor.policy for a in AGENTS}
    base_before = {a: {n: p.detach().clone() for n, p in m.named_parameters() if not p.requires_grad}
                   for a, m in policies.items()}
    adapter_before = {a: tr.learners.parameters(a) for a in AGENTS}
    tr.train()  # two steps: at step 1 lora_A gets no gradient because lora_B starts at zero
    for a, model in policies.items():
        params = dict(model.named_parameters())
        assert adapter_before[a] and all("lora_" in n for n in adapter_before[a])
        assert all(torch.equal(params[n], p) for n, p in base_before[a].items()), f"{a}: a base weight moved"
        moved = [n for n, p in adapter_before[a].items() if not torch.equal(params[n].detach(), p)]
        assert moved == list(adapter_before[a]), f"{a}: adapter weights that did not move: " \
                                                 f"{sorted(set(adapter_before[a]) - set(moved))}"
    assert (tmp_path / "run" / "checkpoints" / "step-000002" / "agents" / "alpha" / "adapter" /
            "adapter_model.safetensors").is_file()

    # the saved adapter is what inference loads (`adapter:` on the model spec, merged): the trained policy's logits
    from m1.models.hf import HFChatModel

    learner = tr.learners.learners["alpha"]
    spec = tr.team_cfg.models[learner.actor.name]
    ids = torch.tensor([learner.actor.tokenizer("Plan the tools for the question.")["input_ids"]])
    adapter = tmp_path / "run" / "checkpoints" / "step-000002" / "agents" / "alpha" / "adapter"
    loaded = HFChatModel(spec.model_copy(update={"adapter": str(adapter)}), "alpha")
    plain = HFChatModel(spec, "alpha")
    policies["alpha"].eval()
    with torch.no_grad():
        want = policies["alpha"](input_ids=ids).logits
        got, base = loaded.model(input_ids=ids).logits, plain.model(input_ids=ids).logits
    assert torch.allclose(got, want, atol=1e-5) and not torch.allclose(base, want, atol=1e-3)
    assert not any("lora_" in n for n, _ in loaded.model.named_parameters())  # merged: base-model cost


# ------------------------------------------------------------------------------------------------ exact resume
COMPARED = ["loss", "reward/mean", "epoch", "topology/edges", "topology/active"] + [
    f"{a}/{k}" for a in AGENTS for k in ("loss", "grad_norm", "kl", "samples", "tokens", "clip_frac")]


@pytest.mark.slow
def test_kill_and_resume_reproduces_losses_exactly(tmp_path, video, m1_cache):
    """LoRA with dropout (so the torch RNG matters) and beta > 0: 4 steps straight vs 2 + resume + 2."""
    kw = dict(finetune="lora", steps=4, checkpoint={"every": 2})
    full = make_trainer(train_cfg(tmp_path / "a", **kw), video).train()
    killed = make_trainer(train_cfg(tmp_path / "b", **kw), video)
    first = killed.train(stop_after=3)  # dies after step 3: its newest checkpoint is step 2
    del killed
    resumed = make_trainer(train_cfg(tmp_path / "b", **kw), video)
    assert resumed.step == 2 and resumed.data.cursor == 4
    second = resumed.train()
    assert [r["step"] for r in second] == [3, 4]
    for want, got in zip(full, first[:2] + second):
        for key in COMPARED:
            assert got[key] == want[key], f"step {want['step']} {key}: {got[key]!r} != {want[key]!r}"
    assert any(full[i]["alpha/grad_norm"] > 0 for i in range(4))
    steps = [json.loads(x)["step"] for x in (tmp_path / "b" / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3, 4]  # the killed run's step-3 line was replaced, not duplicated


# ------------------------------------------------------------------------------------------------ rollouts
def test_dag_sampling_matches_configured_probabilities():
    rng = random.Random(7)
    names = ["a", "b", "c", "d"]
    n, edge_prob, dropout = 4000, 0.3, 0.2
    active = edges = possible = 0
    for _ in range(n):
        t = sample_topology(names, "random", edge_prob, dropout, rng)
        assert is_dag(t) and t.active
        assert all(a in t.active and b in t.active for a, b in t.edges)
        active += len(t.active)
        edges += len(t.edges)
        possible += len(t.active) * (len(t.active) - 1) // 2
    # P(no agent survives) = 0.2^4 is topped up by one forced agent: expected active share 0.8 + 0.2^4/4
    assert active / (n * len(names)) == pytest.approx(0.8 + 0.2 ** 4 / 4, abs=0.015)
    assert edges / possible == pytest.approx(edge_prob, abs=0.02)
    assert sample_topology(names, "complete", 0.0, 0.9, rng).edges == topo.complete(names).edges


def test_rollout_samples_cover_every_generation_with_its_episode_advantage(video):
    from m1.models.hub import ModelHub
    from m1.team.cpp import Team

    base = TeamConfig.model_validate({**team_dict(), "models": {
        "shared": {"interface": "chat", "path": "fake/a"}, "vlm": {"interface": "vision", "path": "fake/v"}},
        "agents": [{"name": "alpha", "model": "shared"}, {"name": "beta", "model": "shared"}]})
    cfg = training_team_config(base, 1.0)
    assert {a.model for a in cfg.agents} == {"shared@alpha", "shared@beta"}  # one learner per agent
    assert cfg.sampling.temperature == 1.0
    hub = ModelHub(cfg.models)
    vision = FakeVision(reply=lambda req: "TOOL-OUTPUT-TEXT the square is white")
    for key in ("shared@alpha", "shared@beta"):
        hub.register(key, FakeChat(key, scripted_reply))
    hub.register("vlm", vision)
    dag = sample_topology(AGENTS, "random", 1.0, 0.0, random.Random(0))
    batch = run_rollouts(Team(cfg, hub=hub), questions(video, 2), 3, dag)
    assert [[e.question.id for e in g] for g in batch.episodes] == [["q0"] * 3, ["q1"] * 3]
    assert all(e.topology == dag for e in batch.flat)  # one DAG for the whole step
    batch = score(batch, AGENTS, lambda eps: [{"alpha": float(i % 3), "beta": 1.0} for i in range(len(eps))])
    rewards = batch.rewards
    assert rewards["alpha"] == [[0.0, 1.0, 2.0], [0.0, 1.0, 2.0]]
    adv = group_all(rewards)
    samples = build_samples(batch, adv, {"alpha": 1.0, "beta": 1.0})
    for a in AGENTS:
        gens = [(g, k, gen) for g, grp in enumerate(batch.episodes) for k, e in enumerate(grp)
                for gen in e.generations if gen.agent == a]
        assert len(samples[a]) == len(gens) > 0
        assert {s.phase for s in samples[a]} >= {"plan", "communicate", "answer"}
        for s, (g, k, gen) in zip(samples[a], gens):
            assert (s.group, s.rollout) == (g, k) and s.completion_ids == gen.completion_ids
            assert s.advantage == pytest.approx(float(adv[a][g, k]))
            assert "TOOL-OUTPUT-TEXT" not in gen.completion  # tool text only ever appears in prompts
    assert any("TOOL-OUTPUT-TEXT" in str(gen.prompt) for e in batch.flat for gen in e.generations)
    assert all(s.advantage == 0.0 for s in samples["beta"])  # equal rewards carry no signal
    assert sorted({round(s.advantage, 3) for s in samples["alpha"]}) == [-1.0, 0.0, 1.0]  # (r - mean) / (std + 1e-4)


def scripted_team(**aggregation):
    """The two-agent team with well-behaved scripted agents (plan, continue, answer "A") and a fixed browser;
    `aggregation` overrides the team's aggregation block (mcq="summarizer": the first agent also summarizes)."""
    from m1.models.hub import ModelHub
    from m1.team.cpp import Team

    cfg = training_team_config(TeamConfig.model_validate({**team_dict(), "aggregation": aggregation, "models": {
        "qa": {"interface": "chat", "path": "fake/a"}, "qb": {"interface": "chat", "path": "fake/b"},
        "vlm": {"interface": "vision", "path": "fake/v"}}}), 1.0)
    hub = ModelHub(cfg.models)
    for key in ("qa", "qb"):
        hub.register(key, FakeChat(key, scripted_reply))
    hub.register("vlm", FakeVision(reply=lambda req: "the square is white"))
    return Team(cfg, hub=hub)


def test_phase_credit_gives_answers_the_advantage_of_their_outcome(video):
    """credit: phase — answers and the summary (what decides the team answer) are reinforced by their outcome,
    other generations by the total reward."""
    from types import SimpleNamespace


    dag = sample_topology(AGENTS, "complete", 1, 0, None)
    batch = run_rollouts(scripted_team(mcq="summarizer"), questions(video, 1), 3, dag)
    # rollout k: total rises with k (a better plan), the outcome falls (a worse answer)
    batch = score(batch, AGENTS, lambda eps: [{a: SimpleNamespace(total=float(k), outcome=float(-k))
                                               for a in AGENTS} for k in range(len(eps))])
    rewards = batch.rewards
    assert batch.outcomes["alpha"] == [[0.0, -1.0, -2.0]]
    samples = build_samples(batch, group_all(rewards), {"alpha": 1.0, "beta": 1.0},
                            group_all(batch.outcomes))
    by_phase = {}
    for s in samples["alpha"]:
        by_phase.setdefault(s.phase, {})[s.rollout] = round(s.advantage, 3)
    assert by_phase["answer"] == {0: 1.0, 1: 0.0, 2: -1.0}
    assert by_phase["summary"] == {0: 1.0, 1: 0.0, 2: -1.0}  # alpha, the first agent, summarizes
    assert by_phase["plan"] == {0: -1.0, 1: 0.0, 2: 1.0}
    # rollout.train_phases: the other phases' generations are not trained on; the kept ones keep their credit
    only = build_samples(batch, group_all(rewards), {"alpha": 1.0, "beta": 1.0},
                         group_all(batch.outcomes), phases=("answer", "summary"))
    assert [(s.phase, s.rollout, s.advantage) for s in only["alpha"]] == [
        (s.phase, s.rollout, s.advantage) for s in samples["alpha"] if s.phase in ("answer", "summary")]
    assert {s.phase for s in only["alpha"]} == {"answer", "summary"} and {s.phase for s in only["beta"]} == {"answer"}
    # plain-number rewards have no outcome part (the trainer then refuses phase credit: next test)
    assert score(batch, AGENTS, lambda eps: [{a: 1.0 for a in AGENTS} for _ in eps]).outcomes == {}


def test_phase_credit_needs_rewards_with_an_outcome(tmp_path, video, m1_cache):
    from m1.marl.rollout.episodes import RolloutError

    trainer = make_trainer(train_cfg(tmp_path, rollout={"credit": "phase"}), video)
    with pytest.raises(RolloutError, match="outcome"):
        trainer.train_step()


@pytest.mark.slow
def test_greedy_baseline_step_credits_rewards_minus_the_greedy_run(tmp_path, video, m1_cache, monkeypatch):
    """grpo.baseline greedy: each question is also run greedily; advantages are rewards minus that run's, the
    sampled rollouts are those of a plain step, and the greedy team's result is logged."""
    import torch

    from m1.marl.algo.credit import CreditStrategy

    seen = []
    real = CreditStrategy.advantages
    monkeypatch.setattr(CreditStrategy, "advantages", lambda self, r, b: seen.append(((r, b), real(self, r, b)))
                        or seen[-1][1])
    plain = make_trainer(train_cfg(tmp_path / "plain", grpo={"beta": 0.05, "scale_rewards": False}),
                         video).train_step()
    row = make_trainer(train_cfg(tmp_path / "greedy", grpo={"beta": 0.05, "scale_rewards": False,
                                                            "baseline": "greedy"}), video).train_step()
    (rewards, base), adv = seen[-1][0], seen[-1][1]
    for agent in AGENTS:
        assert len(base[agent]) == 2 and all(len(g) == 1 for g in base[agent])  # one greedy run per question
        want = torch.tensor(rewards[agent]) - torch.tensor(base[agent])
        torch.testing.assert_close(adv[agent], want)
        assert row[f"{agent}/samples"] == plain[f"{agent}/samples"]
    assert seen[0][0][0] == rewards  # same sampled rollouts as the plain step
    flat = [r for a in AGENTS for g in base[a] for r in g]
    assert row["greedy/reward"] == pytest.approx(sum(flat) / len(flat))
    # with the task rewards, the greedy team's own result is logged too
    real = make_trainer(train_cfg(tmp_path / "real", grpo={"beta": 0.05, "scale_rewards": False,
                                                          "baseline": "greedy"}), video, reward_fn=None).train_step()
    assert -1.0 <= real["greedy/team_res"] <= 1.0 and -1.0 <= real["greedy/res"] <= 1.0
    with pytest.raises(ValueError, match="scale_rewards"):
        train_cfg("unused", grpo={"baseline": "greedy"})


@pytest.mark.slow
def test_train_phases_leave_other_generations_out_of_the_step(tmp_path, video, m1_cache):
    """rollout.train_phases [answer]: each agent trains on its answers only (same rollouts as a full step)."""
    plain = make_trainer(train_cfg(tmp_path / "plain"), video).train_step()
    row = make_trainer(train_cfg(tmp_path / "answers", rollout={"train_phases": ["answer"]}), video).train_step()
    for agent in AGENTS:
        assert 0 < row[f"{agent}/samples"] < plain[f"{agent}/samples"]
        assert row[f"{agent}/samples"] == 2 * 2  # 2 questions x K=2 rollouts, one answer each


# ------------------------------------------------------------------------------------------------ learner numerics
def _synthetic_samples(n=10, seed=0):
    rng = random.Random(seed)
    return [Sample(agent="alpha", question_id="q", group=0, rollout=i, phase="plan",
                   prompt_ids=[rng.randrange(10, 300) for _ in range(rng.randrange(5, 20))],
                   completion_ids=[rng.randrange(10, 300) for _ in range(rng.randrange(1, 9))],
                   logprobs=None, reward=0.0, advantage=rng.uniform(-1, 1)) for i in range(n)]


@pytest.mark.parametrize("loss_type", ["grpo", "bnpo"])
@pytest.mark.slow
def test_gradient_accumulation_gives_the_full_batch_update(loss_type, m1_cache):
    import torch

    from m1.marl.actor.learner import AgentLearner

    spec = TeamConfig.model_validate(team_dict()).models["qa"]
    grpo = GRPOSettings(beta=0.0, loss_type=loss_type)
    samples = _synthetic_samples()
    results = []
    for micro in (10, 3, 1):
        # eps=1 makes Adam's first step ~ g / (|g| + 1), smooth in g; with eps=1e-8 it is ~sign(g), which turns
        # float rounding in near-zero gradient entries into full-size differences.
        cfg = LearnerConfig(finetune="full", lr=1.0, eps=1.0, micro_batch_size=micro, max_grad_norm=None)
        learner = AgentLearner.build("alpha", "qa", spec, cfg, grpo)
        stats = learner.actor.update(samples, lr=1.0)
        results.append((stats, learner.actor.parameters()))
    (s0, p0), *rest = results
    for st, params in rest:
        assert st["loss"] == pytest.approx(s0["loss"], abs=1e-6)
        assert st["grad_norm"] == pytest.approx(s0["grad_norm"], rel=1e-4)
        for n, p in p0.items():
            torch.testing.assert_close(params[n], p, atol=1e-6, rtol=1e-5)


@pytest.mark.slow
def test_deepspeed_zero2_step_on_cpu(tmp_path, m1_cache):
    import torch

    from m1.marl.actor.learner import AgentLearner

    spec = TeamConfig.model_validate(team_dict()).models["qb"]
    cfg = LearnerConfig(finetune="full", lr=1e-2, micro_batch_size=4, precision="fp32", deepspeed="zero2")
    learner = AgentLearner.build("beta", "qb", spec, cfg, GRPOSettings(beta=0.0))
    assert type(learner.actor.optim.optimizer).__name__ == "DeepSpeedZeroOptimizer"
    assert learner.actor.engine.zero_optimization_stage() == 2
    before = learner.actor.parameters()
    stats = learner.actor.update(_synthetic_samples(6), lr=1e-2)  # two micro-batches, one optimizer step
    after = learner.actor.parameters()
    assert stats["samples"] == 6 and stats["grad_norm"] > 0
    assert all(not torch.equal(after[n], before[n]) for n in before)
    save_actor(learner.actor, tmp_path / "ckpt")
    assert (tmp_path / "ckpt" / "zero-rank0.pt").is_file() and not (tmp_path / "ckpt" / "deepspeed").exists()
    twin = AgentLearner.build("beta", "qb", spec, cfg, GRPOSettings(beta=0.0))
    load_actor(twin.actor, tmp_path / "ckpt")  # weights and ZeRO optimizer state: the next step is identical
    nxt = _synthetic_samples(6, seed=1)
    assert twin.actor.update(nxt, lr=1e-2)["loss"] == learner.actor.update(nxt, lr=1e-2)["loss"]
    a, b = learner.actor.parameters(), twin.actor.parameters()
    assert all(torch.equal(a[n], b[n]) for n in a)


# ------------------------------------------------------------------------------------------------ configs and CLI
def test_lr_schedules_warm_up_then_hold_or_decay_to_zero():
    def lrs(schedule, warm=0, total=5):
        cfg = LearnerConfig(finetune="full", lr=1.0, warmup_steps=warm, lr_schedule=schedule)
        return [round(cfg.lr_at(s, total), 6) for s in range(total)]

    assert lrs("constant") == [1.0] * 5
    assert lrs("constant", warm=2) == [0.5, 1.0, 1.0, 1.0, 1.0]
    assert lrs("linear") == [1.0, 0.8, 0.6, 0.4, 0.2]
    assert lrs("linear", warm=1) == [1.0, 1.0, 0.75, 0.5, 0.25]
    assert lrs("cosine") == [1.0, 0.904508, 0.654508, 0.345492, 0.095492]
    assert LearnerConfig(lr=1.0, lr_schedule="cosine").lr_at(7, 5) == 0.0  # past the end: stays at 0


@pytest.mark.slow
def test_sft_trainer_follows_the_lr_schedule(tmp_path, m1_cache):
    from m1.marl.config import SFTConfig
    from m1.marl.sft import SFTTrainer
    from m1.marl.sft_examples import SFTExample

    examples = [SFTExample(agent="qwen2_small", question_id=f"q{i}", phase="plan", messages=[{"role": "user", "content": "hi"}],
                           completion="##Plan: x") for i in range(6)]
    cfg = SFTConfig(team="tiny", train_agents=["qwen2_small"], data={"examples": str(tmp_path / "ex.jsonl")},
                    learner={"finetune": "full", "lr": 1e-2, "lr_schedule": "linear", "micro_batch_size": 2},
                    epochs=1, batch_size=2, out_dir=str(tmp_path / "out"), log={"progress": False})
    rows = SFTTrainer(cfg, examples=examples).train()
    assert [round(r["lr"], 6) for r in rows] == [1e-2, round(1e-2 * 2 / 3, 6), round(1e-2 / 3, 6)]


def test_paper_configs_load_with_the_papers_settings():
    for name, finetune, lr in (("videochat_m1_lora", "lora", 2e-6), ("videochat_m1_full", "full", 1e-7)):
        cfg = load_train_config(name)
        assert (cfg.rollout.num_generations, cfg.rollout.questions_per_step, cfg.rollout.temperature) == (4, 8, 1.0)
        assert cfg.grpo.beta == 1e-5 and cfg.learner.finetune == finetune and cfg.learner.learning_rate() == lr
        # prompts: the measured p99 of ~3,200 tokens fits whole (docs/prompt_budgets.md); completions the paper's 1,024
        assert (cfg.learner.max_prompt_tokens, cfg.learner.max_completion_tokens) == (4096, 1024)
        assert cfg.team_config().limits.max_prompt_tokens == 4096
        assert cfg.init_from == f"runs/sft/videochat_m1_{finetune}"  # SFT, then MARL
        assert cfg.team_config().limits.max_turns == 5 and cfg.learner.deepspeed
        assert cfg.judge.method == "llm"
    lora = load_train_config("videochat_m1_lora").learner.lora
    assert (lora.r, lora.alpha, lora.dropout) == (8, 16, 0.05)
    assert load_train_config("mini").team_config().name == "mini"


@pytest.mark.slow
def test_train_main_runs_from_a_yaml_file(tmp_path, video, m1_cache):
    from m1.marl.launch import train_main

    qfile = tmp_path / "questions.jsonl"
    qfile.write_text("".join(q.model_dump_json() + "\n" for q in questions(video)))
    cfg = train_cfg(tmp_path / "out").model_dump(mode="json")
    cfg["data"] = {"questions": str(qfile)}
    path = tmp_path / "marl.yaml"
    path.write_text(yaml.safe_dump(cfg))
    printed = []
    rows = train_main(path, ["steps=1"], progress=printed.append)  # real rewards: offline rubric judge
    assert len(rows) == 1 and "reward/col" in rows[0] and "reward/total/alpha" in rows[0]
    assert "metrics.jsonl" in printed[-3] and printed[-2].startswith("plots: ")
    assert {p.name for p in (tmp_path / "out" / "plots").iterdir()} >= {"rewards.png", "loss.png", "kl.png"}
    # the last line is the m1 infer call that seats the trained agents: applied to the team, it names their weights
    import shlex

    from m1.config_files import apply_overrides

    words = shlex.split(printed[-1].split(": ", 1)[1])
    assert words[:5] == ["m1", "infer", "VIDEOS", "--team", "TEAM.yaml"]  # the run's team was inline
    sets = [words[i + 1] for i, w in enumerate(words) if w == "--set"]
    team = TeamConfig.model_validate(apply_overrides(cfg["team"], sets, "printed"))
    ckpt = tmp_path / "out" / "checkpoints" / "step-000001" / "agents"
    for a in team.agents:
        spec = team.models[a.model]
        assert spec.tiny is None and spec.path == str(ckpt / a.name / "model")
        assert (ckpt / a.name / "model" / "config.json").is_file()
    again = train_main(path, ["steps=1"], progress=printed.append)  # resumes at the end: nothing to do
    assert again == [] and "nothing to do" in printed[-3]
    from m1.locks import LockError, hold_dir

    with hold_dir(tmp_path / "out", "training output folder"):  # another run holds the folder: refused at once
        with pytest.raises(LockError, match="training output folder"):
            train_main(path, ["steps=1"], progress=printed.append)


def test_trained_agent_overrides_seat_adapters_and_name_shared_models(tmp_path):
    from m1.marl.launch import trained_agent_overrides

    team = TeamConfig.model_validate(team_dict())
    agent = team.agents[0]
    sets, notes = trained_agent_overrides(team, [agent.name], tmp_path, "lora")
    assert sets == [f"models.{agent.model}.adapter={tmp_path / 'agents' / agent.name / 'adapter'}"] and notes == []
    shared = team.model_copy(update={"agents": [a.model_copy(update={"model": agent.model}) for a in team.agents]})
    sets, notes = trained_agent_overrides(shared, [agent.name], tmp_path, "full")
    assert sets == [] and len(notes) == 1 and "own model entry" in notes[0]


@pytest.mark.slow
def test_ray_learners_match_local_learners(tmp_path, video, m1_cache):
    ray = pytest.importorskip("ray", reason="ray is not installed (pip install ray==2.60.0); the local placement is "
                                            "tested above")

    # only alpha learns (one actor starts); beta acts from the driver with frozen weights
    local = make_trainer(train_cfg(tmp_path / "local", train_agents=["alpha"]), video).train()
    ray.init(num_cpus=2, include_dashboard=False, object_store_memory=200 * 2**20,
             runtime_env={"env_vars": {"OMP_NUM_THREADS": "1", "M1_CACHE": m1_cache, "HF_HUB_OFFLINE": "1"}})
    try:
        tr = make_trainer(train_cfg(tmp_path / "ray", placement="ray", train_agents=["alpha"]), video)
        remote = tr.train()
        tr.close()
    finally:
        ray.shutdown()
    assert "beta/loss" not in remote[0] and "beta/loss" not in local[0]
    for key in ("loss", "reward/mean", "alpha/samples", "alpha/tokens"):
        assert remote[0][key] == pytest.approx(local[0][key], rel=1e-5, abs=1e-7)
    assert remote[0]["alpha/grad_norm"] == pytest.approx(local[0]["alpha/grad_norm"], rel=1e-4)
    assert (Path(tmp_path) / "ray" / "checkpoints" / "step-000001" / "agents" / "alpha" / "rng.pt").is_file()


@pytest.mark.slow
def test_sampler_importance_weights_correct_engine_logprobs(m1_cache):
    """grpo.old_logprobs sampler: with the engine's log-probs equal to the trainer's the update is the plain
    on-policy one; with the engine off by +-d per token each token's policy term is weighted by
    min(exp(trainer - engine), is_cap), and the ratio stats and the truncated share are logged."""
    import math

    import torch

    from m1.marl.actor.learner import AgentLearner

    spec = TeamConfig.model_validate(team_dict()).models["qa"]
    samples = _synthetic_samples(6)

    def learner(mode, cap=2.0):
        return AgentLearner.build("alpha", "qa", spec, LearnerConfig(finetune="full", lr=1e-2, micro_batch_size=6),
                                  GRPOSettings(beta=0.0, old_logprobs=mode, is_cap=cap)).actor

    probe = learner("policy")
    with torch.no_grad():
        logp, mask = probe.compute_logprobs(probe.scorer.rows(samples), 1.0, model=probe.policy)
    exact = [s.__class__(**{**s.__dict__, "logprobs": logp[i, :len(s.completion_ids)].tolist()})
             for i, s in enumerate(samples)]
    plain, same = learner("policy").update(exact, 1e-2), learner("sampler").update(exact, 1e-2)
    assert same["loss"] == pytest.approx(plain["loss"], abs=1e-6)
    assert same["is/ratio_mean"] == pytest.approx(1.0, abs=1e-5) and same["is/truncated"] == 0.0
    # the engine puts every token 1.0 lower in even samples (ratio e > cap: truncated to 2) and 0.5 higher in odd
    # ones (ratio e^-0.5): the policy term of each token is scaled by that weight
    shifted = [s.__class__(**{**s.__dict__, "logprobs": [x - 1.0 if i % 2 == 0 else x + 0.5 for x in s.logprobs]})
               for i, s in enumerate(exact)]
    got = learner("sampler").update(shifted, 1e-2)
    n_even = sum(len(s.completion_ids) for s in exact[::2])
    n_all = sum(len(s.completion_ids) for s in exact)
    assert got["is/truncated"] == pytest.approx(n_even / n_all)
    assert got["is/ratio_max"] == pytest.approx(math.e, rel=1e-4)
    want_mean = (n_even * math.e + (n_all - n_even) * math.exp(-0.5)) / n_all
    assert got["is/ratio_mean"] == pytest.approx(want_mean, rel=1e-4)
    # grpo loss (mean over samples of the token mean) of -A * ratio(=1) * weight: weights 2 and e^-0.5
    want_loss = sum(-s.advantage * (2.0 if i % 2 == 0 else math.exp(-0.5)) for i, s in enumerate(exact)) / 6
    assert got["loss"] == pytest.approx(want_loss, abs=1e-5)


@pytest.mark.slow
def test_init_from_starts_marl_from_the_sft_runs_weights(tmp_path, video, m1_cache):
    """`init_from` (the paper's recipe, SFT then MARL): a run that names a finished LoRA run starts from that run's
    adapters merged into their bases (out_dir/init), so its first rollouts come from the SFT policy, not the base;
    a missing or unfinished run is refused naming `init_from` before any model loads."""
    import torch

    from m1.config_files import ConfigError
    from m1.marl.launch import INIT_DIR, train_main
    from m1.models.hf import HFChatModel

    team_file = tmp_path / "team.yaml"
    team_file.write_text(yaml.safe_dump(team_dict()))
    qfile = tmp_path / "questions.jsonl"
    qfile.write_text("".join(q.model_dump_json() + "\n" for q in questions(video)))

    def config(out, finetune, **extra):
        cfg = train_cfg(out, finetune=finetune).model_dump(mode="json")
        cfg.update(team=str(team_file), data={"questions": str(qfile)}, **extra)
        path = tmp_path / f"{Path(out).name}.yaml"
        path.write_text(yaml.safe_dump(cfg))
        return path

    with pytest.raises(ConfigError, match="init_from: .*sft_run is not a folder"):
        train_main(config(tmp_path / "marl", "full", init_from=str(tmp_path / "sft_run")), ["steps=1"],
                   progress=lambda m: None)
    (tmp_path / "sft_run").mkdir()
    with pytest.raises(ConfigError, match="holds no finished checkpoint"):
        train_main(config(tmp_path / "marl", "full", init_from=str(tmp_path / "sft_run")), ["steps=1"],
                   progress=lambda m: None)
    assert not (tmp_path / "marl").exists()  # refused before anything ran

    # the SFT run: three LoRA steps on plans (lr 1e-2 moves the adapters), then MARL starts from it
    from m1.marl.sft import sft_main, write_examples
    from m1.marl.sft_examples import SFTExample

    write_examples(tmp_path / "examples.jsonl", [
        SFTExample(agent=a, question_id=f"q{i}", phase="plan", completion="##tool use: <Global Sampling>",
                   messages=[{"role": "user", "content": f"Plan tools for question {i}."}])
        for i in range(4) for a in AGENTS])
    sft = {"team": str(team_file), "data": {"examples": str(tmp_path / "examples.jsonl")},
           "learner": {"finetune": "lora", "lr": 1e-2, "micro_batch_size": 4}, "batch_size": 4, "max_steps": 3,
           "out_dir": str(tmp_path / "sft_run"), "checkpoint": {"every": 3},
           "log": {"progress": False, "backends": []}}
    (tmp_path / "sft.yaml").write_text(yaml.safe_dump(sft))
    sft_main(tmp_path / "sft.yaml", [], progress=lambda m: None)
    adapter = tmp_path / "sft_run" / "checkpoints" / "step-000003" / "agents" / "alpha" / "adapter"
    printed = []
    train_main(config(tmp_path / "marl", "full", init_from=str(tmp_path / "sft_run")), ["steps=1"],
               progress=printed.append)
    assert any("starting from the agents trained in" in m and "alpha: lora" in m for m in printed)
    merged = tmp_path / "marl" / INIT_DIR / "alpha"
    assert (merged / "config.json").is_file()
    team = TeamConfig.model_validate(team_dict())
    sft = HFChatModel(team.models["qa"].model_copy(update={"adapter": str(adapter)}), "qa")
    base = HFChatModel(team.models["qa"], "qa")
    start = HFChatModel(team.models["qa"].model_copy(update={"tiny": None, "path": str(merged)}), "qa")
    ids = torch.tensor([[5, 9, 17, 33, 2]])
    with torch.no_grad():
        want, got, untrained = (m.model(input_ids=ids).logits for m in (sft, start, base))
    assert torch.allclose(got, want, atol=1e-5) and not torch.allclose(got, untrained, atol=1e-3)
    # the printed m1 infer call seats the MARL weights (whole models) trained on top of the SFT start
    assert "checkpoints/step-000001/agents/alpha/model" in printed[-1]
