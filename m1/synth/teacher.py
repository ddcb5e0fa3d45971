"""The rule-based teacher: a fixed policy for M1-Synth that can sit in any agent seat.

It reads only the prompt it is sent (never the world script or question metadata) and answers
every phase in the paper's formats:
- plan: picks tools from cues in the question wording (a stated time, "right after", "how many",
  "while both are visible", "when does ... [start - end]", ...), the fixed policy of earlier
  agent systems; with probability `error_rate` it writes a different, still valid plan instead;
- communicate: continues, except to repair an obvious gap (a selection step that errored, a
  selection tool with no browser after it, a browser that saw nothing, a question about the end
  of the video once the video's length is known);
- answer: the last confident browser answer in its own notes, else the most common confident
  answer among visible peers, else its own guess;
- summary: the most common answer (median span for grounding).
It is the baseline to beat, the source of SFT plans, and the offline team of `m1 demo`.
"""
from __future__ import annotations

import hashlib
import random
import re
import statistics
from collections import Counter

from m1.text import format_span, format_time, parse_span, parse_timestamp
from m1.models.base import ChatRequest, Completion, SamplingParams
from m1.registry import (FINE_BROWSER, GLOBAL_SAMPLING, GROUNDING_TOOL, IMAGE_RETRIEVAL, ROUGH_BROWSER, SPACE_TOOL,
                         TIME_STAMP_RETRIEVAL, VIDEO_RETRIEVAL)
from m1.synth import seed_rules

GS, VR, TSR, IR = (s.name for s in (GLOBAL_SAMPLING, VIDEO_RETRIEVAL, TIME_STAMP_RETRIEVAL, IMAGE_RETRIEVAL))
RB, FB, SPACE, GROUND = (s.name for s in (ROUGH_BROWSER, FINE_BROWSER, SPACE_TOOL, GROUNDING_TOOL))
SELECT, BROWSE = (GS, VR, TSR, IR), (RB, FB, SPACE, GROUND)
_OBJ = r"((?:[a-z]+ )?(?:square|circle|triangle|cross|shape|object))"
_TIME = re.compile(r"\b\d{1,2}:\d{2}(?::\d{2})?\b")


def _text(messages: list[dict]) -> str:
    return "\n".join(m["content"] if isinstance(m.get("content"), str) else str(m.get("content"))
                     for m in messages)


def _question(text: str) -> str:
    m = re.search(r"^Question: (.+)$", text, re.M)
    return m.group(1).strip() if m else ""


def plan_for(question: str) -> tuple[str, list[str]]:
    """(key info, tools) from the question's wording alone."""
    q = question.lower()
    obj = re.search(r"the " + _OBJ, q)
    thing = f"the {obj.group(1)}" if obj else question
    if _TIME.search(q) and "[start" not in q:
        t = _TIME.search(q).group(0)
        return f"the shape that appears at {t}", [TSR, RB]
    if "right after" in q or "right before" in q:
        return f"{thing} leaving", [VR, FB]
    if "how many" in q:
        m = re.search(r"how many times does (?:a|an|the) (.+?) appear", q)
        return (f"every {m.group(1)}" if m else thing), [IR, FB]
    if "while both" in q or re.search(r"\b(left|right|above|below)\b.*\?", q) or "relative to" in q:
        objs = re.findall(r"the " + _OBJ, q)
        key = " and ".join(f"the {o}" for o in objs[:2]) + " together" if len(objs) >= 2 else thing
        return key, [VR, SPACE]
    if "when does" in q or "[start" in q:
        return thing, [VR, GROUND]
    if "which way" in q or "move" in q:
        return f"{thing} moving", [VR, FB]
    if "near the end" in q:
        return "a brief flash near the end", [GS, FB]
    if "background" in q:
        return thing, [IR, RB]
    if "where in the frame" in q:
        return thing, [IR, FB]
    return thing, [GS, RB]


_NOTE = re.compile(r"^\[(?P<agent>[^\]]+)\] step (?P<step>\d+): (?P<tool>[A-Za-z ]+?)(?: \(frames "
                   r"(?P<span>[^)]*)\))?(?: answer: (?P<answer>.*?))? -> (?P<body>.*)$", re.M)


def _notes(block: str) -> list[dict]:
    return [m.groupdict() for m in _NOTE.finditer(block)]


def _confident(note: dict) -> bool:
    body, ans = note["body"].lower(), (note["answer"] or "").lower()
    return bool(ans) and "not seen" not in ans and "not found" not in ans and "guess" not in body \
        and not body.startswith("error")


class TeacherChatModel:
    """ChatModel protocol; `spec.error_rate` and `spec.seed` come from the team config.

    A chat of a seed kind (Weaver, VideoZoomer, SAGE: m1/team/single.py) goes to that kind's rule policy
    (m1/synth/seed_rules.py), which reads the frames it is sent; hence `accepts_images`."""

    accepts_images = True

    def __init__(self, spec=None, name: str = "teacher"):
        self.name = name
        self.error_rate = float(getattr(spec, "error_rate", 0.0) or 0.0)
        self.seed = int(getattr(spec, "seed", 0) or 0)
        self.plans = getattr(spec, "plans", "rules")
        self.calls = 0

    def generate(self, requests: list[ChatRequest], params: SamplingParams) -> list[Completion]:
        self.calls += 1

        return [Completion(text=seed_rules.reply(r.messages, getattr(r, "images", None))
                           if seed_rules.seed_kind(r.messages) else self.reply(r.messages)) for r in requests]

    # ---------------------------------------------------------------- phases
    def reply(self, messages: list[dict]) -> str:
        text = _text(messages)
        if "##Final Answer" in text:
            return self._summary(text)
        if "##tool call" in text:
            return self._communicate(text)
        if "##tool use" in text:
            return self._plan(text)
        return self._answer(text)

    def _rng(self, text: str) -> random.Random:
        h = hashlib.sha256(f"{self.seed}/{text}".encode()).hexdigest()
        return random.Random(int(h[:16], 16))

    def _plan(self, text: str) -> str:
        key, tools = plan_for(_question(text))
        rng = self._rng(text)
        if self.plans == "uniform":  # any valid pair, the rules' own included
            tools = list(rng.choice([(s, b) for s in SELECT for b in BROWSE]))
        elif rng.random() < self.error_rate:  # a deliberately poorer, still valid plan
            choices = [[s, b] for s in SELECT for b in BROWSE if [s, b] != tools]
            tools = rng.choice(choices)
        return f"##key info: {key}\n##tool use: " + ", ".join(f"<{t}>" for t in tools)

    def _communicate(self, text: str) -> str:
        own = text.split("Your notes so far:", 1)[-1].split("Notes from other agents:", 1)[0]
        notes = _notes(own)
        left = re.search(r"Tools left in your plan: (.*)", text)
        remaining = [] if not left or left.group(1).strip() == "none" else [
            t.strip() for t in left.group(1).split(",")]
        if not notes:
            return "##tool call: continue()"
        last, used = notes[-1], {n["tool"] for n in notes}
        q = _question(text).lower()
        if "near the end" in q and TSR not in used and last["tool"] == GS:
            end = re.search(r"\(00:00-(\d+:\d+(?::\d+)?)\)", last["body"])
            if end:
                t = max(0.0, (parse_timestamp(end.group(1)) or 0.0) - 30.0)
                return f"##tool call: add tool <{TSR}>\n##key info: the last half minute, at {format_time(t)}"
        if last["body"].lower().startswith("error") and last["tool"] in SELECT and GS not in used:
            return f"##tool call: add tool <{GS}>\n##key info: {_question(text)}"
        if last["tool"] in SELECT and not any(t in BROWSE for t in remaining) and not last["body"].startswith("error"):
            return f"##tool call: add tool <{FB}>\n##key info: {_question(text)}"
        if last["tool"] in BROWSE and not _confident(last) and not remaining and IR not in used \
                and "[start" not in q and "how many" not in q:
            return f"##tool call: add tool <{IR}>\n##key info: {_question(text)}"
        return "##tool call: continue()"

    def _answer(self, text: str) -> str:
        notes = _notes(text)
        q = _question(text)
        grounding = "##Timestamp" in text
        mcq = "Options:" in text
        if mcq:  # only option letters can answer a multiple-choice question
            notes = [n for n in notes if re.fullmatch(r"[A-Z]", (n["answer"] or "").strip())]
        me = re.search(r"^\[([^\]]+)\] plan:", text, re.M)  # the agent's own record comes first
        mine = [n for n in notes if me and n["agent"] == me.group(1)]
        own = [n for n in mine if _confident(n)]
        if own:
            ans, why = own[-1]["answer"], f"my {own[-1]['tool']} saw it"
        else:
            peers = Counter(n["answer"] for n in notes if n not in mine and _confident(n))
            if peers:
                ans, why = peers.most_common(1)[0][0], "taken from a peer whose browser saw it"
            else:
                guesses = [n["answer"] for n in mine if n["answer"]]
                ans, why = (guesses[-1] if guesses else ("A" if mcq else "0")), "a guess"
        if grounding:
            span = parse_span(ans or "")
            return f"##Timestamp: {format_span(span) if span else '[0 - 1]'}\n##Reason: {why} ({q})"
        return f"##Answer: {ans}\n##Reason: {why}"

    def _summary(self, text: str) -> str:
        answers = re.findall(r"^- [^:]+: answer (.*?); reason:", text, re.M)
        answers = [a for a in answers if a and a != "(none)"]
        if "[s - e]" in text.split("##Final Answer:")[-1][:20]:
            spans = [s for s in (parse_span(a) for a in answers) if s]
            if spans:
                s = statistics.median(x[0] for x in spans)
                e = statistics.median(x[1] for x in spans)
                return f"##Final Answer: {format_span((s, max(s, e)))}\n##Reason Summary: median of the agents' spans"
        if not answers:
            return "##Final Answer: unknown\n##Reason Summary: no agent answered"
        top = Counter(answers).most_common(1)[0][0]
        return f"##Final Answer: {top}\n##Reason Summary: most agents answered {top}"
