"""Options on R_col and R_res: the judge's plan rubric (cues / outcome / none), the grounding reward of the
candidate recipe agreeing with how grounding is scored, and the tool-call penalty that the mini team can reach there.
Hand-built episodes; no model is run."""
from __future__ import annotations

import pytest
from tests.fakes import FakeChat

from m1.data.metrics import is_correct
from m1.marl.config import JudgeConfig, load_train_config
from m1.marl.reward.judge import JudgeItem
from m1.marl.reward.llm_judge import LLMJudge, collaboration_messages
from m1.marl.reward.rewards import RewardConfig, batch_agent_rewards, result_reward, tool_penalty
from m1.marl.reward.rubric_judge import RubricJudge
from m1.schema import AgentAnswer, AgentRecord, Decision, Episode, Generation, Question, Topology, Turn

# an MCQ that states a time: the cue rule asks for Time Stamp Retrieval
TIMED = Question(id="q-time", video="v.mp4", text="What shape appears at 00:14?",
                 options=["a green ring", "a red square", "a cup", "a blue disc"], task="mcq", answer="B")
KEY = "the shape that appears at 00:14"
GROUND = Question(id="q-gr", video="v.mp4", text="When does the red square appear?", task="grounding",
                  answer="[10 - 20]")


def turn(step, tool, output, key_info=KEY, answer=None, span=None, decision="continue", error=None):
    return Turn(step=step, tool=tool, key_info=key_info, output=output, answer=answer, span=span, error=error,
                decision=None if decision is None else Decision(action=decision))


def teacher_record(answer="B"):
    """The rule-based teacher's plan for a stated time (m1/synth/teacher.py key_plan)."""
    return AgentRecord(plan=["Time Stamp Retrieval", "Rough Browser"], key_info=KEY,
                       turns=[turn(1, "Time Stamp Retrieval", "8 frames from 12.0s to 16.0s"),
                              turn(2, "Rough Browser", "a red square in the centre", answer="B")],
                       answer=answer)


def other_record(answer="B"):
    """A plan the teacher never writes for this question, finding the same thing."""
    return AgentRecord(plan=["Global Sampling", "Grounding Tool"], key_info=KEY,
                       turns=[turn(1, "Global Sampling", "16 frames over the whole video"),
                              turn(2, "Grounding Tool", "a red square appears around 00:14", answer="B")],
                       answer=answer)


def episode(records, question=TIMED):
    agents = list(records)
    return Episode(id="ep", question=question, topology=Topology(agents=agents, active=agents, edges=[]),
                   memory=records,
                   generations=[Generation(agent=a, phase=p, prompt=[{"role": "user", "content": "x"}], completion="y")
                                for a in agents for p in ("plan", "answer")],
                   answers=[AgentAnswer(agent=a, answer=r.answer) for a, r in records.items()],
                   final_answer="B")


def verdict(record, mode, question=TIMED, unreadable=None, limit=5):
    item = JudgeItem(question=question, agent="a1", record=record, unreadable_plan=unreadable)
    return RubricJudge(limit, plan_rubric=mode).judge([item])[0]


# ----------------------------------------------------------------------------- the bias and the option
def test_a_non_teacher_plan_that_answers_right_is_not_scored_below_the_teachers():
    """Both agents answer right; only their tools differ. The cue rubric (default) gives the non-teacher plan
    R_col 0 against the teacher's 1; outcome and none score it as the teacher's."""
    ep = episode({"teacher": teacher_record(), "other": other_record()})
    cfg = RewardConfig()
    got = {mode: batch_agent_rewards([ep], cfg, RubricJudge(cfg.tool_call_limit, plan_rubric=mode))[0]
           for mode in ("cues", "outcome", "none")}
    assert got["cues"]["teacher"].res == got["cues"]["other"].res == 1.0
    assert got["cues"]["teacher"].col == 1.0 and got["cues"]["other"].col == 0.0  # the bias
    assert "Time Stamp Retrieval was not used" in got["cues"]["other"].judge_reason
    for mode in ("outcome", "none"):
        assert got[mode]["other"].col >= got[mode]["teacher"].col, mode
        assert got[mode]["other"].col == got[mode]["teacher"].col == 1.0, got[mode]["other"].judge_reason
        assert got[mode]["other"].total >= got[mode]["teacher"].total
    assert RubricJudge().plan_rubric == "cues"  # the default keeps today's judge
    with pytest.raises(ValueError, match="plan_rubric"):
        RubricJudge(plan_rubric="teacher")


# ----------------------------------------------------------------------------- what outcome still judges
def test_outcome_rubric_judges_form_execution_and_use_of_the_notes():
    good = other_record()
    assert verdict(good, "outcome").value == 1
    # a tool named twice in the plan
    twice = good.model_copy(update={"plan": ["Global Sampling", "Grounding Tool", "Grounding Tool"]})
    v = verdict(twice, "outcome")
    assert v.value == 0 and not v.criteria["plan_feasible"] and "more than once" in v.reason
    assert verdict(twice, "cues").criteria["plan_feasible"]  # the cue rubric does not look at this
    # a planned tool that never ran, unless the agent chose to stop or used up its calls
    longer = good.model_copy(update={"plan": ["Global Sampling", "Grounding Tool", "Fine Browser"]})
    v = verdict(longer, "outcome")
    assert v.value == 0 and "['Fine Browser'] never ran" in v.reason
    stopped = longer.model_copy(deep=True)
    stopped.turns[1].decision = Decision(action="stop")
    assert verdict(stopped, "outcome").value == 1
    assert verdict(longer, "outcome", limit=2).value == 1
    # a browser that saw nothing: no notes for the answer to use
    blind = good.model_copy(deep=True)
    blind.turns[1].output, blind.turns[1].answer = "(the browser returned nothing)", None
    v = verdict(blind, "outcome")
    assert v.value == 0 and not v.criteria["tools_appropriate"] and "no browsing call returned" in v.reason
    # an answer that none of its own tools suggested ("a red square" is the suggested option's own text: agrees)
    assert verdict(other_record(answer="a red square"), "outcome").value == 1
    v = verdict(other_record(answer="D"), "outcome")
    assert v.value == 0 and "follows none of its tools' suggestions ['B']" in v.reason
    # browsing first is still not a well-formed plan; errors still count
    assert verdict(good.model_copy(update={"plan": ["Grounding Tool", "Global Sampling"]}), "outcome").value == 0
    failed = good.model_copy(deep=True)
    failed.turns[1].error = "Grounding Tool: vision model failed"
    assert "error in call 2" in verdict(failed, "outcome").reason


def test_outcome_rubric_reads_a_grounding_answer_by_its_span():
    rec = AgentRecord(plan=["Video Retrieval", "Rough Browser"], key_info="the red square",
                      turns=[turn(1, "Video Retrieval", "8 frames", key_info="the red square"),
                             turn(2, "Rough Browser", "a red square from 11 s to 19 s", key_info="the red square",
                                  span=(11.0, 19.0))],
                      answer="[12 - 20]")
    # no Grounding Tool: the cue rubric fails it, outcome does not; [12 - 20] vs [11 - 19]: IoU 7/9 >= 0.5
    assert verdict(rec, "cues", GROUND).value == 0
    assert verdict(rec, "outcome", GROUND).value == 1
    far = rec.model_copy(update={"answer": "[40 - 50]"})
    assert "follows none" in verdict(far, "outcome", GROUND).reason


def test_none_rubric_drops_the_plan_but_keeps_the_other_rules():
    browse_first = other_record().model_copy(update={"plan": ["Grounding Tool", "Global Sampling"]})
    assert verdict(browse_first, "cues").value == 0 and verdict(browse_first, "outcome").value == 0
    assert verdict(browse_first, "none").value == 1
    assert verdict(other_record().model_copy(update={"plan": []}), "none").value == 1
    # a plan reply the parser had to repair is never credited, in any mode
    for mode in ("cues", "outcome", "none"):
        v = verdict(teacher_record(), mode, unreadable="plan: look around")
        assert v.value == 0 and not v.criteria["plan_feasible"], mode
    # non-plan rules stay: key info for another object, calls in error, repeated calls
    wrong = other_record()
    wrong = wrong.model_copy(update={"turns": [t.model_copy(update={"key_info": "the yellow cube"})
                                               for t in wrong.turns]})
    assert "yellow cube" in verdict(wrong, "none").reason and verdict(wrong, "none").value == 0
    rep = other_record()
    rep.turns.append(rep.turns[1].model_copy(update={"step": 3}))
    assert "repeats Grounding Tool" in verdict(rep, "none").reason
    no_calls = AgentRecord(plan=["Global Sampling", "Rough Browser"], key_info=KEY, answer="B")
    assert verdict(no_calls, "none").value == 0


# ----------------------------------------------------------------------------- LLM judge prompt
def test_llm_judge_prompt_follows_the_plan_rubric():
    item = JudgeItem(question=TIMED, agent="a1", record=other_record())
    task = {m: collaboration_messages(item, 5, plan_rubric=m)[1]["content"].split("\n\n")[-2]
            for m in ("cues", "outcome", "none")}
    assert "a stated time calls for Time Stamp Retrieval" in task["cues"]
    for m in ("outcome", "none"):
        assert "Time Stamp Retrieval" not in task[m] and "Space Tool" not in task[m], m
        assert "no more than 5 tool calls" in task[m]
    assert "do not prefer or require particular tools" in task["outcome"]
    assert "Do not judge which tools it planned" in task["none"]
    # the default prompt is the one earlier runs cached their verdicts under
    assert collaboration_messages(item, 5) == collaboration_messages(item, 5, plan_rubric="cues")
    seen = []
    chat = FakeChat("judge-model", lambda msgs: seen.append(msgs[1]["content"]) or "##Verdict: 1\n##Reason: fine")
    judges = {m: LLMJudge(chat, plan_rubric=m) for m in ("cues", "outcome")}
    keys = {m: j.cache_key("collab", collaboration_messages(item, 5, plan_rubric=m)) for m, j in judges.items()}
    assert keys["cues"] != keys["outcome"]  # a cached cue verdict is never reused for outcome
    assert judges["outcome"].judge([item])[0].value == 1
    assert "do not prefer or require particular tools" in seen[-1]
    with pytest.raises(ValueError, match="plan_rubric"):
        LLMJudge(chat, plan_rubric="teacher")


# ----------------------------------------------------------------------------- configs
def test_judge_config_plan_rubric_field_and_recipe():
    from m1.marl.parts import build_judge

    assert "plan_rubric" not in JudgeConfig().recorded()  # a default: not part of a recorded identity
    assert JudgeConfig(plan_rubric="outcome").recorded()["plan_rubric"] == "outcome"
    with pytest.raises(ValueError):
        JudgeConfig(plan_rubric="teacher")
    mini, recipe = load_train_config("mini"), load_train_config("mini_recipe")
    assert build_judge(mini).plan_rubric == "cues"
    judge = build_judge(recipe)
    assert isinstance(judge, RubricJudge) and judge.plan_rubric == "outcome"
    assert judge.tool_call_limit == recipe.rewards.tool_call_limit
    none = load_train_config("mini_recipe", ["judge.plan_rubric=none"])
    assert build_judge(none).plan_rubric == "none"


def test_recipe_grounding_reward_is_right_exactly_where_grounding_is_scored_right():
    """mini.yaml pays 2*IoU - 1, so a right span (IoU 0.5) earns 0 and a wrong one (IoU 0.45) nearly as much; the
    recipe's threshold pays +1 exactly where evaluation counts the span right (IoU >= 0.5)."""
    mini, recipe = load_train_config("mini").rewards, load_train_config("mini_recipe").rewards
    spans = ["[10 - 20]", "[10 - 15]", "[12 - 22]", "[15 - 25]", "[10 - 14.5]", "[30 - 40]", "not a span"]
    right = [is_correct(GROUND, s) for s in spans]
    assert right == [True, True, True, False, False, False, False]  # IoU 1, .5, .67, .33, .45, 0, none
    assert [result_reward(GROUND, s, cfg=recipe) for s in spans] == [1.0 if r else -1.0 for r in right]
    linear = [result_reward(GROUND, s, cfg=mini) for s in spans]
    assert linear[1] == pytest.approx(0.0) and linear[4] == pytest.approx(-0.1, abs=0.01)  # right ~ wrong


def test_tool_penalty_fires_within_the_recipes_team_budget_but_not_minis():
    """The team runs at most one call per turn and stops at max_tool_calls; mini.yaml's limit is above that
    budget (its penalty is dead), the recipe's is below it."""
    for name, reachable in (("mini", False), ("mini_recipe", True)):
        cfg = load_train_config(name)
        limits = cfg.team_config().limits
        budget = min(limits.max_turns, limits.max_tool_calls)
        assert budget == 4
        assert (tool_penalty(budget, cfg.rewards) < 0) == reachable, name
        assert all(tool_penalty(n, cfg.rewards) == 0 for n in range(cfg.rewards.tool_call_limit + 1))
    recipe = load_train_config("mini_recipe")
    four = other_record()
    four.turns += [turn(3, "Video Retrieval", "8 frames"), turn(4, "Fine Browser", "a red square", answer="B")]
    four.plan += ["Video Retrieval", "Fine Browser"]
    got = batch_agent_rewards([episode({"a1": four})], recipe.rewards,
                              RubricJudge(recipe.rewards.tool_call_limit, plan_rubric="outcome"))[0]["a1"]
    assert got.tool_calls == 4 and got.penalty == -2.0 and got.col == -2.0  # verdict 0 (4 calls > 3) minus 2
