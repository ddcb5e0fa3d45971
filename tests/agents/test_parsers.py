"""Prompts and reply parsers of the policy agents: strict, lenient, fallback, and a fuzz run.

The fuzz run feeds thousands of seeded random strings (noise, shuffled format tokens, and every
truncation of valid replies) to every parser: none may raise, results must have the documented
types, and every plan that comes out must obey the plan rules."""
from __future__ import annotations

import math
import random

import pytest

from m1.agents import prompts
from m1.agents.parsers import (
    ALL_TOOLS, MAX_PLAN_TOOLS, AnswerParse, DecisionParse, PlanParse, canonical_tool, parse_answer,
    parse_decision, parse_plan, parse_summary,
)
from m1.schema import Decision, Plan, Question
from m1.text import format_time, parse_span, parse_timestamp
from m1.tools import BROWSE_TOOLS, SELECT_TOOLS

MCQ = Question(id="q1", video="v.mp4", text="What colour is the car that parks?",
               options=["red car", "blue car", "green car", "a yellow bus"], task="mcq")
OPEN = Question(id="q2", video="v.mp4", text="What does the boy drop?", task="open")
GROUND = Question(id="q3", video="v.mp4", text="When does the man sit down?", task="grounding")
NUMERIC = Question(id="q4", video="v.mp4", text="How many balls bounce?", task="numeric")
QUESTIONS = [MCQ, OPEN, GROUND, NUMERIC]
ALL = list(ALL_TOOLS)


# ----------------------------------------------------------------------------- plan
def test_plan_strict():
    r = parse_plan("##key info: the parked car\n##tool use: <Video Retrieval>, <Rough Browser>", ALL)
    assert r.ok and not r.lenient and r.error is None
    assert r.plan == Plan(key_info="the parked car", tools=["Video Retrieval", "Rough Browser"])


def test_plan_strict_after_think_block():
    r = parse_plan("<think>maybe retrieval</think>\n##key info: car\n##tool use: <Image Retrieval>, "
                   "<Fine Browser>", ALL)
    assert r.ok and r.plan.tools == ["Image Retrieval", "Fine Browser"]


@pytest.mark.parametrize("text, tools", [
    ("##Key Info: car\n##Tool Use: <rough browser>, <VideoRetrieval>", ["Video Retrieval", "Rough Browser"]),
    ("key info: car\ntool use: Video Retrieval, Rough Browser", ["Video Retrieval", "Rough Browser"]),
    ("## key info : car\n## tool use : <Image retrieval tool> -> <Space>", ["Image Retrieval", "Space Tool"]),
    ("**key info:** car\n**tool use:** Uniform Sampling then Grounding", ["Global Sampling", "Grounding Tool"]),
    ("##key info: car\n##tool use: 1. Time Stamp Retrieval 2. Rough Browse", ["Time Stamp Retrieval"]),
    ("##key info: car\n##tool use: <Video Retrieval> <Fine Browser (32 frames)>", ["Video Retrieval", "Fine Browser"]),
    ("I would use video retrieval and then the rough browser to look at the car.",
     ["Video Retrieval", "Rough Browser"]),
])
def test_plan_lenient(text, tools):
    r = parse_plan(text, ALL, question=MCQ)
    assert not r.ok and r.lenient and r.error
    assert r.plan.tools[:len(tools)] == tools
    assert r.plan.key_info


def test_plan_numbered_list_reads_both_tools():
    r = parse_plan("##key info: car\n##tool use: 1. Time Stamp Retrieval 2. Rough Browse", ALL)
    assert r.plan.tools == ["Time Stamp Retrieval", "Rough Browser"]


def test_plan_missing_browse_gets_default_and_not_ok():
    r = parse_plan("##key info: car\n##tool use: <Video Retrieval>", ALL)
    assert r.plan.tools == ["Video Retrieval", "Rough Browser"] and not r.ok and "browsing" in r.error


def test_plan_missing_select_gets_default():
    r = parse_plan("##key info: car\n##tool use: <Space Tool>", ALL)
    assert r.plan.tools == ["Global Sampling", "Space Tool"] and not r.ok and "selection" in r.error


def test_plan_default_is_first_enabled_when_preferred_disabled():
    enabled = ["Image Retrieval", "Video Retrieval", "Fine Browser"]
    r = parse_plan("##key info: car\n##tool use: <Fine Browser>", enabled)
    assert r.plan.tools == ["Image Retrieval", "Fine Browser"]


def test_plan_reorders_dedupes_and_caps_length():
    text = ("##key info: x\n##tool use: <Fine Browser>, <Global Sampling>, <Fine Browser>, <Space Tool>, "
            "<Image Retrieval>, <Video Retrieval>, <Time Stamp Retrieval>, <Rough Browser>")
    r = parse_plan(text, ALL)
    assert r.plan.tools == ["Global Sampling", "Image Retrieval", "Video Retrieval", "Time Stamp Retrieval",
                            "Fine Browser"]
    assert not r.ok
    for word in ("duplicate", "reordered", "cut to 5"):
        assert word in r.error


def test_plan_keeps_several_browsers_within_cap():
    r = parse_plan("##key info: x\n##tool use: <Video Retrieval>, <Rough Browser>, <Fine Browser>", ALL)
    assert r.ok and r.plan.tools == ["Video Retrieval", "Rough Browser", "Fine Browser"]


def test_plan_drops_disabled_and_unknown_tools():
    enabled = ["Global Sampling", "Video Retrieval", "Rough Browser"]
    r = parse_plan("##key info: x\n##tool use: <Image Retrieval>, <Video Retrieval>, <Magic Lens>, "
                   "<Fine Browser>, <Rough Browser>", enabled)
    assert r.plan.tools == ["Video Retrieval", "Rough Browser"]
    assert not r.ok and "'Image Retrieval' is not enabled" in r.error and "Magic Lens" in r.error
    assert "'Fine Browser' is not enabled" in r.error


@pytest.mark.parametrize("text", ["", "   ", "hello world", "\x00\x01\x02", "##", "##key info:", "<<<>>>"])
def test_plan_fallback(text):
    r = parse_plan(text, ALL, question=MCQ)
    assert not r.ok and not r.lenient and r.error
    assert r.plan == Plan(key_info=MCQ.text, tools=["Global Sampling", "Rough Browser"])


def test_plan_fallback_uses_first_enabled_of_each_group_and_empty_key_without_question():
    r = parse_plan("nothing useful", ["Image Retrieval", "Video Retrieval", "Space Tool", "Rough Browser"])
    assert r.plan.tools == ["Image Retrieval", "Space Tool"] and r.plan.key_info == ""


def test_plan_missing_key_info_uses_question():
    r = parse_plan("##tool use: <Video Retrieval>, <Rough Browser>", ALL, question=MCQ)
    assert r.plan.key_info == MCQ.text and r.lenient and not r.ok and "key info" in r.error


def test_plan_bad_enabled_config_raises_clear_error():
    with pytest.raises(ValueError, match="Magic"):
        parse_plan("x", ["Magic", "Rough Browser"])
    with pytest.raises(ValueError, match="browsing tool"):
        parse_plan("x", ["Global Sampling"])


@pytest.mark.parametrize("name, expected", [
    ("Rough Browser", "Rough Browser"), ("rough browser", "Rough Browser"), ("VideoRetrieval", "Video Retrieval"),
    ("<Image retrieval tool>", "Image Retrieval"), ("Uniform Sampling", "Global Sampling"),
    ("time-stamp retrieval", "Time Stamp Retrieval"), ("Timestamp Retrieval", "Time Stamp Retrieval"),
    ("space", "Space Tool"), ("SPACE TOOL", "Space Tool"), ("Rough Browse", "Rough Browser"),
    ("Fine Browser (32 frames)", "Fine Browser"), ("the grounding tool", "Grounding Tool"),
    ("banana", None), ("", None), ("tool", None), ("retrieval", None),
])
def test_canonical_tool(name, expected):
    assert canonical_tool(name, ALL) == expected


def test_canonical_tool_respects_enabled():
    assert canonical_tool("fine browser", ["Global Sampling", "Rough Browser"]) is None
    assert canonical_tool(None, ALL) is None  # type: ignore[arg-type]


# ----------------------------------------------------------------------------- decision
def test_decision_strict():
    r = parse_decision("##tool call: continue()", ALL)
    assert r.ok and r.decision == Decision(action="continue")
    r = parse_decision("##tool call: add tool <Image Retrieval>\n##key info: the logo on the cup", ALL)
    assert r.ok and not r.lenient
    assert r.decision == Decision(action="add_tool", tool="Image Retrieval", key_info="the logo on the cup")


@pytest.mark.parametrize("text, action, tool", [
    ("## Tool Call: Continue()", "continue", None),
    ("I think we should continue.", "continue", None),
    ("##tool call: add tool (tool name='Fine Browser')\n##key info: small text", "add_tool", "Fine Browser"),
    ("##tool call: add_tool(<video retrieval>)\n##key info: the dog", "add_tool", "Video Retrieval"),
    ("tool call: add tool Space\nkey info: left of the sofa", "add_tool", "Space Tool"),
    ("##tool call: add tool <Grounding Tool>", "add_tool", "Grounding Tool"),
])
def test_decision_lenient(text, action, tool):
    r = parse_decision(text, ALL)
    assert not r.ok and r.lenient and r.error
    assert r.decision.action == action and r.decision.tool == tool


def test_decision_add_without_key_info_is_noted():
    r = parse_decision("##tool call: add tool <Grounding Tool>", ALL)
    assert r.decision.key_info is None and "without ##key info" in r.error


@pytest.mark.parametrize("text", ["", "blah", "##tool call: add tool <Magic Lens>\n##key info: x",
                                  "##tool call: add tool <Fine Browser>\n##key info: x"])
def test_decision_fallback_is_continue(text):
    r = parse_decision(text, ["Global Sampling", "Rough Browser"])
    assert r.decision == Decision(action="continue") and not r.ok and not r.lenient and r.error


# ----------------------------------------------------------------------------- answers
@pytest.mark.parametrize("reply, letter", [
    ("B", "B"), ("(B)", "B"), ("B.", "B"), ("B)", "B"), ("Option B", "B"), ("option b.", "B"), ("b", "B"),
    ("[C]", "C"), ("C: green car", "C"), ("blue car", "B"), ("Blue Car.", "B"), ("a yellow bus", "D"),
    ("The answer is D", "D"), ("**A**", "A"), ("answer: c", "C"), ("B the blue one", "B"),
    ("E", ""), ("(F)", ""), ("Option Z", ""), ("", ""), ("none of them", ""), ("red car or blue car", ""),
])
def test_mcq_normalisation_table(reply, letter):
    r = parse_answer(f"##Answer: {reply}\n##Reason: seen in frame 3", MCQ)
    assert r.answer == letter
    assert r.ok == (reply == letter and letter != "")
    assert r.lenient == (letter != "" and reply != letter)
    if not letter:
        assert r.error and not r.ok


def test_mcq_letter_out_of_range_is_reported():
    r = parse_answer("##Answer: E\n##Reason: x", MCQ)
    assert r.answer == "" and "E is not one of A-D" in r.error


def test_mcq_strict_and_free_text():
    r = parse_answer("##Answer: C\n##Reason: the car is green", MCQ)
    assert (r.answer, r.reason, r.ok, r.lenient, r.error) == ("C", "the car is green", True, False, None)
    r = parse_answer("Looking at the frames, the answer is (B) because the car is blue.", MCQ)
    assert r.answer == "B" and r.lenient and not r.ok and "blue" in r.reason
    r = parse_answer("**Answer:** b\n**Reason:** blue paint", MCQ)
    assert r.answer == "B" and r.reason == "blue paint" and r.lenient


def test_evidence_first_answers_parse_as_strictly_as_answer_first():
    """A reply that states what it read before its answer (the reason first) is in the strict format too."""
    r = parse_answer("##Reason: the browser saw a green car at 00:12\n##Answer: C", MCQ)
    assert (r.answer, r.reason, r.ok, r.lenient) == ("C", "the browser saw a green car at 00:12", True, False)
    r = parse_answer("##Reason: he sits from 3 s\n##Timestamp: [3 - 7.5]", GROUND)
    assert r.ok and r.span == (3.0, 7.5)
    r = parse_summary("##Reason Summary: most agents read green\n##Final Answer: C", MCQ)
    assert (r.answer, r.ok) == ("C", True)
    r = parse_answer("##Reason: the car\n##Answer: green car", MCQ)  # not a letter: lenient, the value named
    assert not r.ok and "not in the exact form" in r.error


def test_answer_missing_reason_is_not_ok():
    r = parse_answer("##Answer: B\n##Reason:", MCQ)
    assert r.answer == "B" and not r.ok and r.lenient


def test_numeric_answers():
    assert parse_answer("##Answer: 3\n##Reason: three balls", NUMERIC).ok
    r = parse_answer("##Answer: 2.50\n##Reason: r", NUMERIC)
    assert (r.answer, r.ok) == ("2.5", True)
    for reply, value in [("3 balls", "3"), ("three", "3"), ("-4 points", "-4"), ("about 1,200", "1200")]:
        r = parse_answer(f"##Answer: {reply}\n##Reason: r", NUMERIC)
        assert (r.answer, r.ok, r.lenient) == (value, False, True)
    assert parse_answer("There are 4 balls.", NUMERIC).answer == "4"  # short reply: its number
    long_prose = "I looked at frames 1 to 16 and saw some balls bounce while 2 roll away slowly."
    assert parse_answer(long_prose, NUMERIC).answer == ""  # long prose without an answer phrase: no guess
    assert parse_answer("The answer is 4 balls.", NUMERIC).answer == "4"
    r = parse_answer("##Answer: many\n##Reason: r", NUMERIC)
    assert r.answer == "" and not r.ok and not r.lenient and r.error


def test_open_answers():
    r = parse_answer("##Answer: an ice cream\n##Reason: it falls at 00:12", OPEN)
    assert (r.answer, r.reason, r.ok) == ("an ice cream", "it falls at 00:12", True)
    r = parse_answer("An ice cream.\nIt falls on the floor.", OPEN)
    assert r.answer == "An ice cream." and r.lenient and not r.ok
    r = parse_answer("", OPEN)
    assert r.answer == "" and not r.ok and not r.lenient and r.error
    # an option letter where there are no options (MARL drifted the mini team's open answers into "A"): kept as the
    # answer, but not in the strict format
    for text in ("##Answer: A\n##Reason: r", "##Answer: C.\n##Reason: r"):
        r = parse_answer(text, OPEN)
        assert r.answer in ("A", "C.") and not r.ok and r.lenient
    assert parse_answer("##Answer: a\n##Reason: r", OPEN).ok  # a lower-case word is an answer


@pytest.mark.parametrize("text, span", [
    ("##Timestamp: [3 - 7.5]\n##Reason: he sits", (3.0, 7.5)),
    ("##Answer: he sits\n##Timestamp: [3 - 7.5]\n##Reason: he sits", (3.0, 7.5)),
    ("##Timestamp: [3s - 7.5s]\n##Reason: he sits", (3.0, 7.5)),
    ("##Answer: [3 - 7.5] ##Reason: he sits", (3.0, 7.5)),
])
def test_grounding_strict(text, span):
    r = parse_answer(text, GROUND)
    assert r.ok and r.span == span and r.answer == "[3 - 7.5]"


@pytest.mark.parametrize("text, span", [
    ("##Timestamp: [7.5 - 3]\n##Reason: he sits", (3.0, 7.5)),  # reversed: swapped, not ok
    ("##Timestamp: [3, 7.5]\n##Reason: x", (3.0, 7.5)),
    ("##Timestamp: 3-7.5\n##Reason: x", (3.0, 7.5)),
    ("##Timestamp: [00:03 - 00:07]\n##Reason: x", (3.0, 7.0)),
    ("##Answer: [1:02 - 1:10]\n##Reason: x", (62.0, 70.0)),
    ("##Answer: he sits\n##Reason: from 4 to 6", (4.0, 6.0)),
    ("He sits from 12.5 s to 20 s.", (12.5, 20.0)),
    ("##Timestamp: [12.5 seconds - 20 seconds]\n##Reason: x", (12.5, 20.0)),
    ("##Timestamp: [3 - 7.5]", (3.0, 7.5)),  # no reason
])
def test_grounding_lenient(text, span):
    r = parse_answer(text, GROUND)
    assert r.span == span and not r.ok and r.lenient
    assert r.answer == f"[{span[0]:g} - {span[1]:g}]"


def test_grounding_unreadable():
    r = parse_answer("##Timestamp: [s - e]\n##Reason: not sure", GROUND)
    assert r.answer == "" and r.span is None and not r.ok and r.error


def test_summary_parser():
    r = parse_summary("##Final Answer: B ##Reason Summary: three agents saw a blue car", MCQ)
    assert (r.answer, r.reason, r.ok) == ("B", "three agents saw a blue car", True)
    r = parse_summary("##Final Answer: [4 - 9]\n##Reason Summary: spans overlap", GROUND)
    assert r.ok and r.span == (4.0, 9.0)
    r = parse_summary("Final answer: option c\nReason summary: green", MCQ)
    assert r.answer == "C" and r.reason == "green" and r.lenient and not r.ok
    r = parse_summary("##Answer: B ##Reason: x", MCQ)  # the agent format, not the summary format
    assert r.answer == "B" and not r.ok
    r = parse_summary("", OPEN)
    assert r.answer == "" and not r.ok


# ----------------------------------------------------------------------------- times
@pytest.mark.parametrize("text, seconds", [
    ("01:30", 90.0), ("1:02:03", 3723.0), ("90s", 90.0), ("90 seconds", 90.0), ("at 75", 75.0),
    ("What happens at 02:15 in the video?", 135.0), ("1 minute 30 seconds", 90.0), ("1m30s", 90.0),
    ("2 min", 120.0), ("1 hour", 3600.0), ("75", 75.0), ("at 00:05.5", 5.5),
    ("three people", None), ("3 people", None), ("", None), ("12:75", None),
])
def test_parse_timestamp(text, seconds):
    assert parse_timestamp(text) == seconds


@pytest.mark.parametrize("text, span", [
    ("[12.5 - 20]", (12.5, 20.0)), ("[20, 12.5]", (12.5, 20.0)), ("5-10", (5.0, 10.0)),
    ("from 5 to 10.5 seconds", (5.0, 10.5)), ("01:05 - 01:20", (65.0, 80.0)), ("between 3s and 7s", (3.0, 7.0)),
    ("frames 1 2 3 show it, answer [4 - 6]", (4.0, 6.0)), ("[s - e]", None), ("nothing", None), ("", None),
])
def test_parse_span(text, span):
    assert parse_span(text) == span


@pytest.mark.parametrize("seconds, text", [(0, "00:00"), (89.6, "01:30"), (599, "09:59"), (3723, "1:02:03")])
def test_format_time(seconds, text):
    assert format_time(seconds) == text
    assert parse_timestamp(text) == round(seconds)


@pytest.mark.parametrize("bad", [-1.0, math.nan, math.inf])
def test_format_time_rejects_bad_values(bad):
    with pytest.raises(ValueError, match="format_time"):
        format_time(bad)


# ----------------------------------------------------------------------------- fuzz
_TOKENS = ["##", "#", "key info", "Key Info", "tool use", "tool call", ":", "<", ">", ",", "\n", " ", "Answer",
           "Reason", "Final Answer", "Reason Summary", "Timestamp", "[", "]", "-", "continue()", "add tool",
           "Video Retrieval", "rough browser", "Space", "Global Sampling", "Fine Browser", "Grounding Tool",
           "Time Stamp Retrieval", "Image Retrieval", "(", ")", "B", "e", "12", "3.5", "01:30", ":59", "to",
           "<think>", "</think>", "**", "option", "seconds", "\x00", "é", "🙂", "９", "\u202e", "Magic Lens"]
_VALID = [
    "##key info: the red ball near the door\n##tool use: <Video Retrieval>, <Image Retrieval>, <Fine Browser>",
    "##key info: all\n##tool use: <Fine Browser>, <Global Sampling>, <Video Retrieval>, <Image Retrieval>, "
    "<Time Stamp Retrieval>, <Rough Browser>, <Space Tool>, <Grounding Tool>, <Fine Browser>",
    "##tool call: add tool <Space Tool>\n##key info: where the lamp is",
    "##tool call: continue()",
    "##Answer: B\n##Reason: the frames at 00:12 show a blue car",
    "##Timestamp: [12.5 - 30]\n##Reason: he sits at 12.5 s",
    "##Final Answer: [01:02 - 01:09] ##Reason Summary: all agree",
    "##Answer: 42 ##Reason: counted",
]


def _fuzz_inputs(rng: random.Random) -> list[str]:
    out = []
    for _ in range(1200):  # random unicode, including surrogates-free planes and controls
        n = rng.randint(0, 80)
        out.append("".join(chr(rng.choice([rng.randint(0, 0x7F), rng.randint(0x80, 0xD7FF),
                                           rng.randint(0xE000, 0x10FFFF)])) for _ in range(n)))
    for _ in range(1800):  # random mixtures of the format tokens
        out.append("".join(rng.choice(_TOKENS) for _ in range(rng.randint(0, 30))))
    for v in _VALID:  # every truncation of every valid reply, and a few corrupted copies
        out += [v[:i] for i in range(len(v) + 1)]
        for _ in range(40):
            i = rng.randrange(len(v))
            out.append(v[:i] + rng.choice(_TOKENS) + v[i + rng.randint(0, 3):])
    out += ["##" * 5000, "9" * 3000 + " - " + "9" * 3000, "[" * 4000 + "1 - 2" + "]" * 4000,
            "##key info: " + "x " * 20000 + "##tool use: " + "<Rough Browser>, " * 3000,
            "add tool " * 3000, "01:" * 5000, " " * 40000 + "##Answer: B ##Reason: r"]
    return out


def _check_plan(r: PlanParse, enabled: list[str]) -> None:
    assert isinstance(r, PlanParse) and isinstance(r.plan, Plan)
    assert isinstance(r.ok, bool) and isinstance(r.lenient, bool)
    assert (r.error is None) if r.ok else isinstance(r.error, str)
    assert not (r.ok and r.lenient)
    assert "internal parser error" not in (r.error or "")
    tools = r.plan.tools
    assert isinstance(r.plan.key_info, str)
    assert 2 <= len(tools) <= MAX_PLAN_TOOLS and len(set(tools)) == len(tools)
    assert all(t in enabled for t in tools)
    groups = [t in SELECT_TOOLS for t in tools]
    assert groups[0] and not groups[-1] and groups == sorted(groups, reverse=True)


def _check_answer(r: AnswerParse, q: Question) -> None:
    assert isinstance(r, AnswerParse) and isinstance(r.answer, str) and isinstance(r.reason, str)
    assert isinstance(r.ok, bool) and isinstance(r.lenient, bool) and not (r.ok and r.lenient)
    assert (r.error is None) if r.ok else isinstance(r.error, str)
    assert "internal parser error" not in (r.error or "")
    if r.answer == "":
        assert not r.ok and not r.lenient and r.span is None
    if q.task == "mcq":
        assert r.answer in ("", "A", "B", "C", "D")
    elif q.task == "numeric":
        assert r.answer == "" or math.isfinite(float(r.answer))
    elif q.task == "grounding":
        if r.answer:
            s, e = r.span
            assert 0 <= s <= e and math.isfinite(e) and r.answer == f"[{s:.10g} - {e:.10g}]"
    else:
        assert r.span is None


def test_fuzz_parsers_never_raise_and_keep_invariants():
    rng = random.Random(1234)
    inputs = _fuzz_inputs(rng)
    assert len(inputs) > 3000
    n_ok = n_lenient = 0
    for i, text in enumerate(inputs):
        enabled = [t for t in ALL if rng.random() < 0.6]
        enabled += [rng.choice(SELECT_TOOLS)] if not any(t in SELECT_TOOLS for t in enabled) else []
        enabled += [rng.choice(BROWSE_TOOLS)] if not any(t in BROWSE_TOOLS for t in enabled) else []
        r = parse_plan(text, enabled, question=MCQ if i % 2 else None)
        _check_plan(r, enabled)
        d = parse_decision(text, enabled)
        assert isinstance(d, DecisionParse) and isinstance(d.decision, Decision)
        assert (d.error is None) if d.ok else isinstance(d.error, str)
        assert d.decision.action in ("continue", "add_tool")
        assert d.decision.action == "continue" or d.decision.tool in enabled
        q = QUESTIONS[i % len(QUESTIONS)]
        a, sm = parse_answer(text, q), parse_summary(text, q)
        _check_answer(a, q)
        _check_answer(sm, q)
        n_ok += r.ok + d.ok + a.ok + sm.ok
        n_lenient += r.lenient + d.lenient + a.lenient + sm.lenient
        t = parse_timestamp(text)
        assert t is None or (isinstance(t, float) and math.isfinite(t) and t >= 0)
        s = parse_span(text)
        assert s is None or (isinstance(s, tuple) and len(s) == 2 and s[0] <= s[1])
    # the fuzz really reaches the strict and lenient paths, not only the fallback
    assert n_ok > 10 and n_lenient > 300


def test_parsers_accept_non_str_inputs():
    for junk in (None, b"##Answer: B ##Reason: r", 12):
        _check_plan(parse_plan(junk, ALL), ALL)  # type: ignore[arg-type]
        assert parse_decision(junk, ALL).decision.action == "continue"  # type: ignore[arg-type]
    assert parse_answer(b"##Answer: B ##Reason: r", MCQ).answer == "B"  # type: ignore[arg-type]


# ----------------------------------------------------------------------------- prompts
def _text(msgs: list[dict]) -> str:
    assert all(set(m) == {"role", "content"} and m["role"] in ("system", "user") for m in msgs)
    assert all(isinstance(m["content"], str) and m["content"] for m in msgs)
    return "\n".join(m["content"] for m in msgs)


def test_render_question():
    text = prompts.render_question(MCQ)
    assert MCQ.text in text and "A: red car" in text and "D: a yellow bus" in text
    assert "Options" not in prompts.render_question(OPEN)
    assert len({prompts.render_question(q) for q in QUESTIONS}) == 4


def test_plan_prompt_content_and_example_parses_strictly():
    text = _text(prompts.plan_messages(MCQ, ALL))
    for needle in [MCQ.text, "A: red car", "##key info:", "##tool use:", *ALL]:
        assert needle in text
    example = text[text.rindex("##key info:"):]
    r = parse_plan(example, ALL)
    assert r.ok and r.plan.tools == ["Video Retrieval", "Rough Browser"]
    small = ["Image Retrieval", "Fine Browser"]
    text = _text(prompts.plan_messages(MCQ, small))
    assert "Video Retrieval" not in text and "Rough Browser" not in text
    assert parse_plan(text[text.rindex("##key info:"):], small).ok


def test_plan_prompt_rejects_unknown_tool():
    with pytest.raises(ValueError, match="Magic"):
        prompts.plan_messages(MCQ, ["Magic", "Rough Browser"])


def test_prompts_differ_per_task():
    for build in (lambda q: prompts.plan_messages(q, ALL), lambda q: prompts.answer_messages(q, "notes"),
                  lambda q: prompts.summary_messages(q, [("a", "B", "r")]),
                  lambda q: prompts.communicate_messages(q, "m", "", [], None, ALL)):
        assert len({_text(build(q)) for q in QUESTIONS}) == 4


def test_communicate_prompt():
    text = _text(prompts.communicate_messages(MCQ, "GS: a red car", "", ["Rough Browser"], "Rough Browser", ALL))
    for needle in [MCQ.text, "B: blue car", "##tool call: continue()", "##tool call: add tool <",
                   "##key info:", "GS: a red car", "No output from other agents is visible", "Rough Browser"]:
        assert needle in text
    text = _text(prompts.communicate_messages(MCQ, "", "agent2: the car is blue", [], None, ALL))
    assert "agent2: the car is blue" in text and "No output from other agents" not in text


@pytest.mark.parametrize("q, reply", [
    (MCQ, "##Answer: B\n##Reason: blue car"), (OPEN, "##Answer: a cone\n##Reason: r"),
    (NUMERIC, "##Answer: 3\n##Reason: r"), (GROUND, "##Timestamp: [1 - 2]\n##Reason: r"),
])
def test_answer_prompt_format_round_trips(q, reply):
    text = _text(prompts.answer_messages(q, "tool notes here"))
    assert q.text in text and "tool notes here" in text and "##Reason:" in text
    assert ("##Timestamp: [s - e]" in text) == (q.task == "grounding")
    assert ("##Answer:" in text) == (q.task != "grounding")
    assert parse_answer(reply, q).ok


def test_summary_prompt():
    answers = [("qwen-a", "B", "blue paint"), ("qwen-b", "(B)", "blue"), ("qwen-c", "A", "red")]
    text = _text(prompts.summary_messages(MCQ, answers))
    for needle in [MCQ.text, "qwen-a", "blue paint", "qwen-c", "##Final Answer:", "##Reason Summary:",
                   "Most common answer: B (2 of 3 agents)"]:
        assert needle in text
    tie = _text(prompts.summary_messages(MCQ, [("a", "A", ""), ("b", "B", "")]))
    assert "tied answers: A, B" in tie
    g = _text(prompts.summary_messages(GROUND, [("a", "[1 - 3]", "r"), ("b", "from 2 to 4", "r")]))
    assert "##Final Answer: [s - e]" in g and "[2 - 4]" in g
    o = _text(prompts.summary_messages(OPEN, [("a", "a cone", "r")]))
    assert "every agent" in o


@pytest.mark.parametrize("kind", ["rough", "fine", "space", "grounding"])
def test_browser_prompt(kind):
    text = prompts.browser_prompt(kind, MCQ, "the parked car", [0.0, 65.0, 3723.0], 128)
    for needle in [MCQ.text, "A: red car", "the parked car", "128 tokens", "01:05", "1:02:03"]:
        assert needle in text
    if kind == "grounding":
        assert "##Timestamp: [s - e]" in text and "65.0 s" in text
    else:
        assert "##Answer:" in text and "##Summary:" in text
    assert prompts.browser_prompt(kind, MCQ, "", [1.0], 64).count(MCQ.text) == 2  # key info falls back


def test_browser_prompts_differ_and_validate():
    texts = {k: prompts.browser_prompt(k, OPEN, "x", [1.0], 100) for k in prompts.BROWSER_KINDS}
    assert len(set(texts.values())) == 4
    with pytest.raises(ValueError, match="kind"):
        prompts.browser_prompt("zoom", OPEN, "x", [1.0], 100)
    with pytest.raises(ValueError, match="max_tokens"):
        prompts.browser_prompt("rough", OPEN, "x", [1.0], 0)
