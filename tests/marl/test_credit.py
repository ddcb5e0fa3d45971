"""Credit strategies (m1/marl/algo/credit.py): each rule's own checks, dynamic sampling, the step's DAG, plan entropy.

Dynamic sampling: tied groups leave the step and the data cursor refills it (and a killed run resumes to the same
losses). The step's DAG is drawn from (seed, step) alone; a team of one runs on the complete graph. Plan entropy per
family is the entropy of the parsed tool sequences. The credit rules' effects on samples are tested with the
trainer (tests/marl/test_trainer.py: episode, phase, greedy baseline; tests/marl/test_agent_credit.py: agent), and every
strategy's losses are pinned by tests/marl/test_trainer_regression.py.
"""
import math
import random
import re
from collections import Counter
from types import SimpleNamespace

import pytest

from m1.marl.config import TrainConfig
from m1.marl.algo.advantages import ESTIMATORS
from m1.marl.algo.credit import CREDITS, informative_groups, merge_batches
from m1.marl.rollout.episodes import RolloutBatch, derive_seed, sample_topology, step_topology
from m1.marl.team_training import entropy, plan_entropy, revision_rate
from m1.schema import Question
from m1.team import topology as topo
from tests.marl.test_trainer import AGENTS, COMPARED, make_trainer, team_dict, train_cfg

NEW = ("dynamic_sampling", "max_refill")


# ------------------------------------------------------------------------------------------------ config
def test_dynamic_sampling_is_recorded_only_when_set(tmp_path):
    recorded = train_cfg(tmp_path).recorded()["rollout"]
    assert not set(NEW) & set(recorded)  # at their defaults: not part of a run's recorded identity
    on = train_cfg(tmp_path, rollout={"dynamic_sampling": True, "max_refill": 1}).recorded()
    assert {k: on["rollout"][k] for k in NEW} == {"dynamic_sampling": True, "max_refill": 1}


def test_registries_name_every_choice_the_config_offers():
    rollout = TrainConfig.model_fields["rollout"].annotation
    for name in CREDITS:  # the config accepts every registered rule, and names them all when refusing another
        assert rollout.model_validate({"credit": name}).credit == name
    with pytest.raises(ValueError, match=re.escape(f"rollout.credit: unknown rule 'team' (known: {list(CREDITS)})")):
        rollout.model_validate({"credit": "team"})
    grpo = TrainConfig.model_fields["grpo"].annotation
    for name in ESTIMATORS:
        assert grpo.model_validate({"baseline": name}).baseline == name
    assert set(ESTIMATORS) == {"group", "greedy", "rloo", "reinforce_pp", "gigpo"}
    with pytest.raises(ValueError, match=re.escape(f"unknown baseline 'mean'; registered: {sorted(ESTIMATORS)}")):
        grpo.model_validate({"baseline": "mean"})


@pytest.mark.parametrize("over, words", [
    ({"rollout": {"dynamic_sampling": True}, "grpo": {"baseline": "greedy", "scale_rewards": False}}, "greedy"),
    ({"grpo": {"baseline": "greedy"}}, "scale_rewards: false"),
    ({"rollout": {"answer_samples": 2}}, "answer_samples"),  # not an option: refused as an unknown key
    ({"rollout": {"plan_temperature": 1.0}}, "plan_temperature"),
    ({"average": {"checkpoints": 2}}, "average"),
])
def test_conflicting_or_removed_options_are_refused_with_the_reason(tmp_path, over, words):
    with pytest.raises(ValueError, match=words):
        train_cfg(tmp_path, **over)


# ------------------------------------------------------------------------------------------------ topology
def rollout(**kw):
    return TrainConfig.model_validate({"team": team_dict(), "rollout": kw}).rollout


def test_step_topology_is_drawn_from_seed_and_step_and_complete_for_a_team_of_one():
    names = ["a", "b", "c", "d"]
    cfg = rollout(edge_prob=0.3, dropout=0.4)
    for step in range(20):
        want = sample_topology(names, "random", 0.3, 0.4, random.Random(derive_seed(3, step, "topology")))
        assert step_topology(names, cfg, 3, step) == want == step_topology(names, cfg, 3, step)
    assert len({(tuple(t.active), tuple(t.edges)) for t in (step_topology(names, cfg, 3, s) for s in range(20))}) > 1
    assert step_topology(names, cfg, 3, 5, complete=True) == topo.complete(names)  # a seed-kind team of one
    assert step_topology(names, rollout(topology="complete"), 3, 5) == topo.complete(names)


# ------------------------------------------------------------------------------------------------ plan entropy
def test_plan_entropy_per_family_is_the_entropy_of_the_parsed_tool_sequences():
    def ep(family, *plans):
        q = Question(id="q", video="v.mp4", text="?", task="open", meta={"family": family} if family else {})
        gens = [SimpleNamespace(phase="plan", agent=a, completion=f"##key info: x ##tool use: <Global Sampling>, "
                                                                  f"<{tool}>") for a, tool in plans]
        gens.append(SimpleNamespace(phase="answer", agent="alpha", completion="##Answer: A"))
        return SimpleNamespace(question=q, generations=gens)

    tools = ["Global Sampling", "Rough Browser", "Space Tool", "Fine Browser"]
    batch = SimpleNamespace(flat=[ep("count", ("alpha", "Rough Browser"), ("beta", "Space Tool")),
                                  ep("count", ("alpha", "Rough Browser"), ("beta", "Fine Browser")),
                                  ep("order", ("alpha", "Space Tool"), ("beta", "Space Tool")),
                                  ep(None, ("alpha", "Space Tool"), ("gamma", "Rough Browser"))])
    row = plan_entropy([batch], ["alpha", "beta"], tools)  # gamma is not trained: its plans are not counted
    counted = entropy(Counter({"rb": 2, "st": 1, "fb": 1}))
    assert row["plans/entropy/count"] == pytest.approx(counted) == pytest.approx(1.5 * math.log(2))
    assert row["plans/entropy/order"] == 0.0  # every plan the same
    assert row["plans/entropy/open"] == 0.0  # no synth family: the task names it
    assert row["plans/entropy"] == pytest.approx(counted / 3)


def test_revision_rate_per_family_counts_the_trained_agents_add_tool_decisions():
    def ep(family, *replies):
        q = Question(id="q", video="v.mp4", text="?", task="mcq", meta={"family": family})
        gens = [SimpleNamespace(phase="communicate", agent=a, completion=text) for a, text in replies]
        gens.append(SimpleNamespace(phase="plan", agent="alpha", completion="##tool call: add tool <Fine Browser>"))
        return SimpleNamespace(question=q, generations=gens)

    add = "##tool call: add tool <Fine Browser>\n##key info: the red cross"
    keep = "##tool call: continue()"
    tools = ["Global Sampling", "Rough Browser", "Fine Browser"]
    batch = SimpleNamespace(flat=[ep("order", ("alpha", add), ("beta", keep), ("gamma", add)),
                                  ep("order", ("alpha", keep), ("beta", "no idea")),
                                  ep("count", ("alpha", keep), ("beta", keep))])
    row = revision_rate([batch], ["alpha", "beta"], tools)  # gamma is not trained; a plan reply is not a decision
    assert row == {"revisions/rate/order": 0.25, "revisions/rate/count": 0.0, "revisions/rate": 1 / 6}
    assert revision_rate([batch], ["alpha"], ["Global Sampling", "Rough Browser"]) == {  # a tool the run lacks: not added
        "revisions/rate/order": 0.0, "revisions/rate/count": 0.0, "revisions/rate": 0.0}
    assert revision_rate([SimpleNamespace(flat=[])], ["alpha"], tools) == {}


# ------------------------------------------------------------------------------------------------ dynamic sampling
def test_informative_groups_and_merge_keep_the_chosen_questions_in_order():
    nan = float("nan")
    rewards = {"a": [[1.0, 1.0], [0.0, 1.0], [nan, nan], [2.0, nan]],
               "b": [[0.5, 0.5], [1.0, 1.0], [1.0, 1.0], [1.0, 1.0]]}
    assert informative_groups(rewards) == {"a": [False, True, None, False], "b": [False] * 4}
    outcomes = {"a": [[0.0, 1.0]] * 4, "b": [[0.0, 0.0]] * 4}
    assert informative_groups(rewards, outcomes)["a"] == [True, True, None, True]  # credit phase: outcomes count

    def batch(tag, g):
        qs = [Question(id=f"{tag}{i}", video="v", text="?") for i in range(g)]
        return RolloutBatch(questions=qs, episodes=[[f"{tag}{i}/0", f"{tag}{i}/1"] for i in range(g)],
                            topology=topo.complete(["a"]), rewards={"a": [[i, -i] for i in range(g)]},
                            breakdowns=[f"{tag}{i}/{k}" for i in range(g) for k in range(2)], focus=["a"] * g)

    merged = merge_batches([(batch("x", 3), [0, 2]), (batch("y", 2), [1])])
    assert [q.id for q in merged.questions] == ["x0", "x2", "y1"]
    assert merged.episodes == [["x0/0", "x0/1"], ["x2/0", "x2/1"], ["y1/0", "y1/1"]]
    assert merged.breakdowns == [e for row in merged.episodes for e in row]
    assert merged.rewards == {"a": [[0, 0], [2, -2], [1, -1]]} and merged.focus == ["a"] * 3


def tie_some(episodes):
    """Rewards that differ between rollouts (the episode's index in the call), except that every agent ties on q1
    and alpha alone ties on q0."""
    out = []
    for i, e in enumerate(episodes):
        qid = e.question.id
        out.append({"alpha": 0.0 if qid in ("q0", "q1") else float(i), "beta": 0.0 if qid == "q1" else float(i)})
    return out


def spy(tr):
    seen = []
    update = tr.learners.update
    tr.learners.update = lambda samples, lr, family: seen.append(samples) or update(samples, lr, family)
    return seen


@pytest.mark.slow
def test_dynamic_sampling_drops_tied_groups_and_refills_from_the_data_cursor(tmp_path, video, m1_cache):
    rounds = []  # the questions of each round of rollouts, as the reward function saw them (K=2 episodes each)

    def reward(episodes):
        rounds.append([e.question.id for e in episodes[::2]])
        return tie_some(episodes)

    tr = make_trainer(train_cfg(tmp_path / "run", steps=3, rollout={"dynamic_sampling": True}), video,
                      reward_fn=reward)
    seen = spy(tr)
    rows = tr.train()
    assert tr.data.cursor == sum(len(r) for r in rounds) > 6  # q1 was drawn (3 questions, 6+ handed out): refilled
    tied = {"q0": 1, "q1": 2, "q2": 0}  # groups that tie per question, of its 2 (one per agent)
    left = list(rounds)
    for row, samples in zip(rows, seen):
        n = row["groups/refill_rounds"] + 1
        mine, left = left[:n], left[n:]
        assert mine[0] and all(len(r) <= 2 for r in mine)
        drawn = [q for r in mine for q in r]
        assert row["groups/dropped_share"] == pytest.approx(sum(tied[q] for q in drawn) / (2 * len(drawn)))
        assert row["groups/kept"] == 2 == sum(q != "q1" for q in drawn)  # refilled to questions_per_step
        ids = {a: [s.question_id for s in samples[a] if s.phase == "answer"] for a in AGENTS}
        assert "q1" not in ids["alpha"] + ids["beta"]  # every group tied: the question left the step
        assert "q0" not in ids["alpha"]  # alpha alone tied on q0: only its group left
        assert sorted(set(ids["beta"])) == sorted({q for q in drawn if q != "q1"})
    assert not left


def test_dynamic_sampling_stops_after_max_refill_when_every_group_ties(tmp_path, video, m1_cache):
    import torch

    tr = make_trainer(train_cfg(tmp_path / "run", rollout={"dynamic_sampling": True, "max_refill": 1}), video,
                      reward_fn=lambda eps: [{a: 1.0 for a in AGENTS} for _ in eps])
    before = {a: tr.learners.parameters(a) for a in AGENTS}
    row = tr.train()[0]
    assert row["groups/refill_rounds"] == 1 and row["groups/kept"] == 0 and row["groups/dropped_share"] == 1.0
    assert tr.data.cursor == 4  # 2 questions, then 2 more in the one refill round
    for a in AGENTS:
        assert row[f"{a}/samples"] == 0
        after = tr.learners.parameters(a)
        assert all(torch.equal(after[n], before[a][n]) for n in after)  # nothing to learn from: no update


@pytest.mark.slow
def test_dynamic_sampling_resumes_to_the_uninterrupted_losses(tmp_path, video, m1_cache):
    kw = dict(finetune="lora", steps=3, checkpoint={"every": 1}, rollout={"dynamic_sampling": True})
    full = make_trainer(train_cfg(tmp_path / "a", **kw), video, reward_fn=tie_some).train()
    killed = make_trainer(train_cfg(tmp_path / "b", **kw), video, reward_fn=tie_some)
    first = killed.train(stop_after=2)
    cursor = killed.data.cursor
    del killed
    resumed = make_trainer(train_cfg(tmp_path / "b", **kw), video, reward_fn=tie_some)
    assert resumed.step == 2 and resumed.data.cursor == cursor  # the refills' questions are in the checkpoint
    second = resumed.train()
    keys = COMPARED + ["groups/dropped_share", "groups/refill_rounds", "groups/kept"]
    for want, got in zip(full, first + second):
        for key in keys:
            assert got[key] == want[key], f"step {want['step']} {key}: {got[key]!r} != {want[key]!r}"
    assert sum(r["groups/refill_rounds"] for r in full) >= 1  # the resumed step ran a refill too


# ------------------------------------------------------------------------------------------------ dev split
def test_recipe_experiments_choose_on_a_dev_world_and_report_on_the_held_out_one():
    from m1.experiment.config import load_experiment
    from m1.marl.config import load_train_config

    final, dev = load_experiment("mini_recipe"), load_experiment("mini_recipe_dev")
    worlds = {w.out: w for w in dev.data.worlds}
    assert final.data.worlds == dev.data.worlds
    assert final.eval.video_dir == "runs/mini/test" and worlds["runs/mini/test"].seed == 1001
    assert dev.eval.video_dir == "runs/mini/dev" and dev.eval.questions == "runs/mini/dev/questions.jsonl"
    d = worlds["runs/mini/dev"]
    assert d.videos * d.questions_per_video >= 300 and d.seed not in (1, 5, 1001)
    trained_on = " ".join(dev.marl.overrides) + " runs/mini/train"  # the SFT stage's world (configs/sft/mini.yaml)
    assert "runs/mini/dev" not in trained_on and "runs/mini/test" not in trained_on
    # six held-out seeds from two SFT runs (seeds 0 and 3, three MARL seeds each); dev screens on those two SFT seeds
    assert final.seeds == [0, 1, 2, 3, 4, 5] and set(dev.seeds) <= set(final.seeds)
    assert dev.sft_share == final.sft_share == 3 and {s - s % 3 for s in final.seeds} == set(dev.seeds)
    assert dev.base_arm == final.base_arm == "sft"
    for arm in dev.arms:  # every candidate arm's MARL config is valid
        if "marl" in dev.arm_stages(arm):
            cfg = load_train_config(dev.marl.config, dev.marl.overrides + dev.arm(arm).marl)
            assert cfg.name == "mini_recipe_marl"
    # one set of trained stages: dev answers into eval_dev, the held-out file into eval, with the same arms' stages
    assert dev.out_dir == final.out_dir and (dev.eval.folder, final.eval.folder) == ("eval_dev", "eval")
    for arm in final.arms:
        assert arm in dev.arms and final.arm(arm).marl == dev.arm(arm).marl
        assert dev.stage_dir(arm, 0, "eval") != final.stage_dir(arm, 0, "eval")
        if "marl" in final.arm_stages(arm):
            assert dev.stage_dir(arm, 0, "marl") == final.stage_dir(arm, 0, "marl")
