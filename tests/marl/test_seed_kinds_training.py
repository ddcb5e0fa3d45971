"""Training the seed kinds: each seed's reward with its paper's numbers on hand-made
episodes; GRPO of a single multi-turn Weaver policy with the MARL trainer (every turn a sample with the episode's
advantage, tool observations in the prompt only, exact resume); SFT on the rule-based Weaver's trajectories.
Tiny random text policies on a tiny M1-Synth world; each test runs in seconds."""
from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from tests.conftest import make_synth_world, varied_reward

from m1.config import load_team
from m1.marl.config import SFTConfig, TrainConfig, load_sft_config, load_train_config
from m1.marl.reward.rewards import RewardConfig, SeedReward, reward_kind, seed_reward, seed_rewards
from m1.schema import AgentAnswer, AgentRecord, Episode, Generation, Question, Topology, Turn

NO_CLIP = ["models.clip.clip_name=null", "models.clip.tiny={arch: open_clip}"]  # the world's CLIP takes minutes
MCQ = Question(id="q1", video="v.mp4", text="What colour is the car?", options=["red", "blue", "green", "grey"],
               answer="B")
GROUND = Question(id="q2", video="v.mp4", text="When does the car appear?", task="grounding", answer="[10 - 20]")
BASE = (Path(__file__).parents[2] / "assets" / "mini_base").resolve()  # the students' start
TINY = {"arch": "qwen3", "hidden_size": 32, "layers": 1, "heads": 2, "kv_heads": 1, "seed": 3}


# ----------------------------------------------------------------------------- rewards on hand-made episodes
def seed_episode(answer, strict=(True, True), calls=(("trim", '{"start": 0.0, "end": 4.0}'),), question=MCQ,
                 kind="weaver", error=None):
    """A team-of-one episode: one generation per entry of `strict` (the last one answers), `calls` executed."""
    n = len(strict)
    gens = [Generation(agent="p", phase="act" if i < n - 1 else "answer", step=i,
                       prompt=[{"role": "user", "content": "q"}], completion="r", parse_ok=ok)
            for i, ok in enumerate(strict)]
    turns = [Turn(step=i + 1, tool=t, key_info=k, output="obs") for i, (t, k) in enumerate(calls)]
    return Episode(id=question.id, question=question, topology=Topology(agents=["p"], active=["p"], edges=[]),
                   memory={"p": AgentRecord(plan=[t for t, _ in calls], turns=turns, answer=answer)},
                   generations=gens, answers=[AgentAnswer(agent="p", answer=answer or "")], final_answer=answer,
                   aggregation=f"single ({kind})", error=error)


@pytest.mark.parametrize("kind, answer, strict, calls, want", [
    # Weaver: 0.7 correct + 0.2 format (every turn strict) + 0.1 (a tool was used and the answer is right)
    ("weaver", "B", (True, True), 1, 1.0),
    ("weaver", "B", (False, True), 1, 0.8),  # one turn read leniently: no format part
    ("weaver", "B", (True,), 0, 0.9),  # right without a tool: no tool part
    ("weaver", "C", (True, True), 1, 0.2),  # wrong: the tool part needs a right answer
    ("weaver", None, (True, False), 1, 0.0),  # unanswered, last turn unreadable
    # VideoZoomer: 0.9 / 0.1 / 0.5
    ("zoomer", "B", (True, True), 1, 1.5),
    ("zoomer", "B", (True,), 0, 1.0),
    ("zoomer", "C", (True, True), 1, 0.1),
    ("zoomer", "B", (True, False), 1, 1.4),
    # SAGE: correct (1/0) + 0.1 for a tool trace without a repeated call, -0.1 with one, 0 without tools
    ("sage", "B", (True,), 0, 1.0),
    ("sage", "B", (True, True), 1, 1.1),
    ("sage", "C", (True, True, True), 2, -0.1),  # the same call twice
    ("sage", "B", (False, True), 1, 1.1),  # SAGE's seed names no format reward
])
def test_seed_rewards_have_the_papers_numbers(kind, answer, strict, calls, want):
    call = ("trim", '{"start": 0.0, "end": 4.0}')
    ep = seed_episode(answer, strict, (call,) * calls, kind=kind)
    r = seed_reward(ep, kind)
    assert isinstance(r, SeedReward) and r.kind == kind and r.agent == "p"
    assert r.total == pytest.approx(want)
    assert r.correct == float(answer == "B") and r.tool_calls == calls and r.turns == len(strict)
    assert r.format == float(all(strict))


def test_seed_reward_correctness_is_the_evaluations():
    """Right = m1.data.metrics.is_correct, as the CPP rewards and m1 eval: grounding needs IoU >= 0.5."""
    assert seed_reward(seed_episode("[11 - 19]", question=GROUND), "weaver").correct == 1.0
    assert seed_reward(seed_episode("[0 - 9]", question=GROUND), "weaver").correct == 0.0
    failed = seed_episode(None, error="v.mp4: cannot decode")
    assert seed_rewards([failed, seed_episode("B")], "zoomer")[0] == {}  # no reward: NaN in the group
    with pytest.raises(ValueError, match="no ground truth"):
        seed_reward(seed_episode("B", question=MCQ.model_copy(update={"answer": None})), "weaver")
    with pytest.raises(ValueError, match="rewards.kind: 'cpp' has no seed reward"):
        seed_reward(seed_episode("B"), "cpp")


def test_reward_kind_follows_the_team():
    weaver, cpp = load_team("weaver_synth"), load_team("synth_teacher", NO_CLIP)
    assert reward_kind(RewardConfig(), weaver) == "weaver" and reward_kind(RewardConfig(), cpp) == "cpp"
    assert reward_kind(RewardConfig(kind="zoomer"), weaver) == "zoomer"
    with pytest.raises(ValueError, match="rewards.kind: 'cpp' does not fit team 'weaver_synth'"):
        reward_kind(RewardConfig(kind="cpp"), weaver)
    assert "kind" not in RewardConfig().recorded()  # a default: CPP configs record as before


def test_corrected_calls_count_reflection_trajectories():
    from m1.marl.sft_examples import corrected_calls

    def zooms(*spans, error=None):
        ep = seed_episode("B", calls=[("video_zoom", json.dumps({"segment": list(s), "fps": 1})) for s in spans],
                          kind="zoomer")
        for t, s in zip(ep.memory["p"].turns, spans):
            t.span = s
        ep.memory["p"].turns[0].error = error
        return ep

    assert corrected_calls(zooms((4.0, 8.0)), "p") == 0
    assert corrected_calls(zooms((4.0, 8.0), (2.0, 10.0)), "p") == 1  # the missed zoom widened
    assert corrected_calls(zooms((4.0, 8.0), (20.0, 24.0)), "p") == 0  # both ends of an event: a plan
    assert corrected_calls(zooms((0.0, 30.0), (4.0, 8.0), error="asks for 30 frames"), "p") == 1


# ----------------------------------------------------------------------------- a tiny world and a tiny policy
@pytest.fixture(scope="module")
def world(tmp_path_factory):
    return make_synth_world(tmp_path_factory.mktemp("world"), 2, 7, 30, 6)


def weaver_team(max_turns=3, **seed):
    return {"name": "weaver_tiny",
            "models": {"policy": {"interface": "chat", "device": "cpu", "tiny": TINY},
                       "vision": {"interface": "vision", "backend": "synth"}},
            "agents": [{"name": "weaver", "model": "policy", "kind": "weaver"}], "tools": {"browser": "vision"},
            "seed_system": {"glance_frames": 4, "max_turns": max_turns, "reply_tokens": 12, **seed},
            "limits": {"batch_episodes": 16}}


def train_cfg(out, finetune="full", steps=1, **over):
    data = {"team": weaver_team(), "rollout": {"num_generations": 2, "questions_per_step": 2},
            "grpo": {"beta": 0.05},
            "learner": {"finetune": finetune, "lr": 1e-2, "micro_batch_size": 4, "max_completion_tokens": 16,
                        "max_prompt_tokens": 2048},  # prompts are never cut: the whole weaver chat
            "steps": steps, "out_dir": str(out), "checkpoint": {"every": 1, "keep_last": 3},
            "log": {"progress": False, "backends": []}}
    for k, v in over.items():
        data[k] = {**data[k], **v} if isinstance(data.get(k), dict) else v
    return TrainConfig.model_validate(data)


class ScriptedTokens:
    """A policy that replies from a script (a trim, then an answer) and reports the token ids a tiny model's
    tokenizer gives its prompt and reply: a multi-turn episode with a real tool observation, and real ids."""

    def __init__(self, chat):
        self.chat, self.name = chat, "policy"

    def generate(self, requests, params):
        from m1.models.base import Completion

        out = []
        tok = self.chat.tokenizer
        for r in requests:
            done = sum(m["role"] == "assistant" for m in r.messages)
            text = ('Step 1: cut the start.\n<tool_call>{"tool_name": "trim", "start": 0.0, "end": 4.0}</tool_call>'
                    if done == 0 else "Final step: it is red.\n<answer>A</answer>")
            prompt = tok(self.chat.render(r), add_special_tokens=False)["input_ids"]
            completion = tok(text, add_special_tokens=False)["input_ids"] + [self.chat.eos_ids[0]]
            out.append(Completion(text=text, prompt_ids=prompt, completion_ids=completion, logprobs=None))
        return out


# ----------------------------------------------------------------------------- GRPO of one multi-turn agent
def test_observations_are_context_never_targets(world, m1_cache):
    """Every turn is a sample whose prompt is the chat so far (the trim's observation included) and whose target is
    that turn's reply only; the learner's loss mask covers exactly the reply tokens; all turns of an episode share
    its advantage."""
    from m1.config import ModelSpec, TeamConfig
    from m1.marl.config import GRPOSettings, LearnerConfig
    from m1.marl.actor.learner import AgentLearner
    from m1.marl.algo.advantages import group_advantages
    from m1.marl.rollout.episodes import build_samples, run_rollouts, score
    from m1.models.hub import ModelHub
    from m1.team.single import SingleAgentTeam
    from m1.team import topology as topo

    cfg = TeamConfig.model_validate(weaver_team())
    learner = AgentLearner.build("weaver", "policy", ModelSpec(interface="chat", device="cpu", tiny=TINY),
                                 LearnerConfig(finetune="full", max_prompt_tokens=4096), GRPOSettings(beta=0.0))
    hub = ModelHub(cfg.models)
    hub.register("policy", ScriptedTokens(learner.sampler.chat), interface="chat")
    team = SingleAgentTeam(cfg, hub=hub)
    qs = [q for q in world[2] if q.task == "mcq"][:2]
    batch = run_rollouts(team, qs, 2, topo.complete(["weaver"]))
    batch = score(batch, ["weaver"], lambda eps: seed_rewards(eps, "weaver"))
    rewards = batch.rewards
    adv = {a: group_advantages(r) for a, r in rewards.items()}
    samples = build_samples(batch, adv, {"weaver": 1.0})["weaver"]
    assert len(samples) == 2 * 2 * 2 and [s.phase for s in samples[:2]] == ["act", "answer"]
    tok = learner.actor.tokenizer
    for g, group in enumerate(batch.episodes):
        for k, ep in enumerate(group):
            mine = [s for s in samples if (s.group, s.rollout) == (g, k)]
            obs = ep.memory["weaver"].turns[0]
            assert obs.tool == "trim" and obs.error is None and obs.output
            assert {s.advantage for s in mine} == {float(adv["weaver"][g, k])}  # one advantage per episode
            assert [s.completion_ids for s in mine] == [gen.completion_ids for gen in ep.generations]
            second = tok.decode(mine[1].prompt_ids)
            assert "[trim]" in second and obs.output[:40] in second  # the observation is context of turn 2
            assert "<tool_call>" in second  # and so is turn 1's own reply
            for s in mine:
                target = tok.decode(s.completion_ids)
                assert "[trim]" not in target and obs.output[:40] not in target and "<frame" not in target
    _, mask = learner.actor.compute_logprobs(learner.actor.scorer.rows(samples), 1.0, model=learner.actor.policy)
    assert mask.sum(1).tolist() == [float(len(s.completion_ids)) for s in samples]  # the loss sees replies only
    learner_rows = learner.actor.scorer.rows(samples)
    assert all(p == s.prompt_ids and c == s.completion_ids for (p, c), s in zip(learner_rows, samples))


def make_trainer(cfg, qs, reward_fn=None):
    from m1.marl import parts

    return parts.make_trainer(cfg, questions=qs, reward_fn=reward_fn)


@pytest.mark.slow
def test_grpo_logs_the_seed_rewards_of_its_episodes(world, tmp_path, m1_cache, monkeypatch):
    """With the default reward (rewards.kind auto -> Weaver's), the logged rewards are the reward function on the
    step's episodes, and every policy turn becomes one sample whose target is that turn's reply."""
    import m1.marl.algo.credit as credit_mod

    seen = {}
    build = credit_mod.build_samples

    def capture(batch, *args, **kw):
        seen["batch"] = batch
        seen["samples"] = build(batch, *args, **kw)
        return seen["samples"]

    monkeypatch.setattr(credit_mod, "build_samples", capture)
    tr = make_trainer(train_cfg(tmp_path / "run"), world[2])
    row = tr.train()[0]
    eps = seen["batch"].flat
    want = [seed_reward(e, "weaver").total for e in eps]
    assert row["weaver/reward"] == pytest.approx(sum(want) / len(want))
    assert row["reward/total/weaver"] == pytest.approx(sum(want) / len(want))
    assert row["reward/format"] == pytest.approx(sum(seed_reward(e, "weaver").format for e in eps) / len(eps))
    assert row["topology/active"] == 1 and row["episodes/failed"] == 0
    gens = [g for e in eps for g in e.generations if g.completion_ids]
    samples = seen["samples"]["weaver"]
    assert len(samples) == len(gens) > len(eps)  # several turns per episode, each one sample
    assert [s.completion_ids for s in samples] == [g.completion_ids for g in gens]
    for e in eps:  # a turn after an unreadable reply: the engine's feedback is in its prompt, not in any target
        if len(e.generations) > 1 and not e.generations[0].parse_ok:
            fed = e.generations[1].prompt[-1]["content"][0]["text"]
            assert fed.startswith("Your reply could not be read")
            assert fed not in "".join(g.completion for g in e.generations)
    lines = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert lines[0]["reward/total"] == pytest.approx(sum(want) / len(want))


@pytest.mark.slow
def test_grpo_step_moves_every_trainable_parameter(world, tmp_path, m1_cache):
    import torch

    tr = make_trainer(train_cfg(tmp_path / "run"), world[2], varied_reward)
    before = tr.learners.parameters("weaver")
    row = tr.train()[0]
    after = tr.learners.parameters("weaver")
    assert len(after) >= 10
    assert not [n for n in after if torch.equal(after[n], before[n])]
    assert row["weaver/samples"] > 4 and row["weaver/grad_norm"] > 0 and row["weaver/logp_gap"] < 1e-4


COMPARED = ["loss", "reward/mean", "epoch", "weaver/loss", "weaver/grad_norm", "weaver/kl", "weaver/samples",
            "weaver/tokens", "weaver/clip_frac"]


@pytest.mark.slow
def test_killed_after_step_1_and_resumed_repeats_the_losses(world, tmp_path, m1_cache):
    """LoRA with dropout (the torch RNG matters) and beta > 0: 3 steps straight vs 1 + resume + 2."""
    kw = dict(finetune="lora", steps=3)
    full = make_trainer(train_cfg(tmp_path / "a", **kw), world[2], varied_reward).train()
    killed = make_trainer(train_cfg(tmp_path / "b", **kw), world[2], varied_reward)
    first = killed.train(stop_after=1)
    del killed
    resumed = make_trainer(train_cfg(tmp_path / "b", **kw), world[2], varied_reward)
    assert resumed.step == 1 and resumed.data.cursor == 2
    second = resumed.train()
    assert [r["step"] for r in first + second] == [1, 2, 3]
    for want, got in zip(full, first + second):
        for key in COMPARED:
            assert got[key] == want[key], f"step {want['step']} {key}: {got[key]!r} != {want[key]!r}"
    assert any(r["weaver/grad_norm"] > 0 for r in full)


def test_seed_configs_refuse_what_does_not_apply(tmp_path):
    from m1.config_files import ConfigError

    with pytest.raises(ValueError, match="rollout.train_phases: \\['plan'\\] are CPP phases"):
        train_cfg(tmp_path, rollout={"train_phases": ["plan"]})
    assert train_cfg(tmp_path, rollout={"train_phases": ["answer"]}).rollout.train_phases == ["answer"]
    for credit in ("phase", "agent"):
        with pytest.raises(ValueError, match=f"rollout.credit: '{credit}'.*use credit: episode"):
            train_cfg(tmp_path, rollout={"credit": credit})
    vl = weaver_team()
    vl["models"]["policy"] = {"interface": "vision", "device": "cpu", "tiny": {"arch": "qwen2_5_vl", "seed": 5}}
    assert train_cfg(tmp_path, team=vl).team.models["policy"].interface == "vision"  # tests/marl/test_seed_kinds_vlm_training.py
    vl["models"]["policy"] = {"interface": "vision", "backend": "synth"}
    with pytest.raises(ValueError, match="a trained vision-language policy needs backend 'hf'"):
        train_cfg(tmp_path, team=vl)
    with pytest.raises(ValueError, match="rewards.kind: 'cpp' does not fit"):
        train_cfg(tmp_path, rewards={"kind": "cpp"})
    with pytest.raises(ConfigError, match="data.phases"):
        load_sft_config("weaver_synth", ["data.phases=[plan, answer]"])


@pytest.mark.parametrize("kind", ["weaver", "zoomer", "sage"])
def test_shipped_seed_kind_configs_load_with_one_loop_for_teacher_student_and_eval(kind):
    """Each kind's SFT and GRPO configs train the mini base as a text policy that reads the frames' descriptions, in the same
    loop as the rule-based teacher it learns from and the experiment that evaluates it; its replies fit the
    learner's completion budget."""
    from m1.experiment.config import load_experiment

    marl, sft = load_train_config(f"{kind}_synth"), load_sft_config(f"{kind}_synth")
    teacher = sft.teacher_config()
    exp = load_experiment(f"seed_kinds_{kind}")
    evaluated = load_team(exp.eval.team, exp.eval.overrides)
    for cfg in (marl, sft):
        team = cfg.team_config()
        assert team.agents[0].kind == kind and team.models[team.agents[0].model].interface == "chat"
        policy = team.models[team.agents[0].model]
        assert policy.tiny is None and Path(policy.path).resolve() == BASE and team.seed_system.captioner == "vision"
        assert team.seed_system.reply_tokens == cfg.learner.max_completion_tokens
        for other in (teacher, evaluated):
            loop = {k: v for k, v in other.seed_system.model_dump().items() if k != "reply_tokens"}
            assert loop == {k: v for k, v in team.seed_system.model_dump().items() if k != "reply_tokens"}
    assert teacher.models["policy"].backend == evaluated.models["policy"].backend == "synth"  # the rules row
    assert marl.rollout.train_phases == ["plan", "communicate", "answer", "summary"]  # default: every turn


@pytest.mark.slow
def test_m1_train_runs_the_shipped_weaver_config(world, tmp_path, m1_cache):
    """`m1 train --config weaver_synth` builds the team with make_team (no make_team error) and trains a step."""
    from m1.marl.launch import train_main

    d, path, _ = world
    marl = load_train_config("weaver_synth")
    sets = [f"data.questions={path}", f"data.video_dir={d}", f"out_dir={tmp_path / 'run'}", "steps=1",
            "rollout.questions_per_step=1", "rollout.num_generations=2", "log.progress=false",
            "team_overrides=" + json.dumps(list(marl.team_overrides) + NO_CLIP + ["seed_system.glance_frames=4",
                                                                                   "seed_system.max_turns=2"])]
    said = []
    rows = train_main("weaver_synth", sets, said.append)
    assert [r["step"] for r in rows] == [1] and not math.isnan(rows[0]["reward/total"])
    assert any("answer with the trained agents" in s for s in said)


# ----------------------------------------------------------------------------- SFT on the rule policy's turns
@pytest.mark.slow
def test_sft_on_the_rule_weavers_trajectories_lowers_the_loss(world, tmp_path, m1_cache):
    from m1.marl.sft import SFTTrainer, build_sft_data
    from m1.team.engines_registry import make_team

    d, path, qs = world
    teacher = make_team(load_team("weaver_synth", NO_CLIP + ["seed_system.glance_frames=8"]))
    examples, stats = build_sft_data(teacher, qs, RewardConfig())  # phases at their default: every turn
    assert stats["kept_episodes"] >= len(qs) // 2 and stats["kept"] == len(examples)
    assert stats["kept_episodes"] + stats["episodes_wrong"] + stats["episodes_failed"] == len(qs)
    assert {e.phase for e in examples} == {"act", "answer"}
    act = next(e for e in examples if e.phase == "act")
    assert "<tool_call>" in act.completion
    later = [e for e in examples if sum(m["role"] == "assistant" for m in e.messages) >= 1]
    assert later and all(e.messages[-1]["role"] == "user" for e in later)  # observation turns are prompt
    cfg = SFTConfig.model_validate({
        "team": weaver_team(), "data": {"examples": str(tmp_path / "examples.jsonl")},
        "learner": {"finetune": "full", "lr": 1e-2, "micro_batch_size": 8, "max_prompt_tokens": 4096,
                    "max_completion_tokens": 64, "max_grad_norm": None},
        "batch_size": 8, "max_steps": 8, "out_dir": str(tmp_path / "sft"), "checkpoint": {"every": 8},
        "log": {"progress": False, "backends": []}})
    tr = SFTTrainer(cfg, examples=examples)
    try:
        rows = tr.train()
    finally:
        tr.close()
    losses = [r["loss"] for r in rows]
    assert len(losses) == 8 and sum(losses[-2:]) / 2 < 0.7 * sum(losses[:2]) / 2, losses


@pytest.mark.slow
def test_seed_kinds_tokenizer_halves_a_weaver_turn(m1_cache, monkeypatch):
    """`corpus: seed_kinds` adds the rule-based seed kinds' chats to the synth corpus: a Weaver tool call (its JSON) and
    the described glance cost fewer tokens than with the CPP team's tokenizer, and decode back exactly. Its models
    get their own cache folders, which follow that corpus's version."""
    from transformers import AutoTokenizer

    from m1.config import TinySpec
    from m1.models import tiny

    turn = ('Step 1: the question needs a closer look, so I find when the purple cross is on screen.\n'
            '<tool_call>{"tool_name": "temporal_grounding", "query": "the purple cross"}</tool_call>')
    frames = "<frame 3 at 18.8s>[a small purple cross at the top left]<frame 4 at 26.2s>[only the background]"
    spec = TinySpec(arch="qwen3", hidden_size=32, layers=1, heads=2, kv_heads=1, corpus="seed_kinds")
    synth = spec.model_copy(update={"corpus": "synth"})
    new, old = (AutoTokenizer.from_pretrained(tiny.ensure_tiny(s)) for s in (spec, synth))
    for text, gain in ((turn, 1.6), (frames, 1.15)):  # measured: 43 vs 69 and 34 vs 42 tokens
        n_new, n_old = len(new(text)["input_ids"]), len(old(text)["input_ids"])
        assert n_new * gain < n_old, (text, n_new, n_old)
        assert new.decode(new(text)["input_ids"]) == text
    before = tiny.spec_hash(spec), tiny.spec_hash(synth)
    monkeypatch.setitem(tiny.CORPUS_VERSIONS, "seed_kinds", tiny.CORPUS_VERSIONS["seed_kinds"] + 1)
    assert tiny.spec_hash(spec) != before[0] and tiny.spec_hash(synth) == before[1]
