"""Readers for what the policy agents write: plans, decisions, answers and summaries.

Every parser tries the strict format first (the exact `##` markers the prompts ask for), then
a lenient reading (any case and spacing, markdown noise, fuzzy tool names, free text), and
never raises on any text: a reply that cannot be read gives a safe fallback value with
`ok=False` and an `error` saying what was wrong. `ok` feeds the format reward, so it is True
only when the strict format matched and nothing had to be corrected.
"""
from __future__ import annotations

import functools
import re
from collections.abc import Sequence
from dataclasses import dataclass

from m1.agents.reading import (
    CLOSED_TASKS, closest_name, guarded, lenient_value, normalize_number, normalize_option, strict_value,
)
from m1.registry import BROWSE_TOOLS, GLOBAL_SAMPLING, ROUGH_BROWSER, SELECT_TOOLS, TOOL_NAMES, TOOLS
from m1.schema import LETTERS, Decision, Plan, Question
from m1.text import clean_reply, format_span, format_time, parse_span, parse_timestamp

ALL_TOOLS = TOOL_NAMES  # every registered tool's name (a live view: tools registered later count too)
DEFAULT_SELECT = GLOBAL_SAMPLING.name
DEFAULT_BROWSE = ROUGH_BROWSER.name
MAX_PLAN_TOOLS = 5
_MAX_FIELD = 2_000  # longest key info / reason / open answer we keep
_MAX_TOOL_PIECES = 40  # a plan holds at most 5 tools; longer lists are noise

__all__ = [
    "ALL_TOOLS", "MAX_PLAN_TOOLS", "PlanParse", "DecisionParse", "AnswerParse",
    "parse_plan", "parse_decision", "parse_answer", "parse_summary", "canonical_tool", "tool_group",
]  # times and spans: m1/text.py; numbers, options and answer values: m1/agents/reading.py


# ----------------------------------------------------------------------------- results
@dataclass
class PlanParse:
    plan: Plan
    ok: bool
    lenient: bool
    error: str | None = None


@dataclass
class DecisionParse:
    decision: Decision
    ok: bool
    lenient: bool
    error: str | None = None


@dataclass
class AnswerParse:
    answer: str
    reason: str
    span: tuple[float, float] | None
    ok: bool
    lenient: bool
    error: str | None = None


def _join(errors: list[str]) -> str | None:
    return "; ".join(dict.fromkeys(errors)) if errors else None  # repeated notes once


# ----------------------------------------------------------------------------- text helpers
def _squash(s: str, limit: int = _MAX_FIELD) -> str:
    """One tidy line-ish field: markdown emphasis and surrounding quotes/brackets removed."""
    s = s.strip().strip("*`").strip()
    s = re.sub(r"[ \t]+", " ", s)
    return s[:limit].strip()


_LENIENT_HEADER = re.compile(
    r"(?:#{1,6}[ \t]*\**[ \t]*|^[ \t]*(?:[-*>][ \t]*)?\**[ \t]*)"
    r"(final[ \t_]*answer|reason[ \t_]*summary|key[ \t_-]*info(?:rmation)?|tool[ \t_-]*use|"
    r"tool[ \t_-]*call|time[ \t_-]*stamp|answer|reason|summary)"
    r"[ \t]*\**[ \t]*[:：]",
    re.IGNORECASE | re.MULTILINE,
)


def _label(raw: str) -> str:
    lab = re.sub(r"[^a-z]", "", raw.lower())
    return "keyinfo" if lab.startswith("keyinfo") else lab


def _sections(text: str) -> list[tuple[str, str]]:
    """(label, content) for every header-like marker, in order; content runs to the next marker."""
    marks = list(_LENIENT_HEADER.finditer(text))
    out = []
    for i, m in enumerate(marks):
        end = marks[i + 1].start() if i + 1 < len(marks) else len(text)
        content = text[m.end():end].strip().lstrip("*").strip()
        out.append((_label(m.group(1)), content))
    return out


def _first(sections: list[tuple[str, str]], *labels: str) -> str | None:
    for want in labels:
        for lab, content in sections:
            if lab == want:
                return content
    return None


def _strict_sections(text: str, labels: Sequence[str]) -> list[str] | None:
    """Contents if `text` is exactly `##<label>: ...` for each label, in order, each once."""
    pos, out = 0, []
    for i, lab in enumerate(labels):
        marker = f"##{lab}:"
        if not text.startswith(marker, pos):
            return None
        start = pos + len(marker)
        if i + 1 < len(labels):
            nxt = text.find(f"##{labels[i + 1]}:", start)
            if nxt < 0:
                return None
        else:
            nxt = len(text)
        content = text[start:nxt]
        if "##" in content:
            return None
        out.append(content.strip())
        pos = nxt
    return out


# ----------------------------------------------------------------------------- tools
def _tool_key(s: str) -> str:
    return re.sub(r"[^a-z0-9]", "", s.lower())


def _keys_for(tool: str) -> set[str]:
    k = _tool_key(tool)
    keys = {k}
    if k.endswith("tool") and len(k) > 4:
        keys.add(k[:-4])
    keys.update(TOOLS[tool].aliases if tool in TOOLS else ())
    return keys


def tool_group(name: str) -> str | None:
    """'select' or 'browse' for one of the eight exact tool names, else None."""
    if name in SELECT_TOOLS:
        return "select"
    if name in BROWSE_TOOLS:
        return "browse"
    return None


def canonical_tool(name: object, enabled_tools: Sequence[str] | None = None) -> str | None:
    """The exact enabled tool a loosely written name refers to, or None.

    Ignores case, spacing, punctuation, angle brackets, a trailing "tool" and parenthesised
    remarks; knows a few aliases (the paper's "Uniform Sampling"); then allows near-misses
    (difflib ratio >= 0.8, one unique best: m1/agents/reading.py) and a unique prefix
    ("Rough Browser for 16 frames").
    """
    if not isinstance(name, str):
        return None
    cands = list(enabled_tools) if enabled_tools is not None else list(ALL_TOOLS)
    text = re.sub(r"\([^()]*\)", " ", name[:200])
    k = _tool_key(text)[:64]
    if not k:
        return None
    variants = {k}
    if k.endswith("tool") and len(k) > 4:
        variants.add(k[:-4])
    for stop in ("the", "use"):
        if k.startswith(stop) and len(k) > len(stop) + 3:
            variants.add(k[len(stop):])
    table = {t: _keys_for(t) for t in cands if isinstance(t, str)}
    close = closest_name(variants, table, cutoff=0.8, unique=True)
    if close is not None:
        return close
    prefixed = {t for t, keys in table.items() for key in keys if len(key) >= 8 and k.startswith(key)}
    if len(prefixed) == 1:
        return prefixed.pop()
    return None


@functools.lru_cache(maxsize=4)
def _mention_pattern(names: tuple[str, ...]) -> re.Pattern[str]:
    words = [re.findall(r"[A-Za-z]+", t) for t in names] + [["uniform", "sampling"]]
    alts = sorted((r"[\s_-]*".join(w) for w in words), key=len, reverse=True)
    return re.compile(r"(?<![A-Za-z])(?:" + "|".join(alts) + r")(?![A-Za-z])", re.IGNORECASE)


def _mentions(text: str) -> list[str]:
    """Every full tool name written anywhere in `text` (any case/spacing), in order."""
    out = []
    for m in _mention_pattern(tuple(ALL_TOOLS)).finditer(text):
        t = canonical_tool(m.group(0), ALL_TOOLS)
        if t:
            out.append(t)
    return out


def _enabled(enabled_tools: Sequence[str] | None) -> list[str]:
    """Validated enabled tools (config error, not reply error: raises with the bad name)."""
    if enabled_tools is None:
        return list(ALL_TOOLS)
    tools = list(enabled_tools)
    bad = [t for t in tools if t not in ALL_TOOLS]
    if bad:
        raise ValueError(f"enabled_tools: unknown tool(s) {bad} (known: {list(ALL_TOOLS)})")
    if not any(t in SELECT_TOOLS for t in tools) or not any(t in BROWSE_TOOLS for t in tools):
        raise ValueError(f"enabled_tools {tools}: a plan needs at least one selection tool "
                         f"{list(SELECT_TOOLS)} and one browsing tool {list(BROWSE_TOOLS)}")
    return tools


# ----------------------------------------------------------------------------- plan
_STRICT_TOOL_LIST = re.compile(r"<[^<>\n]+>(?:[ \t]*,[ \t]*<[^<>\n]+>)*")
_ANGLE = re.compile(r"<([^<>\n]{1,80})>")
_TOOL_SPLIT = re.compile(r"[,;\n/|+]|->|=>|→|>\s*<|\bthen\b|\band\b", re.IGNORECASE)


def _fallback_plan(enabled: list[str], question: Question | str | None) -> Plan:
    key = question.text if isinstance(question, Question) else (question or "")
    sel = next(t for t in enabled if t in SELECT_TOOLS)
    brw = next(t for t in enabled if t in BROWSE_TOOLS)
    return Plan(key_info=_squash(key), tools=[sel, brw])


def _enforce_plan(names: list[str], enabled: list[str], notes: list[str]) -> list[str]:
    """Apply the plan rules: dedupe, selection before browsing, one of each, at most 5 tools."""
    seen: list[str] = []
    for n in names:
        if n in seen:
            notes.append(f"duplicate tool {n!r} dropped")
        else:
            seen.append(n)
    sel = [n for n in seen if n in SELECT_TOOLS]
    brw = [n for n in seen if n in BROWSE_TOOLS]
    if seen and seen != sel + brw:
        notes.append("reordered: selection tools must come before browsing tools")
    if not sel:
        d = DEFAULT_SELECT if DEFAULT_SELECT in enabled else next(t for t in enabled if t in SELECT_TOOLS)
        sel = [d]
        notes.append(f"no selection tool: added {d!r}")
    if not brw:
        d = DEFAULT_BROWSE if DEFAULT_BROWSE in enabled else next(t for t in enabled if t in BROWSE_TOOLS)
        brw = [d]
        notes.append(f"no browsing tool: added {d!r}")
    n_sel = min(len(sel), MAX_PLAN_TOOLS - 1)
    n_brw = min(len(brw), MAX_PLAN_TOOLS - n_sel)
    if len(sel) + len(brw) > MAX_PLAN_TOOLS:
        notes.append(f"plan of {len(sel) + len(brw)} tools cut to {MAX_PLAN_TOOLS}")
    return sel[:n_sel] + brw[:n_brw]


def _resolve_tools(pieces: list[str], enabled: list[str], notes: list[str]) -> list[str]:
    names = []
    for p in pieces:
        p = p.strip().strip("<>*`'\"[]").strip()
        p = re.sub(r"^\d+[.)]\s*", "", p)
        if not p:
            continue
        t = canonical_tool(p, enabled)
        if t:
            names.append(t)
            continue
        known = canonical_tool(p, ALL_TOOLS)
        if known:
            notes.append(f"tool {known!r} is not enabled: dropped")
            continue
        found = _mentions(p)
        if found:
            for f in found:
                if f in enabled:
                    names.append(f)
                else:
                    notes.append(f"tool {f!r} is not enabled: dropped")
        else:
            notes.append(f"unknown tool {p[:40]!r} dropped")
    return names


def parse_plan(text: str, enabled_tools: Sequence[str] | None = None,
               question: Question | str | None = None) -> PlanParse:
    """Read `##key info: ...` / `##tool use: <A>, <B>` into a Plan that always obeys the rules.

    `question` (optional) supplies the fallback key info when none can be read."""
    enabled = _enabled(enabled_tools)
    return guarded(lambda: _parse_plan(clean_reply(text), enabled, question),
                   lambda err: PlanParse(_fallback_plan(enabled, question), ok=False, lenient=False, error=err))


def _parse_plan(raw: str, enabled: list[str], question: Question | str | None) -> PlanParse:
    notes: list[str] = []
    strict = _strict_sections(raw, ("key info", "tool use"))
    if strict and strict[0] and _STRICT_TOOL_LIST.fullmatch(strict[1]):
        names = _ANGLE.findall(strict[1])
        if all(n in enabled for n in names):
            tools = _enforce_plan(names, enabled, notes)
            return PlanParse(Plan(key_info=_squash(strict[0]), tools=tools), ok=not notes,
                             lenient=False, error=_join(notes))
    secs = _sections(raw)
    ki = _first(secs, "keyinfo")
    tu = _first(secs, "tooluse")
    if tu is not None:
        pieces = [p for p in _TOOL_SPLIT.split(tu) if p and p.strip()]
        if len(pieces) > _MAX_TOOL_PIECES:
            notes.append(f"tool list of {len(pieces)} entries: only the first {_MAX_TOOL_PIECES} read")
        names = _resolve_tools(pieces[:_MAX_TOOL_PIECES], enabled, notes)
    else:
        found = _mentions(raw)
        names = [t for t in found if t in enabled]
        notes.extend(f"tool {t!r} is not enabled: dropped" for t in dict.fromkeys(found) if t not in enabled)
    key_info = _squash(ki).strip("<>").strip() if ki else ""
    if not key_info and not names:
        fb = _fallback_plan(enabled, question)
        return PlanParse(fb, ok=False, lenient=False,
                         error=_join(["no ##key info or ##tool use could be read; fallback plan"] + notes))
    errors = ["format not strict (markers, spelling or tool names)"]
    if not key_info:
        key_info = _fallback_plan(enabled, question).key_info
        errors.append("missing ##key info: used the question")
    if tu is None:
        errors.append("missing ##tool use: tools taken from mentions in the text")
    tools = _enforce_plan(names, enabled, notes)
    return PlanParse(Plan(key_info=key_info, tools=tools), ok=False, lenient=True, error=_join(errors + notes))


# ----------------------------------------------------------------------------- decision
_STRICT_ADD = re.compile(r"add tool[ \t]*<([^<>\n]+)>")
_ADD = re.compile(r"add[\s_-]*tool", re.IGNORECASE)
_CONTINUE = re.compile(r"(?<![A-Za-z])continue(?![A-Za-z])", re.IGNORECASE)


def parse_decision(text: str, enabled_tools: Sequence[str] | None = None) -> DecisionParse:
    """Read `##tool call: continue()` or `##tool call: add tool <X>` + `##key info: ...`.

    Fallback is `continue`: an unreadable reply leaves the plan as it was."""
    enabled = _enabled(enabled_tools)
    return guarded(lambda: _parse_decision(clean_reply(text), enabled),
                   lambda err: DecisionParse(Decision(action="continue"), ok=False, lenient=False, error=err))


def _parse_decision(raw: str, enabled: list[str]) -> DecisionParse:
    strict = _strict_sections(raw, ("tool call",))
    if strict and strict[0] == "continue()":
        return DecisionParse(Decision(action="continue"), ok=True, lenient=False)
    strict = _strict_sections(raw, ("tool call", "key info"))
    if strict:
        m = _STRICT_ADD.fullmatch(strict[0])
        if m and m.group(1) in enabled and strict[1]:
            return DecisionParse(Decision(action="add_tool", tool=m.group(1), key_info=_squash(strict[1])),
                                 ok=True, lenient=False)
    secs = _sections(raw)
    tc = _first(secs, "toolcall")
    region = tc if tc is not None else raw
    ki = _first(secs, "keyinfo")
    key_info = (_squash(ki).strip("<>").strip() or None) if ki else None
    m_add, m_cont = _ADD.search(region), _CONTINUE.search(region)
    errors = ["format not strict"]
    if tc is None:
        errors.append("missing ##tool call")
    if m_add and (not m_cont or m_add.start() < m_cont.start()):
        rest = re.split(r"\n|##", region[m_add.end():m_add.end() + 200], maxsplit=1)[0]
        rest_clean = re.sub(r"tool[\s_]*name\s*=", " ", rest, flags=re.IGNORECASE)
        rest_clean = rest_clean.strip().strip("()[]<>'\"*`:= ").strip()
        tool = canonical_tool(rest_clean, enabled)
        if tool is None:
            tool = next((t for t in _mentions(rest) if t in enabled), None)
        if tool is None:
            known = canonical_tool(rest_clean, ALL_TOOLS) or next(iter(_mentions(rest)), None)
            why = f"tool {known!r} is not enabled" if known else f"unknown tool {rest_clean[:40]!r}"
            return DecisionParse(Decision(action="continue"), ok=False, lenient=False,
                                 error=_join(errors + [f"add tool: {why}; kept the plan (continue)"]))
        if key_info is None:
            errors.append("add tool without ##key info")
        return DecisionParse(Decision(action="add_tool", tool=tool, key_info=key_info), ok=False,
                             lenient=True, error=_join(errors))
    if m_cont:
        return DecisionParse(Decision(action="continue"), ok=False, lenient=True, error=_join(errors))
    return DecisionParse(Decision(action="continue"), ok=False, lenient=False,
                         error="no continue() or add tool found; fallback continue")


# ----------------------------------------------------------------------------- options in prose
_ANSWER_PHRASE = re.compile(
    r"(?:answer|option|choice)\s*(?:is|would be|should be|:|=)\s*[:\-]?\s*(.{1,80})", re.IGNORECASE)
_PAREN_LETTER = re.compile(r"\(([A-Z])\)")


def _letter_in_free_text(text: str, options: Sequence[str]) -> tuple[str | None, str | None]:
    """Best-effort option letter from prose with no ##Answer marker."""
    valid = LETTERS[:len(options)] if options else LETTERS
    for m in _ANSWER_PHRASE.finditer(text):
        letter, _, _ = normalize_option(m.group(1).split(",")[0], options)
        if letter:
            return letter, None
    letters = {x for x in _PAREN_LETTER.findall(text) if x in valid}
    if len(letters) == 1:
        return letters.pop(), None
    letter, _, err = normalize_option(text, options)
    return letter, err


# ----------------------------------------------------------------------------- answers
def parse_answer(text: str, question: Question) -> AnswerParse:
    """Read `##Answer: ... ##Reason: ...` (grounding: `##Timestamp: [s - e]` + `##Reason:`)."""
    return _read_answer(text, question, summary=False)


def parse_summary(text: str, question: Question) -> AnswerParse:
    """Read `##Final Answer: ... ##Reason Summary: ...` with the same answer normalisation."""
    return _read_answer(text, question, summary=True)


def _read_answer(text: str, question: Question, summary: bool) -> AnswerParse:
    return guarded(lambda: _parse_answer(clean_reply(text), question, summary),
                   lambda err: AnswerParse("", "", None, ok=False, lenient=False, error=err))


def _strict_value(value: str, question: Question) -> tuple[str, tuple[float, float] | None] | None:
    """The answer if `value` is exactly in the canonical form for the task (m1/agents/reading.py), else None."""
    if question.task not in CLOSED_TASKS and not question.options and _BARE_LETTER.fullmatch(value.strip()):
        return None  # an option letter for a question without options: the answer kept, the format failed
    return strict_value(value, question, _squash)


_BARE_LETTER = re.compile(r"[A-Z][.)]?")


def answer_in_form(answer: str | None, question: Question) -> bool:
    """Whether a team's final answer is in the exact form for its question's task (a letter of its options, a span,
    a number, a text that is not a bare option letter): what a results row's `answer_ok` says, so a null answer or
    an open question answered "D" is flagged and counted, never silent."""
    return bool(answer) and _strict_value(str(answer), question) is not None


def _parse_answer(raw: str, question: Question, summary: bool) -> AnswerParse:
    strict, strict_note = _parse_strict_answer(raw, question, summary)
    if strict is not None:
        return strict
    return _parse_lenient_answer(raw, question, summary, strict_note)


def _answer_labels(summary: bool) -> tuple[str, str]:
    """The answer's and the reason's section labels: a summary's, or an agent's answer's."""
    return ("Final Answer", "Reason Summary") if summary else ("Answer", "Reason")


def _parse_strict_answer(raw: str, question: Question, summary: bool) -> tuple[AnswerParse | None, str | None]:
    """(the answer, None) when the reply has the exact sections in one of the accepted layouts, each value in its
    exact form; else (None, why the first layout found fell short, or None when none was found)."""
    task = question.task
    ans_lab, rsn_lab = _answer_labels(summary)
    layouts = [(ans_lab, rsn_lab)]
    if task == "grounding" and not summary:
        # the span may sit in ##Timestamp (what the prompt asks) or, equally exact, in ##Answer
        layouts = [("Timestamp", "Reason"), ("Answer", "Timestamp", "Reason"), ("Answer", "Reason")]
    # evidence first: the reason (what was read) before the answer is as strict as the answer first
    layouts += [(lab[-1], *lab[:-1]) for lab in layouts]
    for labels in layouts:
        got = _strict_sections(raw, labels)
        if got is None:
            continue
        fields = dict(zip(labels, got))
        value = fields["Timestamp"] if "Timestamp" in fields else fields[ans_lab]
        reason = fields[rsn_lab]
        sv = _strict_value(value, question)
        if sv is not None and reason:
            return AnswerParse(sv[0], _squash(reason), sv[1], ok=True, lenient=False), None
        return None, (f"{'Timestamp' if 'Timestamp' in fields else ans_lab} value {value[:40]!r} is not in the exact "
                      f"form for a {task} answer"
                      if sv is None else f"empty ##{rsn_lab}")
    return None, None


def _parse_lenient_answer(raw: str, question: Question, summary: bool, strict_note: str | None) -> AnswerParse:
    """The answer read from loose sections or from prose: never ok (the format failed), lenient when a value was
    found."""
    secs = _sections(raw)
    ans_labels = ("finalanswer", "answer") if summary else ("answer", "finalanswer")
    rsn_labels = ("reasonsummary", "reason", "summary") if summary else ("reason", "reasonsummary", "summary")
    ans = _first(secs, *ans_labels)
    reason = _first(secs, *rsn_labels)
    if reason is None:
        reason = raw if not secs else " ".join(c for lab, c in secs if lab not in ans_labels + ("timestamp",))
    reason = _squash(reason)
    errors = [strict_note or "format not strict"]
    if not secs:
        errors.append(f"no ##{_answer_labels(summary)[0]} marker")
    value, span, err = _lenient_answer_value(raw, secs, ans, question)
    if value is None:
        return AnswerParse("", reason, None, ok=False, lenient=False,
                           error=_join(errors + [err or "no answer found"]))
    return AnswerParse(value, reason, span, ok=False, lenient=True, error=_join(errors))


def _lenient_answer_value(raw: str, secs: list[tuple[str, str]], ans: str | None, question: Question
                          ) -> tuple[str | None, tuple[float, float] | None, str | None]:
    """(value, span, error): a grounding span from ##Timestamp, ##Answer or the whole reply; else the ##Answer
    section's value; else, with no answer section, a letter, number or first line found in the prose."""
    task = question.task
    value = span = err = None
    if task == "grounding":
        ts = _first(secs, "timestamp")
        for cand in (ts, ans, raw):
            if cand:
                value, span, err = lenient_value(cand, question, _squash)
                if value:
                    break
    elif ans is not None:
        value, span, err = lenient_value(ans, question, _squash)
        if value is None and task == "mcq":
            value, free_err = _letter_in_free_text(ans, question.options)
            err = err or free_err if value is None else None
    elif task == "mcq":
        value, err = _letter_in_free_text(raw, question.options)
    elif task == "numeric":
        m = _ANSWER_PHRASE.search(raw)
        value = normalize_number(m.group(1)) if m else None
        if value is None and len(raw) <= 40:
            value = normalize_number(raw)
        err = None if value else "no number found"
    else:
        first_line = next((ln for ln in raw.splitlines() if ln.strip()), "")
        value = _squash(first_line) or None
        err = None if value else "empty reply"
    return value, span, err
