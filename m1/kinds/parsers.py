"""Readers of the seed kinds' replies: Weaver `<tool_call>{json}</tool_call>` / `<answer>`, VideoZoomer `<think>`
then `<video_zoom>{json}</video_zoom>` or `<answer>`, SAGE `<json>{...}</json>`.

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
from m1.registry import SAGE, WEAVER, ZOOMER
from m1.schema import Question
from m1.text import format_number, parse_span

MAX_REPLY = 20_000  # characters read of one reply; the rest is noise for any real format
MAX_CALLS = 8  # SAGE tool calls taken from one reply


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
def _tag(text: str, name: str, strict: bool) -> list[str]:
    """Contents of <name>...</name>; lenient: any case and spacing, and an unclosed last tag to the end."""
    if strict:
        return re.findall(rf"<{name}>(.*?)</{name}>", text, re.DOTALL)
    found = re.findall(rf"<\s*{name}\s*>(.*?)<\s*/\s*{name}\s*>", text, re.DOTALL | re.IGNORECASE)
    if not found:
        m = re.search(rf"<\s*{name}\s*>(.*)$", text, re.DOTALL | re.IGNORECASE)
        if m:
            found = [m.group(1)]
    return found


def _tags(text: str, name: str, errors: list[str]) -> list[str]:
    """Contents of the exact <name> tags, else of lenient ones (noted in `errors`: the reply is then not strict)."""
    found = _tag(text, name, strict=True)
    if found:
        return found
    found = _tag(text, name, strict=False)
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


def _answer_from_prose(text: str, question: Question) -> tuple[str | None, str | None]:
    """A last resort for a reply with no answer tag: 'answer: X' / 'answer is X'."""
    m = re.search(r"(?:final\s+)?answer\s*(?:is|:)\s*(.{1,80})", text, re.IGNORECASE)
    if not m:
        return None, "no answer tag"
    value, _, err = answer_value(m.group(1).strip().rstrip("."), question)
    return value, err


def _reason(text: str) -> str:
    think = _tag(text, "think", strict=False)
    body = think[0] if think else re.sub(r"<[^>]{1,40}>", " ", text)
    return " ".join(body.split())[:2000]


def _bounded(text: object) -> str:
    """Any input as a bounded str; unlike `clean_reply` the <think> block stays (VideoZoomer's format needs it)."""
    if text is None:
        return ""
    if isinstance(text, (bytes, bytearray)):
        text = bytes(text).decode("utf-8", "replace")
    return str(text)[:MAX_REPLY].replace("\x00", "")


def _guard(fn, text: str, *args) -> SeedReply:
    return guarded(lambda: fn(_bounded(text), *args), lambda err: SeedReply(error=err))


def _finish(reply: SeedReply, errors: list[str]) -> SeedReply:
    reply.error = "; ".join(dict.fromkeys(e for e in errors if e)) or None
    reply.ok = reply.error is None
    reply.lenient = not reply.ok and (reply.answer is not None or bool(reply.calls))
    return reply


# ----------------------------------------------------------------------------- Weaver
def _weaver_args(name: str, obj: dict) -> tuple[dict | None, str | None]:
    """Arguments of a Weaver tool, checked: query str; objects list of str; start/end floats."""
    if name == "trim":
        out = {}
        for key in ("start", "end"):
            v = obj.get(key)
            if v is None:
                continue
            try:
                out[key] = float(v)
            except (TypeError, ValueError):
                return None, f"trim {key} {v!r} is not a number"
            if not math.isfinite(out[key]):
                return None, f"trim {key} {v!r} is not finite"
        return out, None
    if name in ("spatial_tracking", "spatial_grounding"):
        objs = obj.get("objects")
        if isinstance(objs, str):
            objs = [x.strip() for x in objs.split(",") if x.strip()]
        if not isinstance(objs, list) or not objs or not all(isinstance(x, str) and x.strip() for x in objs):
            return None, f"{name} needs objects: a list of names"
        return {"objects": [x.strip() for x in objs][:8]}, None
    q = obj.get("query")
    if not isinstance(q, str) or not q.strip():
        return None, f"{name} needs a query string"
    return {"query": q.strip()[:300]}, None


def parse_weaver(text: str, question: Question, tools: Sequence[str]) -> SeedReply:
    """One `<tool_call>{"tool_name": ..., ...}</tool_call>` or one `<answer>...</answer>`."""
    return _guard(_parse_weaver, text, question, tools)


def _parse_weaver(raw: str, question: Question, tools: Sequence[str]) -> SeedReply:
    reply, errors = SeedReply(reason=_reason(raw)), []
    calls = _tags(raw, "tool_call", errors)
    answers = _tags(raw, "answer", errors)
    if calls:
        if len(calls) > 1:
            errors.append(f"{len(calls)} tool calls in one reply; the first is run")
        if answers:
            errors.append("a tool call and an answer in one reply; the tool call is run")
        obj, exact, err = loads_lenient(calls[0])
        if not exact:
            errors.append(err or "tool call JSON repaired")
        if isinstance(obj, dict):
            given = obj.get("tool_name", obj.get("name"))
            if "tool_name" not in obj:
                errors.append("tool call without tool_name")
            name = canonical_name(given, tools)
            if name is None:
                errors.append(f"unknown tool {str(given)[:40]!r} (tools: {', '.join(tools) or 'none'})")
            else:
                if name != given:
                    errors.append(f"tool name {str(given)[:40]!r} read as {name!r}")
                args, aerr = _weaver_args(name, obj.get("arguments", obj) if isinstance(obj.get("arguments"), dict)
                                          else obj)
                if args is None:
                    errors.append(aerr)
                else:
                    reply.calls = [ToolCall(name, args)]
        elif obj is not None:
            errors.append("tool call is not a JSON object")
        if reply.calls:
            return _finish(reply, errors)
    if answers:
        reply.raw_answer = answers[-1].strip()
        value, exact, err = answer_value(reply.raw_answer, question)
        reply.answer = value
        if not exact:
            errors.append(err or f"answer {reply.raw_answer[:40]!r} is not in the exact form for a {question.task} "
                                 f"answer")
        return _finish(reply, errors)
    value, err = _answer_from_prose(raw, question)
    reply.answer = value
    errors.append("no <tool_call> and no <answer>" + (f" ({err})" if err and not value else ""))
    return _finish(reply, errors)


# ----------------------------------------------------------------------------- VideoZoomer
def _zoom_args(obj: object) -> tuple[dict | None, str | None]:
    if not isinstance(obj, dict):
        return None, "zoom request is not a JSON object"
    seg = obj.get("segment")
    if isinstance(seg, str):
        span = parse_span(seg)
        seg = list(span) if span else None
    if seg is None and "start" in obj and "end" in obj:
        seg = [obj.get("start"), obj.get("end")]
    try:
        s, e = (float(x) for x in seg)  # type: ignore[union-attr]
        fps = float(obj.get("fps"))
    except (TypeError, ValueError):
        return None, "zoom needs segment [start, end] and fps as numbers"
    if not all(math.isfinite(x) for x in (s, e, fps)):
        return None, "zoom numbers must be finite"
    return {"segment": [s, e], "fps": fps}, None


def parse_zoomer(text: str, question: Question) -> SeedReply:
    """`<think>...</think>` then one `<video_zoom>{"segment": [s, e], "fps": n}</video_zoom>` or one
    `<answer>...</answer>`."""
    return _guard(_parse_zoomer, text, question)


def _parse_zoomer(raw: str, question: Question) -> SeedReply:
    reply, errors = SeedReply(reason=_reason(raw)), []
    if not re.match(r"\s*<think>.*?</think>", raw, re.DOTALL):
        errors.append("the reply does not open with <think>...</think>")
    zooms = _tags(raw, "video_zoom", errors)
    answers = _tags(raw, "answer", errors)
    if zooms:
        if answers:
            errors.append("a zoom and an answer in one reply; the zoom is run")
        if len(zooms) > 1:
            errors.append(f"{len(zooms)} zooms in one reply; the first is run")
        obj, exact, err = loads_lenient(zooms[0])
        if not exact:
            errors.append(err or "zoom JSON repaired")
        args, aerr = _zoom_args(obj)
        if args is not None:
            if exact and not (isinstance(obj.get("segment"), list) and "fps" in obj):
                errors.append("zoom JSON not in the exact form")
            reply.calls = [ToolCall("video_zoom", args)]
            return _finish(reply, errors)
        errors.append(aerr)
    if answers:
        reply.raw_answer = answers[-1].strip()
        value, exact, err = answer_value(reply.raw_answer, question)
        reply.answer = value
        if not exact:
            errors.append(err or "answer not in the exact form")
        return _finish(reply, errors)
    value, err = _answer_from_prose(raw, question)
    reply.answer = value
    errors.append("no <video_zoom> and no <answer>" + (f" ({err})" if err and not value else ""))
    return _finish(reply, errors)


# ----------------------------------------------------------------------------- SAGE
def parse_sage(text: str, question: Question, tools: Sequence[str]) -> SeedReply:
    """One `<json>{...}</json>` object: `final_answer` (answer) and/or `recommended_tools.tool_calls` (calls).
    A final answer is taken only when no tool is asked for (`needed` false or no calls)."""
    return _guard(_parse_sage, text, question, tools)


def _parse_sage(raw: str, question: Question, tools: Sequence[str]) -> SeedReply:
    reply, errors = SeedReply(), []
    blocks = _tag(raw, "json", strict=True)
    if not blocks:
        blocks = _tag(raw, "json", strict=False) or [raw]
        errors.append("no exact <json>...</json> block")
    obj, exact, err = loads_lenient(blocks[0])
    if not exact:
        errors.append(err or "JSON repaired")
    if not isinstance(obj, dict):
        value, perr = _answer_from_prose(raw, question)
        reply.answer, reply.reason = value, " ".join(raw.split())[:2000]
        errors.append("no JSON object" + (f" ({perr})" if perr and not value else ""))
        return _finish(reply, errors)
    ans = obj.get("answerable")
    if isinstance(ans, dict):
        reply.reason = " ".join(str(ans.get("reasoning", "")).split())[:2000]
    for key in ("video_context", "query_intent"):
        if not reply.reason and isinstance(obj.get(key), str):
            reply.reason = " ".join(obj[key].split())[:2000]
    if "final_answer" not in obj:
        errors.append("no final_answer key")
    rec = obj.get("recommended_tools")
    calls: list[ToolCall] = []
    needed = False
    if isinstance(rec, dict):
        needed = bool(rec.get("needed", bool(rec.get("tool_calls"))))
        raw_calls = rec.get("tool_calls") or []
        if not isinstance(raw_calls, list):
            errors.append("tool_calls is not a list")
            raw_calls = []
        for c in raw_calls[:MAX_CALLS]:
            if not isinstance(c, dict):
                errors.append("a tool call is not an object")
                continue
            given = c.get("name")
            name = canonical_name(given, tools)
            if name is None:
                errors.append(f"unknown tool {str(given)[:40]!r} (tools: {', '.join(tools) or 'none'})")
                continue
            if name != given:
                errors.append(f"tool name {str(given)[:40]!r} read as {name!r}")
            args = c.get("arguments", {})
            if not isinstance(args, dict):
                errors.append(f"{name}: arguments are not an object")
                continue
            calls.append(ToolCall(name, {str(k): v for k, v in args.items()}))
        if len(raw_calls) > MAX_CALLS:
            errors.append(f"{len(raw_calls)} tool calls; the first {MAX_CALLS} are run")
    elif rec is not None:
        errors.append("recommended_tools is not an object")
    final = obj.get("final_answer")
    if calls and needed:
        reply.calls = calls
        return _finish(reply, errors)
    if final is not None and not (isinstance(final, str) and final.strip().lower() in ("", "null", "none")):
        value, vexact, verr = answer_value(final, question)
        reply.raw_answer, reply.answer = str(final), value
        if not vexact:
            errors.append(verr or "final_answer not in the exact form")
        if calls:
            errors.append("tool calls with needed false; the final answer is taken")
        return _finish(reply, errors)
    if calls:  # needed left out or false, but calls given and no answer: run them
        errors.append("tool calls without needed: true")
        reply.calls = calls
        return _finish(reply, errors)
    errors.append("neither a final_answer nor a tool call")
    return _finish(reply, errors)


def parse_zoomer_turn(text: str, question: Question, tools: Sequence[str]) -> SeedReply:
    """`parse_zoomer`, with its zoom refused when the run has not enabled video_zoom."""
    reply = parse_zoomer(text, question)
    if reply.calls and "video_zoom" not in tools:
        reply.calls = []
        reply.ok, reply.error = False, "; ".join(x for x in (reply.error, "video_zoom is not enabled") if x)
    return reply


PARSERS = {WEAVER: parse_weaver, ZOOMER: parse_zoomer_turn, SAGE: parse_sage}


def parse_reply(kind: str, text: str, question: Question, tools: Sequence[str]) -> SeedReply:
    return PARSERS[kind](text, question, tools)
