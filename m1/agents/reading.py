"""The parsing core every reply parser shares: answer values, tool names, and the never-raise guard.

M1 reads two syntaxes: the CPP team's `##` markers (m1/agents/parsers.py) and the seed kinds' tags and JSON
(m1/kinds/parsers.py). They differ in where an answer or a tool name is written, not in what "3", "(B)",
"[12 - 20]" or "Rough Browsr" means; that reading lives here once, so both formats score an answer alike and a fix
to it reaches both. Each parser module keeps only its own syntax (markers, tags, folding of its tool names, the
tidying of free text) and passes that in. It sits in m1/agents, the lower layer of its two users (docs/layout.md).
"""
from __future__ import annotations

import difflib
import math
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import TypeVar

from m1.schema import LETTERS, Question
from m1.text import STRICT_SPAN, format_number, format_span, parse_span

__all__ = ["CLOSED_TASKS", "STRICT_NUMBER", "normalize_number", "normalize_option", "strict_value",
           "lenient_value", "read_value", "closest_name", "guarded"]

Span = tuple[float, float]
T = TypeVar("T")

# Tasks whose answer has one canonical form (letter, number, span); any other task is free text.
CLOSED_TASKS = ("mcq", "numeric", "grounding")


# ----------------------------------------------------------------------------- numbers
_WORD_NUMBERS = {w: i for i, w in enumerate(
    "zero one two three four five six seven eight nine ten eleven twelve thirteen fourteen "
    "fifteen sixteen seventeen eighteen nineteen twenty".split())}
_NUMBER = re.compile(r"(?<![\w.])[-+]?(?:\d{1,3}(?:,\d{3})+|\d{1,15})(?:\.\d{1,9})?(?!\d)")
_WORD_NUMBER = re.compile(r"\b(" + "|".join(_WORD_NUMBERS) + r")\b", re.IGNORECASE)
STRICT_NUMBER = re.compile(r"[-+]?\d{1,15}(?:\.\d{1,9})?")  # the exact numeric answer: bounded, so always finite


def normalize_number(s: str) -> str | None:
    """The first number in `s` as a canonical string ('3', '2.5'); number words up to twenty."""
    m = _NUMBER.search(s)
    if m:
        x = float(m.group(0).replace(",", ""))
        return format_number(x) if math.isfinite(x) else None
    m = _WORD_NUMBER.search(s)
    return str(_WORD_NUMBERS[m.group(1).lower()]) if m else None


# ----------------------------------------------------------------------------- options
def _norm_text(s: str) -> str:
    s = re.sub(r"^\s*[A-Z]\s*[.:)]\s+", "", s)
    return " ".join(re.findall(r"[a-z0-9]+", s.lower()))


def normalize_option(raw: str, options: Sequence[str]) -> tuple[str | None, bool, str | None]:
    """(letter, exact, error) for an MCQ reply: 'B' is exact; '(B)', 'B.', 'Option B', 'b'
    and the option's own text are read leniently; a letter past the options is invalid.
    With no options every letter A-Z counts as valid."""
    valid = LETTERS[:len(options)] if options else LETTERS
    s = raw.strip().strip("*`'\" ").strip()
    s = s.splitlines()[0].strip() if s else ""
    if re.fullmatch(r"[A-Z]", s):
        return (s, True, None) if s in valid else (None, False, f"option {s} is not one of {valid[0]}-{valid[-1]}")
    letter = None
    kw = r"(?:(?i:the)\s+)?(?:(?i:correct|final|best)\s+)?(?i:answer|option|choice)\s*(?:(?i:is)\s*)?[:\-]?\s*"
    for pat in (r"[\(\[]\s*([A-Za-z])\s*[\)\]](?:\W.*)?",  # (B) or (B) text
                r"([A-Za-z])\s*[.:)\]](?:\s.*)?",  # B. / B: / B) text
                r"([A-Za-z])",  # b
                kw + r"[\(\[]?\s*([A-Z])\s*[\)\]]?(?:[\s.,;:].*)?",  # Option B / answer is B
                kw + r"[\(\[]?([a-z])(?:[.):\]].*)?"):  # option b. / answer (b)
        m = re.fullmatch(pat, s, re.DOTALL)
        if m:
            letter = m.group(1).upper()
            break
    if letter is not None:
        if letter in valid:
            return letter, False, None
        err = f"option {letter} is not one of {valid[0]}-{valid[-1]}"
    else:
        err = None
    if options:
        ns = _norm_text(s)
        normed = [_norm_text(o) for o in options]
        for i, no in enumerate(normed):
            if no and ns == no:
                return LETTERS[i], False, None
        hits = [(len(no), i) for i, no in enumerate(normed) if len(no) >= 2 and f" {no} " in f" {ns} "]
        if hits:
            hits.sort(reverse=True)
            top = normed[hits[0][1]]
            # one option named, or several where the shorter ones are only parts of the longest
            if all(normed[i] != top and f" {normed[i]} " in f" {top} " for _, i in hits[1:]):
                return LETTERS[hits[0][1]], False, None
            err = err or "reply names more than one option"
    m = re.match(r"([A-Z])\s+\S", s)  # "B red ball": an uppercase letter opening the reply
    if letter is None and m and m.group(1) in valid:
        return m.group(1), False, None
    return None, False, err or f"no option letter in {s[:40]!r}"


# ----------------------------------------------------------------------------- answer values
def strict_value(value: str, question: Question, tidy: Callable[[str], str]) -> tuple[str, Span | None] | None:
    """(answer, span) if `value` is exactly the canonical form for the task, else None: a valid option letter, a
    plain number, `[s - e]` with s <= e, or non-blank text, which `tidy` (the syntax's own rule) cleans."""
    task = question.task
    if task == "mcq":
        valid = LETTERS[:len(question.options)] if question.options else LETTERS
        return (value, None) if re.fullmatch(r"[A-Z]", value) and value in valid else None
    if task == "numeric":
        if STRICT_NUMBER.fullmatch(value):
            x = float(value)
            return (format_number(x), None) if math.isfinite(x) else None
        return None
    if task == "grounding":
        m = STRICT_SPAN.fullmatch(value)
        if not m:
            return None
        s, e = float(m.group(1)), float(m.group(2))
        return (format_span((s, e)), (s, e)) if s <= e else None
    return (tidy(value), None) if value.strip() else None


def lenient_value(value: str, question: Question,
                  tidy: Callable[[str], str]) -> tuple[str | None, Span | None, str | None]:
    """(answer or None, span, error): the answer read from loosely written text ('(B)', 'three', '12 to 20s')."""
    task = question.task
    if task == "mcq":
        letter, _, err = normalize_option(value, question.options)
        return letter, None, err
    if task == "numeric":
        num = normalize_number(value)
        return num, None, None if num else f"no number in {value[:40]!r}"
    if task == "grounding":
        span = parse_span(value)
        return (format_span(span), span, None) if span else (None, None, f"no [s - e] span in {value[:40]!r}")
    text = tidy(value)
    return (text or None), None, None if text else "empty answer"


def read_value(value: str, question: Question,
               tidy: Callable[[str], str]) -> tuple[str | None, Span | None, bool, str | None]:
    """(answer or None, span, exact, error): the strict reading when it matches (exact), else the lenient one."""
    sv = strict_value(value, question, tidy)
    if sv is not None:
        return sv[0], sv[1], True, None
    answer, span, err = lenient_value(value, question, tidy)
    return answer, span, False, err


# ----------------------------------------------------------------------------- tool names
def _similarity(a: str, b: str, cutoff: float) -> float | None:
    """difflib's ratio of a to b when it reaches `cutoff`, else None (the cheap upper bounds are tried first, so a
    long junk name costs little)."""
    sm = difflib.SequenceMatcher(None, a, b)
    if sm.real_quick_ratio() < cutoff or sm.quick_ratio() < cutoff:
        return None
    r = sm.ratio()
    return r if r >= cutoff else None


def closest_name(written: str | Iterable[str], spellings: Mapping[str, Iterable[str]], cutoff: float,
                 unique: bool = True) -> str | None:
    """The name one of whose spellings equals a written form (first in `spellings` order), else the name whose
    spelling is most like one (difflib ratio >= `cutoff`), else None.

    `written` and `spellings` (name -> its keys) come already folded: how to fold (case, punctuation, aliases) is
    each syntax's own rule. `unique=True` (the CPP rule): a tie for the best is ambiguous and gives None.
    `unique=False` (the seed kinds' rule): exactly `difflib.get_close_matches(n=1)`, whose ratio puts the known
    spelling first (difflib's ratio depends on the order) and whose tie goes to the greatest spelling."""
    forms = [written] if isinstance(written, str) else list(written)
    for name, keys in spellings.items():
        if any(k in forms for k in keys):
            return name
    hits = []  # (score, spelling, name) at or above the cutoff
    for name, keys in spellings.items():
        for key in keys:
            for w in forms:
                score = _similarity(w, key, cutoff) if unique else _similarity(key, w, cutoff)
                if score is not None:
                    hits.append((score, key, name))
    if not hits:
        return None
    if not unique:
        return max(hits, key=lambda h: (h[0], h[1]))[2]
    best: dict[str, float] = {}
    for score, _, name in hits:
        best[name] = max(score, best.get(name, 0.0))
    top = max(best.values())
    winners = [name for name, score in best.items() if score == top]
    return winners[0] if len(winners) == 1 else None


# ----------------------------------------------------------------------------- guard
def guarded(read: Callable[[], T], failed: Callable[[str], T]) -> T:
    """`read()`, or `failed(error)` when it raises: a parser bug becomes a format failure whose error names it
    (the reply scores as unreadable) instead of an exception that would end a whole rollout."""
    try:
        return read()
    except Exception as exc:  # recorded, not swallowed: the error names the bug
        return failed(f"internal parser error: {type(exc).__name__}: {exc}")
