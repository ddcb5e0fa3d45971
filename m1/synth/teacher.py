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
from typing import NamedTuple

from m1.evidence import ChatEvidence, ReplyBuilder, TextBuilder
from m1.text import format_span, format_time, parse_span, parse_timestamp
from m1.models.base import ChatRequest, Completion, SamplingParams
from m1.registry import (FINE_BROWSER, GLOBAL_SAMPLING, GROUNDING_TOOL, IMAGE_RETRIEVAL, ROUGH_BROWSER, SPACE_TOOL,
                         TIME_STAMP_RETRIEVAL, VIDEO_RETRIEVAL)
from m1.kinds.rules import chat_kind
from m1.synth import seed_rules

GS, VR, TSR, IR = (s.name for s in (GLOBAL_SAMPLING, VIDEO_RETRIEVAL, TIME_STAMP_RETRIEVAL, IMAGE_RETRIEVAL))
RB, FB, SPACE, GROUND = (s.name for s in (ROUGH_BROWSER, FINE_BROWSER, SPACE_TOOL, GROUNDING_TOOL))
SELECT, BROWSE = (GS, VR, TSR, IR), (RB, FB, SPACE, GROUND)
_OBJ = r"((?:[a-z]+ )?(?:square|circle|triangle|cross|shape|object))"
_TIME = re.compile(r"\b\d{1,2}:\d{2}(?::\d{2})?\b")


def _text(messages: list[dict]) -> str:
    return "\n".join(m["content"] if isinstance(m.get("content"), str) else str(m.get("content"))
                     for m in messages)


class _Prompt:
    """The chat as the rules read it (its messages' contents joined by newlines), and where each string content
    sits in that text, so that a span the rules read can be named by its message (m1/evidence.py ChatEvidence)."""

    def __init__(self, messages: list[dict]):
        self.text = _text(messages)
        self.contents: list[str | None] = [m["content"] if isinstance(m.get("content"), str) else None
                                           for m in messages]
        self.starts, at = [], 0
        for m in messages:
            self.starts.append(at)
            at += len(m["content"] if isinstance(m.get("content"), str) else str(m.get("content"))) + 1

    def sources(self, spans) -> list[tuple[int, int, int] | None]:
        return [self.source(s) for s in spans]

    def source(self, span: tuple[int, int]) -> tuple[int, int, int] | None:
        """(message, start, end) of a span of the text; None when it does not lie inside one string content."""
        a, b = span
        for i, (start, content) in enumerate(zip(self.starts, self.contents)):
            if content is not None and start <= a and b <= start + len(content):
                return i, a - start, b - start
        return None


def _question_at(text: str) -> tuple[str, tuple[int, int]]:
    """The question line's text and its span in `text` (empty, (0, 0) when there is none)."""
    m = re.search(r"^Question: (.+)$", text, re.M)
    if not m:
        return "", (0, 0)
    raw = m.group(1)
    start = m.start(1) + len(raw) - len(raw.lstrip())
    return raw.strip(), (start, start + len(raw.strip()))


class KeyPlan(NamedTuple):
    """A plan from the question's wording: the key info, the tools, and the key's copied stretches as (key span,
    question span) pairs."""

    key: str
    tools: list[str]
    copies: tuple[tuple[tuple[int, int], tuple[int, int]], ...]


def key_plan(question: str) -> KeyPlan:
    """(key info, tools) from the question's wording alone, with the key's copies of the question's words."""
    q = question.lower()
    same = len(q) == len(question)  # lower() kept every character where it was: q's spans are the question's
    key, copies = TextBuilder(), []

    def copy(span: tuple[int, int], text: str = q) -> None:
        at = key.add(text[span[0]:span[1]])
        if same or text is question:
            copies.append((at, span))

    obj = re.search(r"the " + _OBJ, q)
    thing = lambda: copy(obj.span()) if obj else copy((0, len(question)), question)  # noqa: E731
    done = lambda tools: KeyPlan(key.text, tools, tuple(copies))  # noqa: E731
    if _TIME.search(q) and "[start" not in q:
        key.add("the shape that appears at ")
        copy(_TIME.search(q).span())
        return done([TSR, RB])
    if "right after" in q or "right before" in q:
        thing(), key.add(" leaving")
        return done([VR, FB])
    if "how many" in q:
        m = re.search(r"how many times does (?:a|an|the) (.+?) appear", q)
        if m:
            key.add("every "), copy(m.span(1))
        else:
            thing()
        return done([IR, FB])
    if "while both" in q or re.search(r"\b(left|right|above|below)\b.*\?", q) or "relative to" in q:
        objs = list(re.finditer(r"the " + _OBJ, q))
        if len(objs) >= 2:
            copy(objs[0].span()), key.add(" and "), copy(objs[1].span()), key.add(" together")
        else:
            thing()
        return done([VR, SPACE])
    if "when does" in q or "[start" in q:
        thing()
        return done([VR, GROUND])
    if "which way" in q or "move" in q:
        thing(), key.add(" moving")
        return done([VR, FB])
    if "near the end" in q:
        key.add("a brief flash near the end")
        return done([GS, FB])
    thing()
    if "background" in q:
        return done([IR, RB])
    if "where in the frame" in q:
        return done([IR, FB])
    return done([GS, RB])


_NOTE = re.compile(r"^\[(?P<agent>[^\]]+)\] step (?P<step>\d+): (?P<tool>[A-Za-z ]+?)(?: \(frames "
                   r"(?P<span>[^)]*)\))?(?: answer: (?P<answer>.*?))? -> (?P<body>.*)$", re.M)


def _notes(block: str, offset: int = 0) -> list[dict]:
    """The notes in `block` (which starts at `offset` of the prompt's text), each with where its answer value and
    body sit in that text (`answer_at`, `body_at`)."""
    return [{**m.groupdict(), "answer_at": tuple(x + offset for x in m.span("answer")),
             "body_at": tuple(x + offset for x in m.span("body")), "tool_at": tuple(x + offset for x in m.span("tool"))}
            for m in _NOTE.finditer(block)]


_DOUBT = re.compile(r"[^.]*\b(?:not visible|not seen|not found|guess|error)[^.]*", re.I)


def _doubt_at(note: dict) -> list[tuple[int, int]]:
    """Where a note says its browser did not see the answer (the value `not seen`, the body's sentence that says
    so): the words an `add tool` decision after it is read from."""
    spans = [note["answer_at"]] if re.search(r"not seen|not found", note["answer"] or "", re.I) else []
    m = _DOUBT.search(note["body"])
    if m:
        spans.append((note["body_at"][0] + m.start(), note["body_at"][0] + m.end()))
    return spans


def _confident(note: dict) -> bool:
    body, ans = note["body"].lower(), (note["answer"] or "").lower()
    return bool(ans) and "not seen" not in ans and "not found" not in ans and "guess" not in body \
        and not body.startswith("error")


class TeacherChatModel:
    """ChatModel protocol; `spec.error_rate` and `spec.seed` come from the team config.

    A chat of a seed kind (Weaver, VideoZoomer, SAGE: m1/team/single.py) goes to that kind's rule policy
    (m1/synth/seed_rules.py runs it), which reads the frames it is sent; hence `accepts_images`."""

    accepts_images = True

    def __init__(self, spec=None, name: str = "teacher"):
        self.name = name
        self.error_rate = float(getattr(spec, "error_rate", 0.0) or 0.0)
        self.seed = int(getattr(spec, "seed", 0) or 0)
        self.plans = getattr(spec, "plans", "rules")
        self.calls = 0

    def generate(self, requests: list[ChatRequest], params: SamplingParams) -> list[Completion]:
        self.calls += 1
        out = []
        for r in requests:
            if chat_kind(r.messages):
                text, evidence = seed_rules.write(r.messages, getattr(r, "images", None))
            else:
                text, evidence = self.write(r.messages)
            out.append(Completion(text=text, evidence=evidence))
        return out

    # ---------------------------------------------------------------- phases
    def reply(self, messages: list[dict]) -> str:
        return self.write(messages)[0]

    def write(self, messages: list[dict]) -> tuple[str, tuple[ChatEvidence, ...]]:
        """The reply, and where it reads the messages (m1/evidence.py ChatEvidence), recorded as it is written."""
        prompt = _Prompt(messages)
        text = prompt.text
        if "##Final Answer" in text:
            return self._summary(prompt)
        if "##tool call" in text:
            return self._communicate(prompt)
        if "##tool use" in text:
            return self._plan(prompt)
        return self._answer(prompt)

    def _rng(self, text: str) -> random.Random:
        h = hashlib.sha256(f"{self.seed}/{text}".encode()).hexdigest()
        return random.Random(int(h[:16], 16))

    def _plan(self, prompt: _Prompt):
        text, out = prompt.text, ReplyBuilder()
        question, (q0, _) = _question_at(text)
        key, tools, copies = key_plan(question)
        rng = self._rng(text)
        if self.plans == "uniform":  # any valid pair, the rules' own included
            tools = list(rng.choice([(s, b) for s in SELECT for b in BROWSE]))
        elif rng.random() < self.error_rate:  # a deliberately poorer, still valid plan
            choices = [[s, b] for s in SELECT for b in BROWSE if [s, b] != tools]
            tools = rng.choice(choices)
        out.add("##key info: ")
        k0, _ = out.add(key)
        for (a, b), (qa, qb) in copies:
            out.cite((k0 + a, k0 + b), prompt.sources([(q0 + qa, q0 + qb)]), copy=True)
        out.add("\n##tool use: " + ", ".join(f"<{t}>" for t in tools))
        return out.done()

    def _communicate(self, prompt: _Prompt):
        text, out = prompt.text, ReplyBuilder()
        head = text.split("Your notes so far:", 1)
        own = head[-1].split("Notes from other agents:", 1)[0]
        notes = _notes(own, len(text) - len(head[-1]))
        left = re.search(r"Tools left in your plan: (.*)", text)
        remaining = [] if not left or left.group(1).strip() == "none" else [
            t.strip() for t in left.group(1).split(",")]
        if not notes:
            out.add("##tool call: continue()")
            return out.done()
        last, used = notes[-1], {n["tool"] for n in notes}
        question, q_at = _question_at(text)
        q = question.lower()
        if "near the end" in q and TSR not in used and last["tool"] == GS:
            end = re.search(r"\(00:00-(\d+:\d+(?::\d+)?)\)", last["body"])
            if end:
                t = max(0.0, (parse_timestamp(end.group(1)) or 0.0) - 30.0)
                out.add(f"##tool call: add tool <{TSR}>\n##key info: the last half minute, at ")
                b0 = last["body_at"][0]
                end_at = (b0 + end.start(1), b0 + end.end(1))
                out.read(format_time(t), prompt.sources([end_at]))  # the video's end, less 30 s
                return out.done()
        add, cue = None, []  # the tool added, and where in the chat the decision to add it is read from
        if last["body"].lower().startswith("error") and last["tool"] in SELECT and GS not in used:
            add, cue = GS, [last["body_at"]]
        elif (last["tool"] in SELECT and not any(t in BROWSE for t in remaining)
              and not last["body"].startswith("error")):
            add, cue = FB, [last["tool_at"]] + ([left.span(1)] if left else [])
        elif last["tool"] in BROWSE and not _confident(last) and not remaining and IR not in used \
                and "[start" not in q and "how many" not in q:
            add, cue = IR, _doubt_at(last)
        if add is None:
            out.add("##tool call: continue()")
            return out.done()
        out.add("##tool call: add tool <")
        out.read(add, prompt.sources(cue))
        out.add(">\n##key info: ")
        out.read(question, prompt.sources([q_at]), copy=True)
        return out.done()

    def _answer(self, prompt: _Prompt):
        text, out = prompt.text, ReplyBuilder()
        notes = _notes(text)
        q, q_at = _question_at(text)
        grounding = "##Timestamp" in text
        mcq = "Options:" in text
        if mcq:  # only option letters can answer a multiple-choice question
            notes = [n for n in notes if re.fullmatch(r"[A-Z]", (n["answer"] or "").strip())]
        me = re.search(r"^\[([^\]]+)\] plan:", text, re.M)  # the agent's own record comes first
        mine = [n for n in notes if me and n["agent"] == me.group(1)]
        own = [n for n in mine if _confident(n)]
        read: list[dict] = []  # the notes whose answer value the reply takes
        if own:
            ans, why, read = own[-1]["answer"], f"my {own[-1]['tool']} saw it", [own[-1]]
        else:
            peers = [n for n in notes if n not in mine and _confident(n)]
            if peers:
                ans = Counter(n["answer"] for n in peers).most_common(1)[0][0]
                why, read = "taken from a peer whose browser saw it", [n for n in peers if n["answer"] == ans]
            else:
                guesses = [n for n in mine if n["answer"]]
                ans, why = (guesses[-1]["answer"] if guesses else ("A" if mcq else "0")), "a guess"
                read = guesses[-1:]
        sources = prompt.sources(n["answer_at"] for n in read)
        if grounding:
            span = parse_span(ans or "")
            value = format_span(span) if span else "[0 - 1]"
            out.add("##Timestamp: ")
            out.read(value, sources if span else [], copy=value == ans)
            out.add(f"\n##Reason: {why} (")
            out.read(q, prompt.sources([q_at]), copy=True)
            out.add(")")
            return out.done()
        out.add("##Answer: ")
        out.read(ans, sources, copy=True)
        out.add(f"\n##Reason: {why}")
        return out.done()

    def _summary(self, prompt: _Prompt):
        text, out = prompt.text, ReplyBuilder()
        board = [m for m in re.finditer(r"^- [^:]+: answer (.*?); reason:", text, re.M)
                 if m.group(1) and m.group(1) != "(none)"]
        answers = [m.group(1) for m in board]
        if "[s - e]" in text.split("##Final Answer:")[-1][:20]:
            spans = [s for s in (parse_span(a) for a in answers) if s]
            if spans:
                s = statistics.median(x[0] for x in spans)
                e = statistics.median(x[1] for x in spans)
                out.add("##Final Answer: ")
                spans = prompt.sources(m.span(1) for m in board if parse_span(m.group(1)))
                out.read(format_span((s, max(s, e))), spans)
                out.add("\n##Reason Summary: median of the agents' spans")
                return out.done()
        if not answers:
            out.add("##Final Answer: unknown\n##Reason Summary: no agent answered")
            return out.done()
        top = Counter(answers).most_common(1)[0][0]
        agreeing = prompt.sources(m.span(1) for m in board if m.group(1) == top)
        out.add("##Final Answer: ")
        out.read(top, agreeing, copy=True)
        out.add("\n##Reason Summary: most agents answered ")
        out.read(top, agreeing, copy=True)
        return out.done()
