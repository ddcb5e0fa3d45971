"""What the seed kinds' reply parsers share (each kind's own parser is in its module: m1/kinds/weaver.py, ...).

As for the CPP parsers (m1/agents/parsers.py): the strict format first, then a lenient reading (any case, code
fences, single quotes, trailing commas, unclosed tags, fuzzy tool names, `\\boxed{}`), never raising. `ok` is
True only when the strict format matched and nothing had to be corrected; it is the format signal a reward
would use. A reply that cannot be read gives no call and no answer, with `error` saying why.
"""
from __future__ import annotations

import ast
import json
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass, field

from m1.agents.reading import closest_name, guarded, read_value
from m1.schema import Question
from m1.text import format_number

MAX_REPLY = 20_000  # characters read of one reply; the rest is noise for any real format


@dataclass
class ToolCall:
    name: str
    args: dict


@dataclass
class SeedReply:
    calls: list[ToolCall] = field(default_factory=list)
    answer: str | None = None  # normalised to the question's task (letter, number, [s - e], text)
    reason: str = ""
    ok: bool = False
    lenient: bool = False
    error: str | None = None
    raw_answer: str | None = None  # the answer as written


# ----------------------------------------------------------------------------- shared pieces
def tag(text: str, name: str, strict: bool) -> list[str]:
    """Contents of <name>...</name>; lenient: any case and spacing, and an unclosed last tag to the end."""
    if strict:
        return re.findall(rf"<{name}>(.*?)</{name}>", text, re.DOTALL)
    found = re.findall(rf"<\s*{name}\s*>(.*?)<\s*/\s*{name}\s*>", text, re.DOTALL | re.IGNORECASE)
    if not found:
        m = re.search(rf"<\s*{name}\s*>(.*)$", text, re.DOTALL | re.IGNORECASE)
        if m:
            found = [m.group(1)]
    return found


def tags(text: str, name: str, errors: list[str]) -> list[str]:
    """Contents of the exact <name> tags, else of lenient ones (noted in `errors`: the reply is then not strict)."""
    found = tag(text, name, strict=True)
    if found:
        return found
    found = tag(text, name, strict=False)
    if found:
        errors.append(f"{name} tag not exact")
    return found


def _json_candidates(s: str) -> list[str]:
    s = s.strip()
    out = [s]
    fence = re.search(r"```(?:json)?\s*(.*?)```", s, re.DOTALL)
    if fence:
        out.append(fence.group(1).strip())
    a, b = s.find("{"), s.rfind("}")
    if a >= 0 and b > a:
        out.append(s[a:b + 1])
    if a >= 0:  # cut off: close what is open
        tail = s[a:]
        missing = tail.count("{") - tail.count("}")
        if 0 < missing <= 50:
            out.append(tail + "}" * missing)
    return out


def loads_lenient(s: str) -> tuple[object | None, bool, str | None]:
    """(value, exact, error): `json.loads` of `s` (exact), else of a repaired form (code fence, outermost braces,
    curly quotes, trailing commas, Python literals). Never raises."""
    try:
        return json.loads(s), True, None
    except Exception:  # noqa: BLE001 - anything unreadable falls through to the repairs
        pass
    for cand in _json_candidates(s):
        fixed = (cand.replace("\u201c", '"').replace("\u201d", '"').replace("\u2018", "'")
                 .replace("\u2019", "'"))
        fixed = re.sub(r",\s*([}\]])", r"\1", fixed)
        try:
            return json.loads(fixed), False, None
        except Exception:  # noqa: BLE001
            pass
        try:
            py = re.sub(r"\btrue\b", "True", re.sub(r"\bfalse\b", "False", re.sub(r"\bnull\b", "None", fixed)))
            if len(py) < 5000:
                return ast.literal_eval(py), False, None
        except Exception:  # noqa: BLE001 - literal_eval raises many kinds on noise
            pass
    return None, False, f"not JSON: {s.strip()[:60]!r}"


def canonical_name(name: object, tools: Sequence[str]) -> str | None:
    """A tool name as the kind spells it: exact, or after case/space/dash folding, or a close spelling (difflib
    ratio >= 0.75, the greatest spelling on a tie: m1/agents/reading.py)."""
    if not isinstance(name, str) or not name.strip() or not tools:
        return None
    if name in tools:
        return name

    def fold(x: str) -> str:
        return re.sub(r"[^a-z]", "", x.lower())

    spellings = {t: [k] for k, t in {fold(t): t for t in tools}.items()}  # one tool a folded key; the last wins
    return closest_name(fold(name), spellings, cutoff=0.75, unique=False)


_BOXED = re.compile(r"\\boxed\{(.*)\}", re.DOTALL)


def answer_value(raw: object, question: Question) -> tuple[str | None, bool, str | None]:
    """(answer normalised to the task, exact, error). Exact: a letter (mcq), a plain number (numeric), `[s - e]`
    (grounding), non-empty text (open)."""
    if raw is None:
        return None, False, "no answer"
    if isinstance(raw, bool):
        raw = str(raw)
    if isinstance(raw, (int, float)):
        raw = format_number(float(raw)) if math.isfinite(float(raw)) else str(raw)
    if isinstance(raw, list) and len(raw) == 2 and all(isinstance(x, (int, float)) for x in raw):
        raw = f"[{raw[0]} - {raw[1]}]"
    if not isinstance(raw, str):
        return None, False, f"answer of type {type(raw).__name__}"
    value = raw.strip()
    boxed = _BOXED.search(value)
    if boxed:
        value = boxed.group(1).strip()
    answer, _, strict, err = read_value(value, question, _one_line)
    return answer, strict and boxed is None, err


def _one_line(text: str) -> str:
    """Free text as one bounded line: the seed kinds' tidying of an open answer."""
    return " ".join(text.split())[:2000]


def answer_from_prose(text: str, question: Question) -> tuple[str | None, str | None]:
    """A last resort for a reply with no answer tag: 'answer: X' / 'answer is X'."""
    m = re.search(r"(?:final\s+)?answer\s*(?:is|:)\s*(.{1,80})", text, re.IGNORECASE)
    if not m:
        return None, "no answer tag"
    value, _, err = answer_value(m.group(1).strip().rstrip("."), question)
    return value, err


def reason_of(text: str) -> str:
    think = tag(text, "think", strict=False)
    body = think[0] if think else re.sub(r"<[^>]{1,40}>", " ", text)
    return " ".join(body.split())[:2000]


def _bounded(text: object) -> str:
    """Any input as a bounded str; unlike `clean_reply` the <think> block stays (VideoZoomer's format needs it)."""
    if text is None:
        return ""
    if isinstance(text, (bytes, bytearray)):
        text = bytes(text).decode("utf-8", "replace")
    return str(text)[:MAX_REPLY].replace("\x00", "")


def guard(fn, text: str, *args) -> SeedReply:
    return guarded(lambda: fn(_bounded(text), *args), lambda err: SeedReply(error=err))


def finish(reply: SeedReply, errors: list[str]) -> SeedReply:
    reply.error = "; ".join(dict.fromkeys(e for e in errors if e)) or None
    reply.ok = reply.error is None
    reply.lenient = not reply.ok and (reply.answer is not None or bool(reply.calls))
    return reply
