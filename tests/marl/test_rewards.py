"""Rewards (R_res, R_format, R_col), the LLM judge (batching, parsing, cache, rate limit) and the
offline rubric judge, on hand-built episodes."""
from __future__ import annotations

import json
import logging

import pytest
from tests.fakes import FakeChat, content

from m1.marl.reward.judge import CorrectItem, JudgeItem, Verdict
from m1.marl.reward.llm_judge import LLMJudge, RateLimiter, collaboration_messages, parse_verdict
from m1.marl.reward.rewards import (
    RewardConfig, agent_rewards, batch_agent_rewards, collaboration_reward, format_reward,
    log_breakdowns, result_reward, summarize, tool_penalty,
)
from m1.marl.reward.rubric_judge import RUBRIC_JUDGE_NAME, RubricJudge, question_cues
from m1.models.base import ModelError
from m1.schema import AgentAnswer, AgentRecord, Decision, Episode, Generation, Question, Topology, Turn

MCQ = Question(id="q-mcq", video="v.mp4", text="What colour is the ball?",
               options=["red", "blue", "green", "white"], task="mcq", answer="B")
GROUND = Question(id="q-gr", video="v.mp4", text="When does the red square appear?", task="grounding",
                  answer="[10 - 20]")
NUMERIC = Question(id="q-num", video="v.mp4", text="How many flashes are there?", task="numeric", answer="10")
OPEN = Question(id="q-open", video="v.mp4", text="What does the man hold?", task="open", answer="A red ball.")


def turn(step, tool, output="saw things", key_info="the ball", answer=None, error=None, decision="continue",
         add=None):
    d = None if decision is None else Decision(action=decision, tool=add)
    return Turn(step=step, tool=tool, key_info=key_info, output=output, answer=answer, error=error, decision=d)


def good_record(answer="B"):
    return AgentRecord(plan=["Global Sampling", "Rough Browser"], key_info="the ball",
                       turns=[turn(1, "Global Sampling", "16 frames over the video"),
                              turn(2, "Rough Browser", "a blue ball rolls", answer=answer)],
                       answer=answer, reason="the browser saw it")


def gen(agent, ok=True, phase="plan"):
    return Generation(agent=agent, phase=phase, prompt=[{"role": "user", "content": "x"}], completion="y",
                      parse_ok=ok, parse_error=None if ok else "bad format")


def episode(question=MCQ, records=None, answers=None, gens=None, final="B", eid="ep1"):
    records = records if records is not None else {"a1": good_record(), "a2": good_record("C")}
    answers = answers if answers is not None else {a: r.answer for a, r in records.items()}
    gens = gens if gens is not None else {a: [True, True] for a in records}
    agents = list(records)
    return Episode(id=eid, question=question, topology=Topology(agents=agents, active=agents, edges=[]),
                   memory=records,
                   generations=[gen(a, ok, "plan" if i == 0 else "answer") for a, oks in gens.items()
                                for i, ok in enumerate(oks)],
                   answers=[AgentAnswer(agent=a, answer=x) for a, x in answers.items() if x is not None],
                   final_answer=final)


class ConstJudge:
    """A judge that gives every trajectory the same verdict and counts calls."""

    def __init__(self, value=1, name="const-judge"):
        self.value, self.name, self.calls, self.items = value, name, 0, []

    def judge(self, items):
        self.calls += 1
        self.items += items
        return [Verdict(value=self.value, judge=self.name) for _ in items]

    def correct(self, items):
        return [Verdict(value=self.value, judge=self.name) for _ in items]


# ----------------------------------------------------------------------------- R_res
def test_mcq_result_reward_right_and_wrong():
    assert result_reward(MCQ, "B") == 1.0
    assert result_reward(MCQ, "(B) blue") == 1.0
    assert result_reward(MCQ, "blue") == 1.0  # the option's own text
    assert result_reward(MCQ, "C") == -1.0
    assert result_reward(MCQ, "") == -1.0
    assert result_reward(MCQ, None) == -1.0
    with pytest.raises(ValueError, match="q-mcq"):
        result_reward(MCQ.model_copy(update={"answer": None}), "B")
    with pytest.raises(ValueError, match="not one of"):
        result_reward(MCQ.model_copy(update={"answer": "Z"}), "B")


def test_grounding_reward_iou_mapping():
    # [15 - 25] vs [10 - 20]: intersection 5, union 15, IoU 1/3 -> 2/3 - 1 = -1/3
    assert result_reward(GROUND, "[15 - 25]") == pytest.approx(-1 / 3)
    # [12 - 18] inside [10 - 20]: IoU 6/10 -> 0.2
    assert result_reward(GROUND, "[12 - 18]") == pytest.approx(0.2)
    assert result_reward(GROUND, "[10 - 20]") == pytest.approx(1.0)
    assert result_reward(GROUND, "[30 - 40]") == pytest.approx(-1.0)
    assert result_reward(GROUND, "I am not sure") == -1.0
    assert result_reward(GROUND, None) == -1.0
    thr = RewardConfig(grounding="threshold", grounding_threshold=0.3)
    assert result_reward(GROUND, "[15 - 25]", cfg=thr) == 1.0  # 1/3 >= 0.3
    assert result_reward(GROUND, "[15 - 25]", cfg=thr.model_copy(update={"grounding_threshold": 0.5})) == -1.0
    with pytest.raises(ValueError, match="q-gr"):
        result_reward(GROUND.model_copy(update={"answer": "soon"}), "[1 - 2]")


def test_numeric_reward_relative_accuracy():
    assert result_reward(NUMERIC, "10") == pytest.approx(1.0)
    # 11.2 vs 10: relative error 0.12 passes thresholds 0.50..0.85 (8 of 10): MRA 0.8 -> 0.6
    assert result_reward(NUMERIC, "11.2") == pytest.approx(0.6)
    assert result_reward(NUMERIC, "about 11.2 times") == pytest.approx(0.6)
    assert result_reward(NUMERIC, "ten") == pytest.approx(1.0)
    assert result_reward(NUMERIC, "40") == pytest.approx(-1.0)
    assert result_reward(NUMERIC, "no idea") == -1.0
    thr = RewardConfig(numeric="threshold", numeric_threshold=0.9)
    assert result_reward(NUMERIC, "11.2", cfg=thr) == -1.0
    assert result_reward(NUMERIC, "11.2", cfg=thr.model_copy(update={"numeric_threshold": 0.8})) == 1.0
    zero = NUMERIC.model_copy(update={"answer": "0"})
    assert result_reward(zero, "0") == 1.0 and result_reward(zero, "1") == -1.0


def test_open_reward_exact_match_or_judge():
    assert result_reward(OPEN, "a red ball") == 1.0
    assert result_reward(OPEN, "a blue ball") == -1.0
    assert result_reward(OPEN, "") == -1.0
    chat = FakeChat("gpt-judge", lambda m: "##Verdict: 1\n##Reason: same object")
    judge = LLMJudge(chat)
    assert result_reward(OPEN, "the man holds a red ball", judge=judge) == 1.0
    assert chat.calls == 1
    prompt = content(chat.batches[0][0])
    assert "A red ball." in prompt and "the man holds a red ball" in prompt
    no = LLMJudge(FakeChat("gpt-judge", lambda m: "##Verdict: 0\n##Reason: different"))
    assert result_reward(OPEN, "a red ball", judge=no) == -1.0
    assert RubricJudge().correct([CorrectItem(OPEN, "A red ball")])[0].value == 1


# ----------------------------------------------------------------------------- R_format, R_col
def test_format_reward_is_share_of_parsed_generations():
    ep = episode(gens={"a1": [True, True, False, True], "a2": [False, False]})
    assert format_reward(ep, "a1") == pytest.approx(0.75)
    assert format_reward(ep, "a2") == 0.0
    assert format_reward(ep, "nobody") == 0.0
    # per phase: one unparsed plan weighs as much as three parsed communication decisions
    ep = episode(gens={"a1": [False, True, True, True], "a2": [True]})
    for g in ep.generations[1:4]:
        g.phase = "communicate"
    assert format_reward(ep, "a1") == pytest.approx(0.75)
    assert format_reward(ep, "a1", "phases") == pytest.approx((0.0 + 1.0) / 2)
    assert format_reward(ep, "a2", "phases") == 1.0
    rewards = batch_agent_rewards([ep], RewardConfig(format="phases", w_col=0.0), None)[0]
    assert rewards["a1"].format == pytest.approx(0.5)


def test_over_limit_penalty():
    cfg = RewardConfig()  # limit 5, -2 per extra call
    assert tool_penalty(5, cfg) == 0.0
    assert tool_penalty(6, cfg) == -2.0
    assert tool_penalty(8, cfg) == -6.0
    tools = ["Global Sampling", "Rough Browser", "Fine Browser", "Image Retrieval", "Fine Browser",
             "Video Retrieval", "Rough Browser"]
    long = AgentRecord(plan=["Global Sampling", "Rough Browser"],
                       turns=[turn(i + 1, t, key_info=f"k{i}") for i, t in enumerate(tools)], answer="B")
    ep = episode(records={"a1": long, "a2": good_record()})
    always = ConstJudge(1)
    assert collaboration_reward(ep, "a1", always, cfg) == pytest.approx(1 - 4.0)  # 7 calls: 2 over
    assert collaboration_reward(ep, "a2", always, cfg) == pytest.approx(1.0)
    soft = RewardConfig(over_limit_penalty=-0.5, tool_call_limit=6)
    assert collaboration_reward(ep, "a1", always, soft) == pytest.approx(0.5)
    with pytest.raises(ValueError):
        RewardConfig(over_limit_penalty=1.0)
    with pytest.raises(ValueError):
        RewardConfig(w_res=1.0, bogus=2)


def test_agent_rewards_breakdown_and_weights():
    recs = {"a1": good_record("B"), "a2": good_record("C"), "a3": good_record("B")}
    recs["a3"].plan = ["Rough Browser"]  # no selection tool: the rubric judge says 0
    ep = episode(records=recs, gens={"a1": [True, True], "a2": [True, False], "a3": [False, False]}, final="B")
    out = agent_rewards(ep, RewardConfig(), RubricJudge())
    assert list(out) == ["a1", "a2", "a3"]
    a1, a2, a3 = out["a1"], out["a2"], out["a3"]
    assert (a1.res, a1.format, a1.col, a1.total) == (1.0, 1.0, 1.0, 3.0)
    assert (a2.res, a2.format, a2.col, a2.total) == (-1.0, 0.5, 1.0, 0.5)
    assert (a3.res, a3.format, a3.col, a3.total) == (1.0, 0.0, 0.0, 1.0)
    assert all(b.team_res == 1.0 for b in out.values())
    assert all(b.judge == RUBRIC_JUDGE_NAME for b in out.values())
    assert a3.judge_reason.startswith(RUBRIC_JUDGE_NAME) and "selection" in a3.judge_reason
    # weights
    w = RewardConfig(w_res=0.5, w_format=2.0, w_col=3.0)
    out = agent_rewards(ep, w, RubricJudge())
    assert out["a2"].total == pytest.approx(0.5 * -1 + 2.0 * 0.5 + 3.0 * 1.0)
    assert out["a3"].total == pytest.approx(0.5 * 1 + 0.0 + 0.0)
    # the shared team term: every agent gets w_team * team_res on top (team right here: +1; wrong: -1)
    team = agent_rewards(ep, RewardConfig(w_team=0.5), RubricJudge())
    assert [team[a].total for a in ("a1", "a2", "a3")] == pytest.approx([3.5, 1.0, 1.5])
    # the outcome (what an answer decides, for credit: phase): the result, the answer's own format (a1 parsed,
    # a2 and a3 did not), the team term; not the plan's format nor the collaboration verdict
    assert [team[a].outcome for a in ("a1", "a2", "a3")] == pytest.approx([1.5 + 1.0, -0.5, 1.5])
    assert out["a2"].outcome == pytest.approx(0.5 * -1 + 2.0 * 0.0)
    assert out["a1"].outcome == pytest.approx(0.5 * 1 + 2.0 * 1.0)
    # a summary the parser had to rescue (a bare letter for an open question, say) costs its writer the format term
    ep.generations.append(gen("a1", False, "summary"))
    assert agent_rewards(ep, w, RubricJudge())["a1"].outcome == pytest.approx(0.5 * 1 + 2.0 * 0.0)
    ep.generations[-1] = gen("a1", True, "summary")
    assert agent_rewards(ep, w, RubricJudge())["a1"].outcome == pytest.approx(0.5 * 1 + 2.0 * 1.0)
    wrong = agent_rewards(episode(records={"a1": good_record("B")}, answers={}, final="D"), RewardConfig(w_team=0.5),
                          RubricJudge())["a1"]
    assert wrong.total == pytest.approx(1.0 + 1.0 + 1.0 - 0.5)
    # w_col = 0 needs no judge; w_col != 0 does
    out = agent_rewards(ep, RewardConfig(w_col=0.0), None)
    assert out["a1"].total == 2.0 and out["a1"].verdict_ok
    with pytest.raises(ValueError, match="w_col"):
        agent_rewards(ep, RewardConfig(), None)
    # an agent missing from `answers` falls back to its memory record; the team answer can be wrong
    ep2 = episode(records={"a1": good_record("B")}, answers={}, final="D")
    b = agent_rewards(ep2, RewardConfig(), RubricJudge())["a1"]
    assert (b.res, b.team_res) == (1.0, -1.0)


def test_batch_rewards_use_one_judge_call_and_log(caplog):
    eps = [episode(eid=f"ep{i}", question=OPEN, final="a red ball",
                   records={a: good_record("a red ball") for a in ("a1", "a2", "a3")}) for i in range(2)]
    judge = ConstJudge(1)
    judge.correct_calls = 0
    orig = judge.correct

    def counting_correct(items):
        judge.correct_calls += 1
        judge.correct_n = len(items)
        return orig(items)

    judge.correct = counting_correct
    out = batch_agent_rewards(eps, RewardConfig(), judge)
    assert judge.calls == 1 and len(judge.items) == 6
    assert judge.correct_calls == 1 and judge.correct_n == 8  # 6 agents + 2 team answers
    assert [sorted(o) for o in out] == [["a1", "a2", "a3"]] * 2
    assert all(b.total == 3.0 for o in out for b in o.values())
    with caplog.at_level(logging.INFO, logger="m1.marl.reward.rewards"):
        log_breakdowns("ep0", agent_rewards(eps[0], RewardConfig(), RubricJudge()))
    assert len(caplog.records) == 3
    assert all(RUBRIC_JUDGE_NAME in r.getMessage() for r in caplog.records)
    s = summarize(out)
    assert s["reward/total"] == 3.0 and s["reward/verdict"] == 1.0 and s["reward/team_res"] == 1.0
    assert s["reward/total/a2"] == 3.0


# ----------------------------------------------------------------------------- LLM judge
def test_llm_judge_batches_all_items_in_one_call():
    chat = FakeChat("gpt-4o", lambda m: "##Verdict: 1\n##Reason: clean plan")
    judge = LLMJudge(chat)
    ep = episode(records={f"a{i}": good_record() for i in range(4)})
    ep.memory["a3"].turns[0].key_info = "something else"  # distinct trajectories
    items = [JudgeItem.from_episode(ep, a) for a in ep.memory]
    items[1].record = items[1].record.model_copy(update={"key_info": "x"})
    items[2].record = items[2].record.model_copy(update={"key_info": "y"})
    verdicts = judge.judge(items)
    assert chat.calls == 1 and len(chat.batches[0]) == 4
    assert [v.value for v in verdicts] == [1, 1, 1, 1]
    assert all(v.ok and not v.lenient and v.reason == "clean plan" for v in verdicts)
    assert judge.name == "llm-judge:gpt-4o" and verdicts[0].judge == "llm-judge:gpt-4o"


def test_judge_prompt_renders_the_trajectory():
    rec = good_record()
    rec.turns.append(turn(3, "Fine Browser", output="", error="Fine Browser: no frames", decision="add_tool",
                          add="Space Tool"))
    msgs = collaboration_messages(JudgeItem(question=MCQ, agent="a1", record=rec), tool_call_limit=5)
    text = content(msgs)
    for needle in ("What colour is the ball?", "B: blue", "Global Sampling, Rough Browser",
                   "a blue ball rolls", "error: Fine Browser: no frames", "add tool Space Tool",
                   "Final answer of the agent: B", "##Verdict:", "no more than 5 tool calls"):
        assert needle in text, needle


def test_a_plan_the_parser_repaired_earns_no_collaboration_credit():
    """The record holds the plan the team ran; when the agent's plan reply did not parse, that plan was repaired
    or filled in (the question as key info) and must not be credited to the agent (MARL exploited it)."""
    ep = episode(records={"a1": good_record("B"), "a2": good_record("B")},
                 gens={"a1": [True, True], "a2": [False, True]})
    ep.generations[2] = ep.generations[2].model_copy(update={"completion": "##tool call: continue()"})
    items = [JudgeItem.from_episode(ep, a) for a in ("a1", "a2")]
    assert items[0].unreadable_plan is None and items[1].unreadable_plan == "##tool call: continue()"
    ok, bad = RubricJudge().judge(items)
    assert ok.value == 1 and bad.value == 0
    assert bad.criteria == {"plan_feasible": False, "tools_appropriate": True, "steps_managed": True}
    assert "required format" in bad.reason
    out = agent_rewards(ep, RewardConfig(), RubricJudge())
    assert (out["a1"].col, out["a2"].col) == (1.0, 0.0)
    # the LLM judge is shown the reply the agent wrote, and told the plan it sees was not written by the agent
    text = content(collaboration_messages(items[1], tool_call_limit=5))
    assert "'##tool call: continue()'" in text and "not written by the agent" in text
    assert "not written by the agent" not in content(collaboration_messages(items[0], tool_call_limit=5))


@pytest.mark.parametrize("reply,value,ok,lenient", [
    ("##Verdict: 1\n##Reason: good", 1, True, False),
    ("##Verdict: 0\n##Reason: skips selection", 0, True, False),
    ("<think>maybe verdict 0</think>##Verdict: 1\n##Reason: fine", 1, True, False),
    ("**Verdict**: 0 - the plan browses before selecting", 0, True, True),
    ("After review, the verdict is yes.", 1, True, True),
    ("## verdict : 1\nreason: ok", 1, True, True),
    ("I like turtles", 0, False, False),
    ("", 0, False, False),
    ("Verdict: 1. On reflection, verdict: 0", 0, False, False),
    ("Rating: 10/10", 0, False, False),
])
def test_parse_verdict_strict_then_lenient(reply, value, ok, lenient):
    v = parse_verdict(reply, "j")
    assert (v.value, v.ok, v.lenient) == (value, ok, lenient)
    if not ok:
        assert v.error and "unreadable" in v.reason


def test_garbage_reply_is_zero_not_ok_and_not_cached(tmp_path):
    replies = iter(["garbage!!", "##Verdict: 1\n##Reason: fine now"])
    chat = FakeChat("gpt-4o", lambda m: next(replies))
    judge = LLMJudge(chat, cache_dir=tmp_path)
    item = JudgeItem.from_episode(episode(), "a1")
    v = judge.judge([item])[0]
    assert (v.value, v.ok) == (0, False) and v.raw == "garbage!!"
    assert list(tmp_path.glob("*.json")) == []
    v2 = judge.judge([item])[0]  # asked again, since unreadable verdicts are not cached
    assert chat.calls == 2 and (v2.value, v2.ok) == (1, True)


def test_disk_cache_hit_makes_no_model_call(tmp_path):
    chat = FakeChat("gpt-4o", lambda m: "##Verdict: 1\n##Reason: ok" if "Call 2" in content(m)
                    else "##Verdict: 0\n##Reason: too short")
    ep = episode(records={"a1": good_record(), "a2": AgentRecord(plan=["Global Sampling", "Rough Browser"],
                                                                  turns=[turn(1, "Global Sampling")])})
    items = [JudgeItem.from_episode(ep, a) for a in ("a1", "a2")]
    first = LLMJudge(chat, cache_dir=tmp_path).judge(items)
    assert chat.calls == 1 and [v.value for v in first] == [1, 0]
    files = sorted(tmp_path.glob("*.json"))
    assert len(files) == 2 and all(len(f.stem) == 64 for f in files)
    assert json.loads(files[0].read_text())["judge"] == "llm-judge:gpt-4o"
    again = LLMJudge(chat, cache_dir=tmp_path)  # a new process would see the same files
    second = again.judge(items)
    assert chat.calls == 1 and again.cache_hits == 2
    assert [v.value for v in second] == [1, 0] and all(v.cached for v in second)
    # another judge model does not reuse these verdicts
    other = FakeChat("other-judge", lambda m: "##Verdict: 1\n##Reason: ok")
    LLMJudge(other, cache_dir=tmp_path).judge(items)
    assert other.calls == 1
    # correctness checks live under other keys than collaboration verdicts
    j = LLMJudge(chat, cache_dir=tmp_path)
    j.correct([CorrectItem(OPEN, "a red ball")])
    assert chat.calls == 2
    j.correct([CorrectItem(OPEN, "a red ball")])
    assert chat.calls == 2


def test_identical_items_are_asked_once():
    chat = FakeChat("gpt-4o", lambda m: "##Verdict: 1\n##Reason: ok")
    item = JudgeItem.from_episode(episode(), "a1")
    out = LLMJudge(chat).judge([item, item, item])
    assert chat.calls == 1 and len(chat.batches[0]) == 1 and [v.value for v in out] == [1, 1, 1]


def test_rate_limiter_spacing_with_fake_clock():
    now = [0.0]
    sleeps = []

    def sleep(s):
        sleeps.append(s)
        now[0] += s

    sent_at = []

    def reply(m):
        sent_at.append(now[0])
        return "##Verdict: 1\n##Reason: ok"

    chat = FakeChat("gpt-4o", reply)
    judge = LLMJudge(chat, rate_per_minute=4, clock=lambda: now[0], sleep=sleep)
    items = [JudgeItem(question=MCQ.model_copy(update={"id": f"q{i}", "text": f"Question {i}?"}),
                       agent="a1", record=good_record()) for i in range(10)]
    out = judge.judge(items)
    assert len(out) == 10 and all(v.value == 1 for v in out)
    assert [len(b) for b in chat.batches] == [4, 4, 2]
    # bucket of 4 starts full; refills one request every 15 s
    assert sleeps == pytest.approx([60.0, 30.0])
    assert sorted(set(sent_at)) == pytest.approx([0.0, 60.0, 90.0])
    lim = RateLimiter(4, clock=lambda: now[0], sleep=sleep)
    with pytest.raises(ValueError, match="exceeds"):
        lim.acquire(5)
    with pytest.raises(ValueError):
        RateLimiter(0)


def test_model_error_raises_or_scores_zero():
    class Broken:
        name = "down"

        def generate(self, requests, params):
            raise ModelError("down: HTTP 503")

    item = JudgeItem.from_episode(episode(), "a1")
    with pytest.raises(ModelError, match="judge call failed"):
        LLMJudge(Broken()).judge([item])
    v = LLMJudge(Broken(), on_model_error="zero").judge([item])[0]
    assert (v.value, v.ok) == (0, False) and "503" in v.error
    with pytest.raises(TypeError):
        LLMJudge(object())


# ----------------------------------------------------------------------------- rubric judge
def rubric(question, record, limit=5):
    v = RubricJudge(limit).judge([JudgeItem(question=question, agent="a1", record=record)])[0]
    assert v.judge == RUBRIC_JUDGE_NAME and v.reason.startswith(RUBRIC_JUDGE_NAME) and v.ok
    return v


def test_rubric_good_trajectory():
    v = rubric(MCQ, good_record())
    assert v.value == 1 and v.criteria == {"plan_feasible": True, "tools_appropriate": True, "steps_managed": True}
    assert RubricJudge.name == "offline-rubric-judge"


@pytest.mark.parametrize("plan", [
    ["Rough Browser", "Global Sampling"],  # browses first
    ["Global Sampling"],  # nothing to browse with
    ["Rough Browser"],  # nothing selected
    [],
    ["Global Sampling", "Magic Tool"],
])
def test_rubric_plan_feasibility(plan):
    rec = good_record()
    rec.plan = plan
    v = rubric(MCQ, rec)
    assert v.value == 0 and not v.criteria["plan_feasible"]
    assert v.criteria["tools_appropriate"] and v.criteria["steps_managed"]


@pytest.mark.parametrize("question,bad,good", [
    (MCQ.model_copy(update={"text": "What is shown at 01:30?"}),
     ("Global Sampling", "Rough Browser"), ("Time Stamp Retrieval", "Rough Browser")),
    (MCQ.model_copy(update={"text": "What happens around 75 seconds in?"}),
     ("Global Sampling", "Rough Browser"), ("Time Stamp Retrieval", "Rough Browser")),
    (GROUND, ("Global Sampling", "Rough Browser"), ("Global Sampling", "Grounding Tool")),
    (MCQ.model_copy(update={"text": "Is the cup left of the plate?"}),
     ("Global Sampling", "Rough Browser"), ("Global Sampling", "Space Tool")),
    # counting: a retrieval-only plan misses the sweep over the whole video
    (NUMERIC.model_copy(update={"text": "How many times does the square flash?"}),
     ("Image Retrieval", "Rough Browser"), ("Global Sampling", "Rough Browser")),
])
def test_rubric_tool_appropriateness(question, bad, good):
    def rec(tools):
        ki = question.text  # drawn from the question, so only the tools decide the verdict
        return AgentRecord(plan=list(tools), turns=[turn(1, tools[0], key_info=ki), turn(2, tools[1], key_info=ki,
                                                                                          answer="B")], answer="B")

    vb = rubric(question, rec(bad))
    assert vb.value == 0 and not vb.criteria["tools_appropriate"] and vb.criteria["plan_feasible"]
    vg = rubric(question, rec(good))
    assert vg.value == 1, vg.reason


def test_rubric_error_turn_and_no_calls():
    rec = good_record()
    rec.turns[1].error = "Rough Browser: vision model failed"
    v = rubric(MCQ, rec)
    assert v.value == 0 and not v.criteria["tools_appropriate"] and "error in call 2" in v.reason
    empty = AgentRecord(plan=["Global Sampling", "Rough Browser"], turns=[], answer="B")
    assert rubric(MCQ, empty).criteria["tools_appropriate"] is False


def test_rubric_step_management():
    base = ["Global Sampling", "Rough Browser"]
    # within the limit, distinct calls: fine
    ok = AgentRecord(plan=base, turns=[turn(1, "Global Sampling"), turn(2, "Rough Browser", key_info="the ball colour"),
                                       turn(3, "Rough Browser", key_info="the colour of the ball", answer="B")])
    assert rubric(MCQ, ok).value == 1
    # too many calls
    keys = ["the ball", "ball colour", "colour ball", "the colour", "ball", "colour of the ball"]  # all distinct
    many = AgentRecord(plan=base, turns=[turn(i, "Rough Browser" if i > 1 else "Global Sampling",
                                              key_info=keys[i - 1]) for i in range(1, 7)])
    v = rubric(MCQ, many)
    assert v.value == 0 and not v.criteria["steps_managed"] and "6 tool calls" in v.reason
    assert rubric(MCQ, many, limit=6).value == 1
    # the same call twice
    rep = AgentRecord(plan=base, turns=[turn(1, "Global Sampling"), turn(2, "Rough Browser"),
                                        turn(3, "Rough Browser")])
    v = rubric(MCQ, rep)
    assert v.value == 0 and "repeats Rough Browser" in v.reason
    # adding a tool after the answer was found
    late = AgentRecord(plan=base, turns=[turn(1, "Global Sampling"),
                                         turn(2, "Rough Browser", answer="B", decision="add_tool", add="Fine Browser"),
                                         turn(3, "Fine Browser", answer="B")])
    v = rubric(MCQ, late)
    assert v.value == 0 and "after call 2" in v.reason
    # adding a tool before any answer is good step management
    early = AgentRecord(plan=base, turns=[turn(1, "Global Sampling", decision="add_tool", add="Fine Browser"),
                                          turn(2, "Fine Browser", answer="B"), turn(3, "Rough Browser")])
    assert rubric(MCQ, early).value == 1


@pytest.mark.parametrize("text,cue", [
    ("What is on screen at 1:05?", "time"),
    ("What happens after 2 min?", "time"),
    ("What colour is the shape that appears at 125:03?", "time"),
    ("While both are visible, where is the red square relative to the blue disc?", "spatial"),
    ("Is the cup to the right of the plate?", "spatial"),
    ("How many red squares appear?", "counting"),
    ("What happens right after the door opens?", None),  # "right after" is not a direction
    ("At what times does it rain?", None),
])
def test_question_cues(text, cue):
    cues = question_cues(Question(id="x", video="v.mp4", text=text))
    assert [k for k, v in cues.items() if v] == ([cue] if cue else [])


@pytest.mark.parametrize("key_info,ok", [
    ("the ball", True),
    ("the colour of the ball", True),
    ("every red square and the blue circle together",  # linking words allowed: 4 of 5 content words named
     True),
    ("the yellow square", False),  # another object than the question's
    ("the shape at 01:08", False),  # a time the question does not state
    ("", False),
])
def test_key_info_problem(key_info, ok):
    from m1.marl.reward.rubric_judge import key_info_problem

    q = Question(id="q", video="v.mp4", text="Where is the red square relative to the blue circle, and what colour "
                 "is the ball?", options=["left", "right"], task="mcq", answer="A")
    assert (key_info_problem(q, key_info) is None) == ok
    # a time stated in the question is fine; options count as part of the question
    qt = Question(id="q2", video="v.mp4", text="What appears at 00:14?", options=["a green ring", "a cup"],
                  task="mcq", answer="A")
    assert key_info_problem(qt, "what appears at 00:14") is None
    assert key_info_problem(qt, "the green ring") is None
    assert "00:41" in key_info_problem(qt, "what appears at 00:41")


def test_rubric_rejects_key_info_for_another_object():
    rec = good_record()
    assert rubric(MCQ, rec).value == 1
    wrong = rec.model_copy(update={"turns": [t.model_copy(update={"key_info": "the green cube"}) for t in rec.turns]})
    v = rubric(MCQ, wrong)
    assert v.value == 0 and not v.criteria["tools_appropriate"] and "green cube" in v.reason


def test_evaluation_and_the_result_reward_agree_on_what_is_right():
    """One definition of a right answer (m1/data/metrics.py): MCQ truth given as a letter or as the option's text,
    open answers under one normaliser; the reward is +1 exactly where evaluation counts the answer right."""
    from m1.data.metrics import is_correct
    from m1.marl.reward.rewards import RewardConfig, result_reward

    mcq_letter = Question(id="a", video="v", text="?", options=["red", "blue"], task="mcq", answer="B")
    mcq_text = Question(id="b", video="v", text="?", options=["red", "blue"], task="mcq", answer="blue")
    open_q = Question(id="c", video="v", text="?", task="open", answer="The Eiffel-Tower!")
    cases = [(mcq_letter, "B"), (mcq_letter, "(B) blue"), (mcq_letter, "A"), (mcq_letter, None),
             (mcq_text, "B"), (mcq_text, "blue"), (mcq_text, "red"),
             (open_q, "the eiffel tower"), (open_q, "THE eiffel tower."), (open_q, "tower"), (open_q, "")]
    for q, answer in cases:
        right = is_correct(q, answer)
        assert result_reward(q, answer, None, RewardConfig()) == (1.0 if right else -1.0), (q.id, answer)
    assert [is_correct(q, a) for q, a in cases] == [True, True, False, False, True, True, False,
                                                    True, True, False, False]
