"""The rule-based teacher: plans from question wording only, repairs gaps, copies confident answers."""
import pytest

from m1.agents import prompts
from m1.agents.parsers import parse_answer, parse_decision, parse_plan
from m1.memory import SharedMemory
from m1.schema import Plan, Question, Turn
from m1.synth.teacher import TeacherChatModel, key_plan
from m1.tools import TOOL_NAMES

ALL = list(TOOL_NAMES)


@pytest.mark.parametrize("text, tools", [
    ("What colour is the shape that appears at 02:15?", ["Time Stamp Retrieval", "Rough Browser"]),
    ("What appears right after the red square leaves?", ["Video Retrieval", "Fine Browser"]),
    ("How many times does a blue circle appear?", ["Image Retrieval", "Fine Browser"]),
    ("While both are visible, where is the green triangle relative to the red square?",
     ["Video Retrieval", "Space Tool"]),
    ("When does the yellow cross appear? Give [start - end] in seconds.", ["Video Retrieval", "Grounding Tool"]),
    ("Which way does the white circle move?", ["Video Retrieval", "Fine Browser"]),
    ("Where in the frame does the cyan square appear?", ["Image Retrieval", "Fine Browser"]),
    ("What colour is the background when the red cross appears?", ["Image Retrieval", "Rough Browser"]),
    ("Which object flashes briefly near the end of the video?", ["Global Sampling", "Fine Browser"]),
    ("Describe the video.", ["Global Sampling", "Rough Browser"]),
])
def test_plans_follow_question_cues(text, tools):
    q = Question(id="q", video="v.mp4", text=text, options=["a", "b", "c", "d"])
    reply = TeacherChatModel().reply(prompts.plan_messages(q, ALL))
    parsed = parse_plan(reply, ALL)
    assert parsed.ok and parsed.plan.tools == tools
    assert key_plan(text)[1] == tools


def test_plan_reads_only_the_prompt_not_metadata():
    honest = Question(id="q", video="v.mp4", text="How many times does a red square appear?")
    lying = honest.model_copy(update={"meta": {"plan": ["Global Sampling", "Space Tool"], "family": "spatial"}})
    t = TeacherChatModel()
    assert t.reply(prompts.plan_messages(honest, ALL)) == t.reply(prompts.plan_messages(lying, ALL))


def test_error_rate_changes_plans_but_keeps_them_valid():
    qs = [Question(id=str(i), video="v", text=f"What colour is the shape that appears at 0{i}:15?")
          for i in range(10)]
    bad = TeacherChatModel(type("S", (), {"error_rate": 1.0, "seed": 3})())
    for q in qs:
        parsed = parse_plan(bad.reply(prompts.plan_messages(q, ALL)), ALL)
        assert parsed.ok and parsed.plan.tools != ["Time Stamp Retrieval", "Rough Browser"]
    good = TeacherChatModel()
    assert all(parse_plan(good.reply(prompts.plan_messages(q, ALL)), ALL).plan.tools[0] == "Time Stamp Retrieval"
               for q in qs)


def _memory(turns_a, turns_b=()):
    mem = SharedMemory(["a", "b"])
    mem.set_plan("a", Plan(key_info="k", tools=["Global Sampling", "Rough Browser"]))
    mem.set_plan("b", Plan(key_info="k", tools=["Image Retrieval", "Fine Browser"]))
    for t in turns_a:
        mem.add_turn("a", t)
    for t in turns_b:
        mem.add_turn("b", t)
    return mem


def test_answer_copies_own_confident_answer_then_peers():
    q = Question(id="q", video="v", text="What colour?", options=["red", "blue", "green", "white"])
    seen = Turn(step=2, tool="Rough Browser", key_info="k", output="##Summary: a blue square\n##Answer: B", answer="B")
    unseen = Turn(step=2, tool="Rough Browser", key_info="k",
                  output="##Summary: nothing. The frames do not show it; the answer is a guess.\n##Answer: D", answer="D")
    t = TeacherChatModel()
    mem = _memory([seen])
    reply = t.reply(prompts.answer_messages(q, mem.render("a")))
    assert parse_answer(reply, q).answer == "B"
    mem = _memory([unseen], [Turn(step=2, tool="Fine Browser", key_info="k", output="##Answer: C", answer="C")])
    text = mem.render("a") + "\n" + mem.view("a", ["b"])
    assert parse_answer(t.reply(prompts.answer_messages(q, text)), q).answer == "C"
    mem = _memory([unseen])
    assert parse_answer(t.reply(prompts.answer_messages(q, mem.render("a"))), q).answer == "D"  # own guess


def test_communication_repairs_gaps():
    q = Question(id="q", video="v", text="Which object flashes briefly near the end of the video?")
    t = TeacherChatModel()
    gs = Turn(step=1, tool="Global Sampling", key_info="k", output="Sampled 16 frames uniformly over the whole "
              "video (00:00-05:00).", timestamps=[9.0, 290.0])
    mem = _memory([gs])
    msgs = prompts.communicate_messages(q, mem.render("a"), "", ["Fine Browser"], "Fine Browser", ALL)
    d = parse_decision(t.reply(msgs), ALL).decision
    assert d.action == "add_tool" and d.tool == "Time Stamp Retrieval" and "04:30" in d.key_info
    # a selection tool with no browser left gets a browser added
    q2 = Question(id="q", video="v", text="What colour?", options=["a", "b"])
    mem = _memory([Turn(step=1, tool="Image Retrieval", key_info="k", output="Kept 16 frames", timestamps=[1.0])])
    msgs = prompts.communicate_messages(q2, mem.render("a"), "", [], None, ALL)
    d = parse_decision(t.reply(msgs), ALL).decision
    assert d.action == "add_tool" and d.tool == "Fine Browser"
    # a sound step continues
    mem = _memory([gs])
    msgs = prompts.communicate_messages(q2, mem.render("a"), "", ["Rough Browser"], "Rough Browser", ALL)
    assert parse_decision(t.reply(msgs), ALL).decision.action == "continue"


def test_teacher_team_answers_timestamp_questions_from_pixels(tmp_path, m1_cache):
    """End to end on generated M1-Synth videos: the teacher team with synth vision."""
    from m1.config import load_team
    from m1.data.metrics import is_correct
    from m1.data.questions import read_questions
    from m1.synth.make import make_dataset
    from m1.team.cpp import Team

    path = make_dataset(tmp_path / "d", videos=2, seed=5, duration=90, questions_per_video=8, progress=False)
    qs, _ = read_questions(path, tmp_path / "d")
    ts = [q for q in qs if q.meta["family"] == "timestamp"]
    assert ts, "the generated set should hold timestamp questions"
    # the world's trained CLIP takes minutes to build; timestamp plans never use it
    cfg = load_team("synth_teacher", ["models.clip.clip_name=null", "models.clip.tiny={arch: open_clip}"])
    eps = Team(cfg).run(ts)
    assert all(e.error is None for e in eps)
    assert sum(is_correct(q, e.final_answer) for q, e in zip(ts, eps)) == len(ts)
    for e in eps:
        assert e.memory["teacher_a"].plan == ["Time Stamp Retrieval", "Rough Browser"]
