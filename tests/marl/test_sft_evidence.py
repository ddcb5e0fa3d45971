"""SFT's evidence attention loss: the rule teacher records where its replies read the prompt (answers off the notes'
answer values, key info off the question's words), the record survives Episode -> SFTExample -> JSONL -> sample, the
learner places it on its own tokens (through the chat template, left padding included) and the loss moves the
reading head; at weight 0 the step is today's."""
import json

import pytest

from m1.agents import prompts
from m1.attention_loss import AttentionLossSettings
from m1.config import ModelSpec
from m1.evidence import ChatEvidence
from m1.marl.config import GRPOSettings, LearnerConfig
from m1.marl.sft import build_sft_data, read_examples, write_examples
from m1.marl.sft_examples import SFTExample
from m1.memory import SharedMemory
from m1.schema import Plan, Question, Turn
from m1.synth.teacher import TeacherChatModel
from m1.tools import TOOL_NAMES
from tests.synth.test_teacher import _memory

ALL = list(TOOL_NAMES)
TINY = {"arch": "qwen3", "hidden_size": 32, "layers": 2, "heads": 4, "kv_heads": 2, "seed": 1}
READ = AttentionLossSettings(weight=1.0, read_heads=[(1, 0)], prev_head=(0, 0), prev2_head=(0, 1),
                             structural_every=4)
MCQ = Question(id="q1", video="v.mp4", text="What colour is the square?", options=["red", "blue", "green", "white"],
               answer="C")


def note(agent_step, answer, out="##Summary: a square"):
    return Turn(step=agent_step, tool="Rough Browser", key_info="k", output=out, answer=answer)


def answer_chat(own, peers):
    """The answer prompt of agent a: its own notes, then peer b's."""
    mem = _memory(own, peers)
    return prompts.answer_messages(MCQ, mem.render("a") + "\n" + mem.view("a", ["b"]))


def cited(messages, reply, evidence):
    """(reply stretch, [(source text, the line holding it)]) per evidence entry."""
    out = []
    for ev in evidence:
        srcs = []
        for m, a, b in ev.sources:
            text = messages[m]["content"]
            srcs.append((text[a:b], text[text.rfind("\n", 0, a) + 1:text.find("\n", b) % (len(text) + 1)]))
        out.append((reply[ev.start:ev.end], srcs))
    return out


# ------------------------------------------------------------------------------------------------ the teacher
def test_answer_reads_its_own_last_confident_note():
    guess = "##Summary: nothing. The frames do not show it; the answer is a guess."
    msgs = answer_chat([note(1, "A"), note(2, "B"), note(3, "D", guess)], [note(1, "C")])
    reply, evidence = TeacherChatModel().write(msgs)
    assert reply.startswith("##Answer: B\n")
    (stretch, [(value, line)]), = cited(msgs, reply, evidence)
    assert (stretch, value) == ("B", "B") and line.startswith("[a] step 2: Rough Browser answer: B -> ")
    assert evidence[0].copy and evidence[0].sources[0][0] == 1  # in the user message


def test_answer_from_peers_reads_every_note_with_the_most_common_answer():
    msgs = answer_chat([], [note(1, "C"), note(2, "D"), note(3, "C")])
    reply, evidence = TeacherChatModel().write(msgs)
    assert reply.startswith("##Answer: C\n")
    (stretch, sources), = cited(msgs, reply, evidence)
    assert stretch == "C" and [v for v, _ in sources] == ["C", "C"]
    assert [line.split(":")[0] for _, line in sources] == ["[b] step 1", "[b] step 3"]  # not step 2's D


def test_grounding_answer_reads_the_span_and_copies_the_question():
    q = Question(id="g", video="v.mp4", text="When does the red cross appear? Give [start - end] in seconds.",
                 task="grounding")
    mem = SharedMemory(["a"])
    mem.set_plan("a", Plan(key_info="k", tools=["Video Retrieval", "Grounding Tool"]))
    mem.add_turn("a", Turn(step=1, tool="Grounding Tool", key_info="k", output="seen", answer="[3.0 - 7.5]"))
    msgs = prompts.answer_messages(q, mem.render("a"))
    reply, evidence = TeacherChatModel().write(msgs)
    assert reply.startswith("##Timestamp: [3 - 7.5]\n")
    (span, [(value, _)]), (quoted, [(source, line)]) = cited(msgs, reply, evidence)
    assert (span, value) == ("[3 - 7.5]", "[3.0 - 7.5]") and not evidence[0].copy  # written anew: read, not copied
    assert quoted == source == q.text and line == f"Question: {q.text}" and evidence[1].copy


@pytest.mark.parametrize("text, copied", [
    ("While both are visible, where is the green triangle relative to the red square?",
     ["the green triangle", "the red square"]),
    ("What colour is the shape that appears at 02:15?", ["02:15"]),
    ("How many times does a blue circle appear?", ["blue circle"]),
    ("Describe the video.", ["Describe the video."]),  # no object named: the whole question is the key
    ("Which object flashes briefly near the end of the video?", []),  # written by the rule, copied from nowhere
])
def test_plan_key_info_points_at_the_questions_words(text, copied):
    q = Question(id="q", video="v.mp4", text=text, options=["a", "b"])
    msgs = prompts.plan_messages(q, ALL)
    reply, evidence = TeacherChatModel().write(msgs)
    found = cited(msgs, reply, evidence)
    assert [s for s, _ in found] == copied and all(ev.copy for ev in evidence)
    for stretch, [(source, line)] in found:
        assert source.lower() == stretch.lower() and line == f"Question: {text}"
        assert reply.split("\n")[0].startswith("##key info: ")


def test_communicate_key_info_copies_the_question():
    q = Question(id="q", video="v.mp4", text="What colour?", options=["a", "b"])
    mem = SharedMemory(["a"])
    mem.set_plan("a", Plan(key_info="k", tools=["Image Retrieval"]))
    mem.add_turn("a", Turn(step=1, tool="Image Retrieval", key_info="k", output="Kept 16 frames", timestamps=[1.0]))
    msgs = prompts.communicate_messages(q, mem.render("a"), "", [], None, ALL)
    reply, evidence = TeacherChatModel().write(msgs)
    assert reply == "##tool call: add tool <Fine Browser>\n##key info: What colour?"
    tool, key = cited(msgs, reply, evidence)
    assert key == ("What colour?", [("What colour?", "Question: What colour?")])
    # the decision reads its cue: the last step was a selection tool, and no browser is left in the plan
    assert tool[0] == "Fine Browser" and [v for v, _ in tool[1]] == ["Image Retrieval", "none"]


def test_add_tool_decision_reads_the_note_that_says_the_shape_was_not_visible():
    q = Question(id="q", video="v.mp4", text="What appears right after the red square leaves?",
                 options=["a", "b", "c", "d"])
    mem = SharedMemory(["a"])
    mem.set_plan("a", Plan(key_info="k", tools=["Video Retrieval", "Fine Browser"]))
    mem.add_turn("a", Turn(step=1, tool="Video Retrieval", key_info="k", output="Kept 16 frames", timestamps=[1.0]))
    mem.add_turn("a", Turn(step=2, tool="Fine Browser", key_info="k", answer="not seen",
                           output="##Summary: The red square is not visible in these frames.\n##Answer: not seen"))
    msgs = prompts.communicate_messages(q, mem.render("a"), "", [], None, ALL)
    reply, evidence = TeacherChatModel().write(msgs)
    assert reply.startswith("##tool call: add tool <Image Retrieval>\n")
    (stretch, sources), _ = cited(msgs, reply, evidence)
    assert stretch == "Image Retrieval"
    values = [v for v, _ in sources]
    assert values[0] == "not seen" and "not visible" in values[1] and "red square" in values[1]
    assert all(line.startswith("[a] step 2: Fine Browser") for _, line in sources)
    # a browser that saw the answer: continue(), reading nothing
    mem = SharedMemory(["a"])
    mem.set_plan("a", Plan(key_info="k", tools=["Video Retrieval", "Fine Browser"]))
    mem.add_turn("a", Turn(step=2, tool="Fine Browser", key_info="k", answer="B", output="##Summary: a blue circle"))
    reply, evidence = TeacherChatModel().write(prompts.communicate_messages(q, mem.render("a"), "", [], None, ALL))
    assert reply == "##tool call: continue()" and evidence == ()


def weaver_chat():
    """A Weaver chat after its temporal_grounding call: the rule then trims after the span the tool reported."""
    from m1.config import SeedSystemConfig
    from m1.kinds.prompts import first_turn
    from m1.kinds.settings import settings_for
    from m1.kinds.weaver import system

    q = Question(id="w", video="v.mp4", text="What appears right after the red square leaves?", options=["a", "b"])
    settings = settings_for("weaver", SeedSystemConfig(tools=["temporal_grounding", "trim"]))
    return [{"role": "system", "content": system(settings)},
            {"role": "user", "content": first_turn("weaver", q, 60.0, [0, 4], [0.0, 30.0])},
            {"role": "assistant", "content": '<tool_call>{"tool_name": "temporal_grounding"}</tool_call>'},
            {"role": "user", "content": [{"type": "text", "text": "[temporal_grounding] the red square is on screen "
                                                                  "from 12.0s to 20.5s"},
                                         {"type": "image", "time": 15.0, "frame": 2}]}]


def test_seed_rule_reads_a_tool_turn_in_text_only_characters():
    from m1.models.base import text_only
    from m1.synth import seed_rules

    msgs = weaver_chat()
    reply, evidence = seed_rules.write(msgs, None)
    assert json.loads(reply.split("<tool_call>")[1].split("</tool_call>")[0]) == {
        "tool_name": "trim", "start": 18.5, "end": 30.5}  # 2 s before the span's end, 10 s after it
    flat = text_only(msgs)
    found = [(reply[e.start:e.end], [flat[m]["content"][a:b] for m, a, b in e.sources]) for e in evidence]
    assert found == [("18.5", ["12.0s to 20.5"]), ("30.5", ["12.0s to 20.5", "60.0"])]  # the end also reads the length


def test_an_uncited_message_the_template_rewrote_is_skipped_a_cited_one_is_an_error():
    from m1.evidence import content_starts

    rendered = "<s>question</s><a>answer</a><u>seen at 3s</u>"  # the template dropped the reply's <think> part
    contents = ["question", "<think>hm</think>answer", "seen at 3s"]
    assert content_starts(rendered, contents, {0, 2}) == [3, None, rendered.index("seen")]
    with pytest.raises(ValueError, match="message 1's content is not in the rendered chat"):
        content_starts(rendered, contents, {1})


# ------------------------------------------------------------------------------------------------ the trip
def teacher_team():
    from m1.config import TeamConfig
    from m1.models.hub import ModelHub
    from m1.team.cpp import Team
    from tests.fakes import FakeVision

    cfg = TeamConfig.model_validate({
        "name": "teacher", "models": {"t": {"interface": "chat", "path": "fake/t"}, "vlm": {"interface": "vision", "path": "x"}},
        "agents": [{"name": "alpha", "model": "t"}, {"name": "beta", "model": "t"}],
        "tools": {"enabled": ["Global Sampling", "Rough Browser"], "browser": "vlm", "global_frames": 4,
                  "rough_frames": 4}, "limits": {"max_turns": 2}})
    hub = ModelHub(cfg.models)
    hub.register("t", TeacherChatModel())
    hub.register("vlm", FakeVision())  # every browser note answers A
    return Team(cfg, hub=hub)


def test_teacher_evidence_reaches_the_examples_file_and_old_lines_still_load(tmp_path, video):
    from m1.marl.reward.rewards import RewardConfig

    q = MCQ.model_copy(update={"video": video, "answer": "A", "text": "What colour is the white square?"})
    kept, _ = build_sft_data(teacher_team(), [q], RewardConfig(), phases=("plan", "answer"))
    answers = [e for e in kept if e.phase == "answer"]
    assert len(answers) == 2 and all(e.completion.startswith("##Answer: A") for e in answers)
    for e in kept:  # every kept reply says where it read: the answer off a note, the key off the question
        (stretch, sources), *_ = cited(e.messages, e.completion, e.evidence)
        assert stretch == ("A" if e.phase == "answer" else "the white square")
        assert all(v.lower() == stretch.lower() for v, _ in sources)
    path = write_examples(tmp_path / "ex.jsonl", kept)
    assert read_examples(path) == kept and all(isinstance(v, ChatEvidence) for v in read_examples(path)[0].evidence)
    old = {"agent": "alpha", "question_id": "q", "phase": "plan", "messages": [{"role": "user", "content": "x"}],
           "completion": "##key info: x"}
    (tmp_path / "old.jsonl").write_text(json.dumps(old) + "\n")
    back, = read_examples(tmp_path / "old.jsonl")
    assert back.evidence is None
    write_examples(tmp_path / "again.jsonl", [back])
    assert json.loads((tmp_path / "again.jsonl").read_text()) == old  # no evidence key written where there is none
    (tmp_path / "bad.jsonl").write_text(json.dumps({**old, "evidence": [{"start": 0, "end": 1, "sources": [[0, 1]]}]}))
    with pytest.raises(ValueError, match="bad.jsonl:1"):
        read_examples(tmp_path / "bad.jsonl")


# ------------------------------------------------------------------------------------------------ the learner
def learner(m1_cache, **cfg):
    from m1.marl.actor.learner import AgentLearner

    spec = ModelSpec.model_validate({"interface": "chat", "device": "cpu", "tiny": TINY})
    settings = LearnerConfig.model_validate({"finetune": "full", "lr": 1e-2, "max_grad_norm": None,
                                             "micro_batch_size": 8, **cfg})
    return AgentLearner.build("alpha", "qa", spec, settings, GRPOSettings(beta=0.0), seed=0).actor


def examples():
    """A teacher answer read off a peer note, and a plan copying two of the question's objects."""
    msgs = answer_chat([], [note(1, "C"), note(2, "D"), note(3, "C")])
    reply, evidence = TeacherChatModel().write(msgs)
    q = Question(id="q2", video="v.mp4", text="While both are visible, where is the green triangle relative to the "
                 "red square?", options=["a", "b"])
    plan_msgs = prompts.plan_messages(q, ALL)
    plan, plan_evidence = TeacherChatModel().write(plan_msgs)
    return [SFTExample("alpha", "q1", "answer", msgs, reply, evidence=list(evidence)),
            SFTExample("alpha", "q2", "plan", plan_msgs, plan, evidence=list(plan_evidence))]


def test_evidence_lands_on_the_tokens_that_hold_the_read_text(m1_cache):
    lrn = learner(m1_cache, attention=READ.model_dump())
    answer, plan = (lrn.scorer.sft_sample(e) for e in examples())
    tok = lrn.tokenizer
    for s in (answer, plan):
        p = len(s.prompt_ids)
        assert s.evidence and all(q >= p - 1 and all(e < p for e in ev) for q, ev in s.evidence)
    ids = answer.prompt_ids + answer.completion_ids
    (q, ev), = answer.evidence  # the letter, predicted from the position before it
    assert tok.decode([ids[q + 1]]).strip() == "C"
    assert [tok.decode([ids[e]]).strip() for e in ev] == ["C", "C"]  # the two peer notes' values
    assert tok.decode(ids[ev[0] - 4:ev[0] + 1]).endswith("answer: C")
    ids = plan.prompt_ids + plan.completion_ids
    sources = tok.decode([ids[e] for e in sorted({e for _, ev in plan.evidence for e in ev})])  # the two objects
    read = tok.decode([ids[q + 1] for q, _ in plan.evidence])  # the key info's copies of them
    assert sources.strip() == read.strip() == "the green triangle the red square"
    assert learner(m1_cache).scorer.sft_sample(examples()[0]).evidence is None  # off: nothing placed
    from m1.synth import seed_rules

    msgs = weaver_chat()  # list contents (frames as placeholders) and an earlier reply
    reply, evidence = seed_rules.write(msgs, None)
    s = lrn.scorer.sft_sample(SFTExample("alpha", "w", "act", msgs, reply, evidence=list(evidence)))
    ids = s.prompt_ids + s.completion_ids
    assert tok.decode([ids[e] for e in s.evidence[0][1]]).strip() == "12.0s to 20.5"


def step_stats(lrn, samples):
    before = {k: v.clone() for k, v in lrn.parameters().items()}
    stats = lrn.update(samples, 1e-2, "sft")
    moved = any(not v.equal(before[k]) for k, v in lrn.parameters().items())
    return stats, moved


@pytest.mark.slow
def test_attention_loss_step_reports_its_figures_and_weight_0_is_todays_step(m1_cache):
    import torch

    plain = learner(m1_cache)
    off = learner(m1_cache, attention={**READ.model_dump(), "weight": 0.0})
    on = learner(m1_cache, attention=READ.model_dump())
    ex = examples()
    base, _ = step_stats(plain, [plain.scorer.sft_sample(e) for e in ex])
    zero, _ = step_stats(off, [off.scorer.sft_sample(e) for e in ex])
    assert zero["loss"] == base["loss"] and zero["grad_norm"] == base["grad_norm"]
    assert not any(k.startswith("attn") for k in zero)
    assert all(torch.equal(a, b) for a, b in zip(plain.parameters().values(), off.parameters().values()))
    shown, moved = step_stats(on, [on.scorer.sft_sample(e) for e in ex])
    assert moved and 0 < shown["attn_evidence_mass"] < 1 and shown["attn_read"] > 0 and shown["attn_prev"] > 0
    assert shown["nll"] == pytest.approx(base["nll"], rel=1e-5)  # the whole-sequence pass scores the same tokens
    assert shown["loss"] == pytest.approx(shown["nll"] + shown["attn_loss"], rel=1e-5)
    assert shown["grad_norm"] != pytest.approx(base["grad_norm"], rel=1e-3)


@pytest.mark.slow
def test_left_padding_and_micro_batches_give_the_steps_mean(m1_cache):
    """Two samples of different prompt lengths in one left-padded micro-batch, or one each: the same reading loss
    (rows weighted by their share of the step's evidence rows), so rows sit on the right padded columns."""
    settings = {**READ.model_dump(), "prev_head": None, "prev2_head": None}
    one = learner(m1_cache, attention=settings, micro_batch_size=1)
    two = learner(m1_cache, attention=settings, micro_batch_size=2)
    a, _ = step_stats(one, [one.scorer.sft_sample(e) for e in examples()])
    b, _ = step_stats(two, [two.scorer.sft_sample(e) for e in examples()])
    for k in ("loss", "nll", "attn_loss"):
        assert a[k] == pytest.approx(b[k], rel=1e-5), k
    for k in ("attn_read", "attn_evidence_mass"):  # figures rounded to 4 places per micro-batch
        assert a[k] == pytest.approx(b[k], abs=2e-4), k


@pytest.mark.slow
def test_reading_head_learns_to_look_at_the_evidence(m1_cache):
    lrn = learner(m1_cache, attention={**READ.model_dump(), "weight": 5.0})
    samples = [lrn.scorer.sft_sample(e) for e in examples()]
    masses = [lrn.update(samples, 1e-2, "sft")["attn_evidence_mass"] for _ in range(12)]
    assert masses[-1] > 10 * masses[0]  # 0.0012 -> 0.15 here; the plain loss leaves it near 0.0016


@pytest.mark.slow
def test_lora_learner_takes_an_attention_step(m1_cache):
    lrn = learner(m1_cache, finetune="lora", attention=READ.model_dump())
    stats, moved = step_stats(lrn, [lrn.scorer.sft_sample(e) for e in examples()])
    assert moved and stats["attn_read"] > 0 and "attn_prev2" in stats


def test_attention_settings_are_checked_against_the_student(m1_cache):
    from m1.marl.config import TrainConfig

    with pytest.raises(ValueError, match=r"head \[2, 0\] is not in this model"):
        learner(m1_cache, attention={**READ.model_dump(), "read_heads": [(2, 0)]})
    with pytest.raises(ValueError, match="two jobs"):
        learner(m1_cache, attention={**READ.model_dump(), "read_heads": [(-2, 0)]})  # layer -2 is layer 0
    with pytest.raises(ValueError, match="gradient_checkpointing"):
        LearnerConfig(attention=READ, gradient_checkpointing=True)
    with pytest.raises(ValueError, match="prompt_grad"):
        LearnerConfig(attention=READ, prompt_grad=False)
    with pytest.raises(ValueError, match="learner.attention"):
        TrainConfig.model_validate({"team": {"name": "t", "models": {"m": {"interface": "chat", "tiny": TINY}},
                                             "agents": [{"name": "a", "model": "m"}]},
                                    "learner": {"attention": READ.model_dump()}})


def test_sft_warns_when_no_example_records_evidence(tmp_path, m1_cache, caplog):
    from m1.marl.sft import SFTTrainer
    from tests.marl.test_sft import EXAMPLES, sft_cfg

    heads = {"weight": 1.0, "read_heads": [(0, 0)], "prev_head": (0, 1), "prev2_head": None}  # 1-layer students
    tr = SFTTrainer(sft_cfg(tmp_path, learner={"attention": heads}, max_steps=1), examples=EXAMPLES)
    try:
        assert "none of the 8 examples records evidence" in caplog.text
    finally:
        tr.close()


class _Notes:
    """Senses that read fixed notes off fixed frames (the rules' layer alone, no pixels)."""

    def __init__(self, reading):
        self.reading = reading

    def look(self, chat, positions):
        return self.reading

    def cue(self, text):
        return "order", ["red square"], None


def test_a_seed_rule_answer_cites_the_frames_of_each_note_and_writes_the_drills_chain():
    """A Weaver answer turn: each note points at the frames it was read from (their time label and description); then
    the mini base's drill chain: each of those frames quoted as the chat shows it (after `<frame k at`), the option's
    words copied from the options block, the letter read from that option."""
    from m1.config import SeedSystemConfig
    from m1.kinds.prompts import first_turn
    from m1.kinds.rules import Reading, read_chat
    from m1.kinds.settings import settings_for
    from m1.kinds.weaver import rules, system
    from m1.models.base import text_only

    q = Question(id="w", video="v.mp4", text="What appears right after the red square leaves?",
                 options=["a blue circle", "a green cross"])
    parts = first_turn("weaver", q, 60.0, [0, 4, 8], [0.0, 20.0, 40.0])
    for p in parts:
        if p["type"] == "image":
            p["caption"] = f"something at {p['time']:.0f}"
    msgs = [{"role": "system", "content": system(settings_for("weaver", SeedSystemConfig(tools=[])))},
            {"role": "user", "content": parts}]
    notes = ["The red square is last seen at 00:00; next a green cross appears at 00:20."]
    reading = Reading("B", True, notes, list(q.options), note_times=[(0.0, 20.0)])
    reply, evidence = rules(read_chat(msgs, None, _Notes(reading)))
    assert reply == ("Final step: I read 3 frames. The red square is last seen at 00:00; next a green cross appears "
                     "at 00:20. Read: 0.0s>[something at 0] -> 20.0s>[something at 20] -> a green cross -> B."
                     "\n<answer>B</answer>")
    flat = text_only(msgs)
    found = [(reply[e.start:e.end], [flat[m]["content"][a:b] for m, a, b in e.sources], e.copy) for e in evidence]
    assert found == [
        (notes[0].rstrip("."), ["<frame 0 at 0.0s>[something at 0]", "<frame 1 at 20.0s>[something at 20]"], False),
        (" 0.0s>[something at 0]", [" 0.0s>[something at 0]"], True),
        (" 20.0s>[something at 20]", [" 20.0s>[something at 20]"], True),
        ("a green cross", ["a green cross"], True),
        (" B", ["a green cross"], False),
        ("B", ["a green cross"], False)]
