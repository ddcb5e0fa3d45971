"""Prompt budgets (m1/team/budget.py): no prompt is cut from the front any more.

Checks: over budget, the peers' notes are trimmed oldest first and the prompt says so, while the system prompt, the
question and its options always stay; a prompt that still does not fit is an error naming the agent and phase, or a
configured drop of that question; the learner and the rollout engine refuse an over-long prompt instead of keeping its
end; a team budget over the learner's cap is refused; the trainer logs the share of trimmed prompts; and the shipped
videochat_m1 budgets cover the p99 prompt length of every phase measured on M1-Synth episodes of the teacher team.
"""
from types import SimpleNamespace

import numpy as np
import pytest

from tests.conftest import make_synth_world
from m1.agents.prompts import render_question
from m1.config import load_team
from m1.memory import SharedMemory
from m1.schema import Plan, Turn
from m1.team import budget
from m1.team.engines_registry import make_team

NO_CLIP = ["models.clip.clip_name=null", "models.clip.tiny={arch: open_clip}"]  # the world's CLIP takes minutes
MARK = "left out to fit the prompt budget"
CLOSING = {"plan": "##tool use: <", "communicate": "##key info: <what the added tool", "answer": "##Reason: <one or two",
           "summary": "##Reason Summary: <"}  # the closing instruction of each phase's prompt survives


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """Four M1-Synth questions over two 2-minute videos."""
    return make_synth_world(tmp_path_factory.mktemp("synth"), videos=2, seed=5, duration=120, questions_per_video=2)


def _teacher(*overrides):
    return make_team(load_team("synth_teacher", NO_CLIP + ["limits.max_turns=5", *overrides]))


def test_prompt_budget_view_leaves_out_the_oldest_peer_turns_first():
    mem = SharedMemory(["me", "a", "b"])
    for name in ("a", "b"):
        mem.set_plan(name, Plan(key_info=f"key of {name}", tools=["Global Sampling", "Rough Browser"]))
        for step in (1, 2):
            mem.add_turn(name, Turn(step=step, tool="Rough Browser", key_info="k", output=f"{name} saw thing {step}"))
    assert mem.peer_turns("me", ["a", "b"]) == 4
    full = mem.view("me", ["a", "b"])
    assert MARK not in full and all(f"{n} saw thing {s}" in full for n in "ab" for s in (1, 2))
    two = mem.view("me", ["a", "b"], leave_out=2)  # both step-1 turns go before any step-2 turn
    assert "2 oldest tool output(s) of other agents left out to fit the prompt budget" in two
    assert "a saw thing 1" not in two and "b saw thing 1" not in two
    assert "a saw thing 2" in two and "b saw thing 2" in two and "key of a" in two  # plans and key info stay
    three = mem.view("me", ["a", "b"], leave_out=3)
    assert "a saw thing 2" not in three and "b saw thing 2" in three
    gone = mem.view("me", ["a", "b"], leave_out=5)  # past every turn: the peers' notes go whole
    assert "key of a" not in gone and "all notes of the 2 other agent(s)" in gone


def test_prompt_budget_fit_trims_the_fewest_entries():
    sizes = {0: 120, 1: 110, 2: 100, 3: 95, 4: 60, 5: 40}
    build = lambda k: [{"role": "user", "content": str(k)}]  # noqa: E731
    count = lambda msgs: sizes[int(msgs[0]["content"])]  # noqa: E731
    assert budget.fit(build, 4, count, 200)[1:] == (0, 120)
    assert budget.fit(build, 4, count, 100)[1:] == (2, 100)
    assert budget.fit(build, 4, count, 59)[1:] == (5, 40)  # all 4 entries and then the notes as a whole
    assert budget.fit(build, 4, count, 30)[1:] == (5, 40)  # nothing fits: the caller refuses
    assert budget.fit(build, -1, count, 30)[1:] == (0, 120)  # nothing to trim


def test_prompt_budget_trims_peers_notes_and_keeps_the_head(world):
    from m1.results import result_row

    _, _, qs = world
    limit = 1500  # the longest prompts of these episodes are ~2,500 tokens; own notes alone reach ~1,100
    eps = _teacher(f"limits.max_prompt_tokens={limit}").run(qs)
    assert all(e.error is None for e in eps)
    gens = [g for e in eps for g in e.generations]
    assert all(budget.estimate_tokens(g.prompt) <= limit for g in gens)
    trimmed = [g for g in gens if g.trimmed]
    assert trimmed and {g.phase for g in trimmed} <= {"communicate", "answer"}
    by_id = {e.id: e for e in eps}
    for e in eps:
        head = render_question(e.question)
        for g in e.generations:  # the system prompt, the question and its options are never cut
            assert g.prompt[0]["role"] == "system" and len(g.prompt[0]["content"]) > 100
            assert head in g.prompt[-1]["content"]
            assert (MARK in g.prompt[-1]["content"]) == (g.trimmed > 0)
            assert g.prompt[-1]["content"].rstrip().splitlines()[-1].startswith(CLOSING[g.phase])
    rows = [result_row(by_id[i]) for i in by_id]
    assert sum(r.get("prompts_trimmed", {}).get("prompts", 0) for r in rows) == len(trimmed)


def test_prompt_budget_over_budget_is_an_error_or_a_configured_drop(world):
    _, _, qs = world
    with pytest.raises(budget.PromptBudgetError, match=r"agent 'teacher_a', phase plan, question .*over "
                                                       r"limits.max_prompt_tokens=300"):
        _teacher("limits.max_prompt_tokens=300").run(qs[:2])
    eps = _teacher("limits.max_prompt_tokens=300", "limits.over_budget=drop").run(qs[:2])
    assert all(e.error.startswith("dropped: agent 'teacher_a', phase plan") for e in eps)
    assert all(e.final_answer is None and not e.generations for e in eps)
    # a budget that holds the plans but not the shortest answer prompt drops at the answer phase, not before
    eps = _teacher("limits.max_prompt_tokens=700", "limits.over_budget=drop").run(qs[:2])
    assert all("phase communicate" in e.error or "phase answer" in e.error for e in eps)
    assert all(any(g.phase == "plan" for g in e.generations) for e in eps)


def test_prompt_budget_learner_refuses_a_long_prompt_instead_of_cutting_its_head():
    from m1.marl.config import LearnerConfig
    from m1.marl.rollout.episodes import Sample
    from m1.marl.actor.scorer import Scorer

    me = SimpleNamespace(agent="alpha", vl=False, cfg=LearnerConfig(max_prompt_tokens=8, max_completion_tokens=3))
    short = Sample(agent="alpha", question_id="q1", group=0, rollout=0, phase="answer", prompt_ids=list(range(8)),
                   completion_ids=[1, 2, 3, 4], logprobs=None, reward=0.0, advantage=0.0)
    assert Scorer.rows(me, [short]) == [(list(range(8)), [1, 2, 3])]
    long = Sample(**{**short.__dict__, "prompt_ids": list(range(9)), "question_id": "q2", "phase": "communicate"})
    with pytest.raises(ValueError, match=r"agent 'alpha': a prompt of 9 tokens \(question 'q2', communicate\) "
                                         r"exceeds learner.max_prompt_tokens=8"):
        Scorer.rows(me, [short, long])


def test_prompt_budget_count_learner_check_and_model_tokenize_a_prompt_once(monkeypatch):
    """The team's budget count, the learner's length check and its model all need a prompt's token ids: they tokenize
    it once between them (a memo keyed by the rendered text, m1/models/base.py `prompt_ids`), with the same counts
    and samples as tokenizing it at every stage (the memo held at 0 tokens)."""
    from m1.config import ModelSpec
    from m1.marl.config import GRPOSettings, LearnerConfig
    from m1.marl.actor.learner import AgentLearner
    from m1.models import base

    spec = {"interface": "chat", "device": "cpu",
            "tiny": {"arch": "qwen2", "hidden_size": 64, "layers": 1, "heads": 2, "kv_heads": 1, "seed": 1}}
    learner = AgentLearner.build("a", "m", ModelSpec.model_validate(spec),
                                 LearnerConfig(max_prompt_tokens=512, max_completion_tokens=6), GRPOSettings(beta=0.0))
    calls = []
    tokenize = type(learner.actor.tokenizer).__call__

    def counted(self, text, *a, **kw):
        calls.append(text)
        return tokenize(self, text, *a, **kw)

    monkeypatch.setattr(type(learner.actor.tokenizer), "__call__", counted)
    chats = [[{"role": "system", "content": "You answer questions about a video."},
              {"role": "user", "content": f"Question {i}: where is the red square? " * (i + 1)}] for i in range(3)]
    count = budget.token_counter(learner.sampler)
    params = base.SamplingParams(max_new_tokens=6, temperature=0.7, seed=3)

    def step():
        calls.clear()
        sizes = [count(m) for m in chats]
        out = learner.sampler.generate([base.ChatRequest(m) for m in chats], params)
        return sizes, [(o.prompt_ids, o.completion_ids, o.text) for o in out], len(calls), [o.logprobs for o in out]

    monkeypatch.setattr(base, "PROMPT_MEMO_TOKENS", 0)
    sizes, want, before, logprobs = step()
    assert before == 3 * len(chats) and sizes == [len(w[0]) for w in want]
    monkeypatch.setattr(base, "PROMPT_MEMO_TOKENS", 1 << 20)
    for expected_calls in (len(chats), 0):  # then the same prompts again: all remembered
        *same, again = step()
        assert same == [sizes, want, expected_calls]
        # the sampler's prefix cache (m1/models/sampler.py) reuses the first call's keys: equal within float noise
        np.testing.assert_allclose(np.concatenate(again), np.concatenate(logprobs), atol=1e-5)


def test_prompt_budget_team_budget_may_not_exceed_the_learners(tmp_path):
    from m1.marl.config import TrainConfig

    data = {"team": "synth_teacher", "judge": {"method": "rubric"}, "out_dir": str(tmp_path),
            "learner": {"max_prompt_tokens": 2048}}
    TrainConfig.model_validate({**data, "team_overrides": ["limits.max_prompt_tokens=2048"]})
    with pytest.raises(ValueError, match=r"limits.max_prompt_tokens=4096 exceeds learner.max_prompt_tokens=2048"):
        TrainConfig.model_validate({**data, "team_overrides": ["limits.max_prompt_tokens=4096"]})


def test_prompt_budget_trainer_logs_the_share_of_trimmed_prompts():
    import math

    from m1.marl.trainer import Trainer
    from m1.schema import Episode, Generation, Question, Topology

    q = Question(id="q", video="v.mp4", text="What colour?", options=["red", "blue"], answer="A")
    gens = [Generation(agent="a", phase=p, prompt=[], completion="", trimmed=t)
            for p, t in (("plan", 0), ("communicate", 2), ("answer", 1), ("answer", 0))]
    top = Topology(agents=["a"], active=["a"], edges=[])
    ok = Episode(id="q", question=q, topology=top, memory={}, generations=gens)
    dropped = Episode(id="q", question=q, topology=top, memory={}, error="dropped: agent 'a', phase plan ...")
    import torch

    from m1.marl.algo.credit import StepCredit
    from m1.marl.team_training import CppKind

    batch = SimpleNamespace(flat=[ok, dropped], breakdowns=[], rewards={"a": [[1.0, math.nan]]})
    me = SimpleNamespace(step=1, lr_at=lambda s: 0.0, kind=CppKind(), trained=["a"],
                         team_cfg=SimpleNamespace(tools=SimpleNamespace(enabled=[])))
    credit = StepCredit(batch, {"a": torch.zeros(1, 2)}, None, rounds=[])
    row = Trainer._metrics(me, credit, {}, top, {}, 0)
    assert row["prompts/trimmed"] == 0.5 and row["prompts/dropped"] == 1


def test_prompt_budget_shipped_budgets_cover_measured_p99(world):
    """The videochat_m1 budget against the prompts the paper's team would read: the teacher team on M1-Synth with
    the paper's limits (5 turns, complete topology), each prompt counted with Qwen's vocabulary shape
    (`estimate_tokens`, calibrated on that vocabulary). The MARL and SFT learners must take the budget whole."""
    from m1.marl.config import load_sft_config, load_train_config

    _, _, qs = world
    paper = load_team("videochat_m1")
    eps = _teacher(f"limits.max_turns={paper.limits.max_turns}", f"limits.max_tool_calls={paper.limits.max_tool_calls}"
                   ).run(qs)
    lengths: dict[str, list[int]] = {}
    for e in eps:
        for g in e.generations:
            lengths.setdefault(g.phase, []).append(budget.estimate_tokens(g.prompt))
    assert set(lengths) >= {"plan", "communicate", "answer"}
    limit = paper.limits.max_prompt_tokens
    for phase, xs in lengths.items():
        xs = sorted(xs)
        p99 = xs[min(len(xs) - 1, round(0.99 * (len(xs) - 1)))]
        assert p99 <= limit, f"{phase}: p99 prompt {p99} tokens over the shipped budget {limit}"
    assert max(lengths["communicate"]) > 1024  # a budget of 1,024 would cut these
    for name in ("videochat_m1_full", "videochat_m1_lora"):
        assert load_train_config(name).learner.max_prompt_tokens >= limit
        assert load_sft_config(name).learner.max_prompt_tokens >= limit
