"""The parsing core both reply syntaxes share (m1/agents/reading.py): answer values, tool-name matching, the guard."""
from __future__ import annotations

import pytest

from m1.agents.parsers import canonical_tool
from m1.agents.reading import (
    closest_name, guarded, lenient_value, normalize_number, normalize_option, read_value, strict_value,
)
from m1.kinds.parsers import answer_value, canonical_name
from m1.schema import Question

MCQ = Question(id="q1", video="v.mp4", text="Which car?", options=["red car", "blue car", "green car"], task="mcq")
OPEN = Question(id="q2", video="v.mp4", text="What does the boy drop?", task="open")
GROUND = Question(id="q3", video="v.mp4", text="When does he sit?", task="grounding")
NUMERIC = Question(id="q4", video="v.mp4", text="How many balls?", task="numeric")


def _squash(s: str) -> str:
    return s.strip()


# ----------------------------------------------------------------------------- values
@pytest.mark.parametrize("value,question,expected", [
    ("B", MCQ, ("B", None)),
    ("D", MCQ, None),  # past the options
    ("(B)", MCQ, None),
    ("3", NUMERIC, ("3", None)),
    ("-2.50", NUMERIC, ("-2.5", None)),
    ("three", NUMERIC, None),
    ("1,000", NUMERIC, None),
    ("[3 - 7]", GROUND, ("[3 - 7]", (3.0, 7.0))),
    ("[7 - 3]", GROUND, None),  # end before start
    ("3 to 7", GROUND, None),
    ("  a ball ", OPEN, ("a ball", None)),
    ("   ", OPEN, None),
])
def test_strict_value(value, question, expected):
    assert strict_value(value, question, _squash) == expected


@pytest.mark.parametrize("value,question,expected", [
    ("(B)", MCQ, ("B", None, None)),
    ("the blue car", MCQ, ("B", None, None)),
    ("three balls", NUMERIC, ("3", None, None)),
    ("1,000", NUMERIC, ("1000", None, None)),
    ("12 to 20s", GROUND, ("[12 - 20]", (12.0, 20.0), None)),
    ("", OPEN, (None, None, "empty answer")),
])
def test_lenient_value(value, question, expected):
    assert lenient_value(value, question, _squash) == expected


def test_lenient_value_errors_name_the_task():
    assert lenient_value("none", NUMERIC, _squash)[2].startswith("no number in")
    assert lenient_value("soon", GROUND, _squash)[2].startswith("no [s - e] span in")
    assert lenient_value("Q", MCQ, _squash)[0] is None


def test_read_value_strict_first_then_lenient():
    assert read_value("B", MCQ, _squash) == ("B", None, True, None)
    assert read_value("(B)", MCQ, _squash) == ("B", None, False, None)
    assert read_value("[2 - 4]", GROUND, _squash) == ("[2 - 4]", (2.0, 4.0), True, None)
    assert read_value("x", NUMERIC, _squash)[:3] == (None, None, False)


def test_tidy_is_the_callers_rule_for_free_text():
    assert read_value(" a\n  ball ", OPEN, lambda s: " ".join(s.split())) == ("a ball", None, True, None)
    assert read_value(" a\n  ball ", OPEN, str.upper)[0] == " A\n  BALL "


def test_numbers_and_options():
    assert normalize_number("about 1,234.50 m") == "1234.5"
    assert normalize_number("twenty") == "20"
    assert normalize_number("none") is None
    assert normalize_option("B", ["x", "y"]) == ("B", True, None)
    assert normalize_option("option b", ["x", "y"]) == ("B", False, None)
    assert normalize_option("C", ["x", "y"])[0] is None


def test_both_syntaxes_read_a_value_alike():
    """The seed kinds and the CPP team give one answer for the same written value."""
    for value, q in (("B", MCQ), ("(c)", MCQ), ("7", NUMERIC), ("seven", NUMERIC), ("[1 - 2]", GROUND)):
        seed, seed_exact, _ = answer_value(value, q)
        assert seed == read_value(value, q, _squash)[0]
        assert seed_exact == read_value(value, q, _squash)[2]
    assert answer_value("\\boxed{B}", MCQ) == ("B", False, None)  # boxed: read, but not the exact form


# ----------------------------------------------------------------------------- tool names
def test_closest_name_exact_spelling_first():
    table = {"Rough Browser": {"roughbrowser", "roughbrowse"}, "Fine Browser": {"finebrowser"}}
    assert closest_name("roughbrowse", table, cutoff=0.8) == "Rough Browser"
    assert closest_name({"x", "finebrowser"}, table, cutoff=0.99) == "Fine Browser"


def test_closest_name_cutoff_is_the_callers():
    table = {"trim": ["trim"], "analyze": ["analyze"]}
    # ratio("trm", "trim") = 6/7 = 0.857; ratio("tim", "trim") likewise; ratio("tr", "trim") = 0.667
    assert closest_name("trm", table, cutoff=0.8) == "trim"
    assert closest_name("tr", table, cutoff=0.8) is None
    assert closest_name("tr", table, cutoff=0.6) == "trim"


def test_closest_name_ties():
    table = {"Alpha": ["abcx"], "Beta": ["abcy"]}
    assert closest_name("abcz", table, cutoff=0.7, unique=True) is None  # the CPP rule: ambiguous
    assert closest_name("abcz", table, cutoff=0.7, unique=False) == "Beta"  # get_close_matches: greatest spelling


def test_callers_keep_their_own_cutoffs():
    # "globalsamplin" is 0.96 like "globalsampling": both rules take it
    assert canonical_tool("Global Samplin") == "Global Sampling"
    assert canonical_name("spatial_trackin", ["spatial_tracking", "trim"]) == "spatial_tracking"
    # ratio("temporalgroundx", "temporalcount") = 0.786: between the seeds' 0.75 and the CPP 0.8
    assert canonical_name("temporal_groundx", ["temporal_count"]) == "temporal_count"
    assert closest_name("temporalgroundx", {"T": ["temporalcount"]}, cutoff=0.8) is None


# ----------------------------------------------------------------------------- guard
def test_guard_turns_an_exception_into_a_format_failure():
    def broken() -> str:
        raise KeyError("boom")

    assert guarded(lambda: "read", lambda err: err) == "read"
    assert guarded(broken, lambda err: err) == "internal parser error: KeyError: 'boom'"


def test_parsers_route_their_bugs_through_the_guard(monkeypatch):
    import m1.agents.parsers as cpp
    import m1.kinds.weaver as seeds

    def boom(*_):
        raise RuntimeError("bug")

    monkeypatch.setattr(cpp, "_parse_answer", boom)
    r = cpp.parse_answer("##Answer: B\n##Reason: r", MCQ)
    assert (r.ok, r.answer, r.error) == (False, "", "internal parser error: RuntimeError: bug")
    monkeypatch.setattr(seeds, "_parse_weaver", boom)
    s = seeds.parse_weaver("<answer>B</answer>", MCQ, ["trim"])
    assert (s.ok, s.answer, s.calls, s.error) == (False, None, [], "internal parser error: RuntimeError: bug")
