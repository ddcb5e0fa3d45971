"""Times and spans as agents write them and as M1 writes them: one place for every module that reads or prints a
time ('01:30', '90s', '1 minute 30 seconds') or a grounding span ('[12.5 - 20]').

Used by the parsers of agent replies, the tools (time stamps shown to agents), the shared memory, aggregation,
the benchmark loaders and metrics, and the teacher. Readers never raise on any text: what cannot be read is None.
"""
from __future__ import annotations

import math
import re

# Replies are at most a few thousand tokens; longer input is cut so every regex stays fast.
MAX_PARSE_CHARS = 32_000

__all__ = ["MAX_PARSE_CHARS", "STRICT_SPAN", "clean_reply", "parse_span", "parse_timestamp", "format_time",
           "format_span", "format_number"]


def clean_reply(text: object) -> str:
    """Any input to a bounded str without reasoning blocks; the one entry point of every parser."""
    if text is None:
        return ""
    if isinstance(text, (bytes, bytearray)):
        text = bytes(text).decode("utf-8", "replace")
    elif not isinstance(text, str):
        text = str(text)
    text = text[:MAX_PARSE_CHARS].replace("\x00", "")
    # Reasoning models write <think>...</think> first; the reply is what follows the last close.
    close = text.rfind("</think>")
    if close >= 0:
        text = text[close + len("</think>"):]
    return text.replace("<think>", "").strip()


_NUM = r"\d{1,9}(?:\.\d{1,6})?"
_CLOCK = r"\d{1,2}:\d{1,2}:\d{1,2}(?:\.\d{1,6})?|\d{1,4}:\d{1,2}(?:\.\d{1,6})?"
_TIME = rf"(?<![\d.:])(?:{_CLOCK}|{_NUM})(?![\d:])"
_SEC_UNIT = r"(?:seconds?|secs?|s)(?![A-Za-z])"
_SPAN = re.compile(
    rf"({_TIME})\s*(?:{_SEC_UNIT})?\s*(?:-|–|—|~|,|\bto\b|\buntil\b|\btill\b|\band\b)\s*({_TIME})",
    re.IGNORECASE)
_BRACKET = re.compile(r"\[([^\[\]]{0,80})\]")
STRICT_SPAN = re.compile(rf"\[\s*({_NUM})\s*s?\s*-\s*({_NUM})\s*s?\s*\]")


def _time_value(tok: str) -> float | None:
    """Seconds for '75', '75.5', '01:15', '1:02:03'; None for impossible clock values."""
    parts = tok.split(":")
    try:
        nums = [float(p) for p in parts]
    except ValueError:
        return None
    if len(nums) > 1 and any(n >= 60 for n in nums[1:]):
        return None
    total = 0.0
    for n in nums:
        total = total * 60 + n
    return total if math.isfinite(total) else None


def parse_span(text: str) -> tuple[float, float] | None:
    """(start, end) seconds from '[s - e]', '[s, e]', 's-e', 'from s to e', mm:ss forms.

    Bracketed spans win over spans in running text; a reversed span is swapped."""
    raw = clean_reply(text)
    for inner in _BRACKET.findall(raw):
        span = _span_in(inner)
        if span:
            return span
    return _span_in(raw)


def _span_in(s: str) -> tuple[float, float] | None:
    for m in _SPAN.finditer(s):
        a, b = _time_value(m.group(1)), _time_value(m.group(2))
        if a is not None and b is not None:
            return (a, b) if a <= b else (b, a)
    return None


_UNIT_RUN = re.compile(
    r"(?<![\d.])(?:\d{1,9}(?:\.\d{1,6})?\s*(?:hours?|hrs?|h|minutes?|mins?|m|seconds?|secs?|s)"
    r"(?![A-Za-z])[\s,]*(?:and\s+)?)+", re.IGNORECASE)
_UNIT_PAIR = re.compile(r"(\d{1,9}(?:\.\d{1,6})?)\s*([A-Za-z]+)")
_AT = re.compile(rf"\b(?:at|around|about|near|after)\s+(?:the\s+)?(?:time\s+)?({_NUM})(?![\d:])",
                 re.IGNORECASE)
_CLOCK_RE = re.compile(rf"(?<![\d.:])(?:{_CLOCK})(?![\d:])")


def parse_timestamp(text: str) -> float | None:
    """Seconds for a time stated in text: '01:30', '1:02:03', '90s', '90 seconds',
    '1 minute 30 seconds', 'at 75'; a bare number only when it is the whole text."""
    raw = clean_reply(text)
    for m in _CLOCK_RE.finditer(raw):
        v = _time_value(m.group(0))
        if v is not None:
            return v
    m = _UNIT_RUN.search(raw)
    if m:
        total = 0.0
        for num, unit in _UNIT_PAIR.findall(m.group(0)):
            u = unit.lower()
            total += float(num) * (3600 if u.startswith("h") else 60 if u.startswith("m") else 1)
        if math.isfinite(total):
            return total
    m = _AT.search(raw)
    if m:
        return float(m.group(1))
    if re.fullmatch(_NUM, raw):
        return float(raw)
    return None


def format_time(seconds: float) -> str:
    """'mm:ss' (or 'h:mm:ss' past an hour), rounded to the nearest second."""
    if not isinstance(seconds, (int, float)) or not math.isfinite(seconds) or seconds < 0:
        raise ValueError(f"format_time: seconds must be a finite number >= 0, got {seconds!r}")
    total = int(round(seconds))
    h, rem = divmod(total, 3600)
    m, s = divmod(rem, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m:02d}:{s:02d}"


def format_number(x: float) -> str:
    if x == int(x) and abs(x) < 1e15:
        return str(int(x))
    return format(x, ".10g")


def format_span(span: tuple[float, float]) -> str:
    """The canonical answer string of a grounding span: '[s - e]' in seconds."""
    return f"[{format_number(span[0])} - {format_number(span[1])}]"
