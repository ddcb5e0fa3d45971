"""Judges for the collaboration reward R_col (and for open-ended answer correctness).

A judge reads one agent's memory record (plan, tool calls with outputs and decisions, answer)
and returns a binary verdict on three criteria: is the plan feasible, are the tools fit for the
question, are the steps well managed. Two implementations share one protocol:

- `LLMJudge`: any `ChatModel` (the paper uses GPT-4o behind an OpenAI-compatible API). All items
  of a call go to the model in one batched `generate`; a requests-per-minute token bucket splits
  the batch when it would exceed the budget; verdicts are cached on disk by a SHA-256 of the
  rendered prompt (which contains the trajectory) and the judge model name. A reply that cannot
  be read is a verdict of 0 with `ok=False`, never an exception.
- `RubricJudge`: the **offline rubric judge** - deterministic rules over the same three criteria,
  for CPU runs and tests where no judge model is available. Its name, "offline-rubric-judge",
  appears in every verdict and log line it produces, so its scores are never mistaken for an
  LLM judge's.

Both take `plan_rubric` (`judge.plan_rubric` of a MARL config), how plans and tool choices are judged:
- `cues` (default, the paper's judge as we read it): the tools must fit cues of the question (a stated time
  -> Time Stamp Retrieval, spatial words -> Space Tool, counting -> Global Sampling, grounding -> Grounding
  Tool). These are the rule-based teacher's own preferences, so a different plan that answers right fails.
- `outcome` (ours): no tool is required for any cue. A plan passes when it is well-formed (strict
  format, known tools, selection first, a browser, no tool named twice), ran (every planned tool was called,
  unless the agent stopped or reached the call limit) and its calls produced notes the answer follows (a
  browsing call returned a description; when the agent's own tools suggested answers, its answer is one of them).
- `none` (ours): the plan's content is not judged at all; only that the agent wrote it in the required format
  (a plan the parser repaired is still not credited). Tool calls and step management are judged as before.
Every mode keeps the non-plan rules: key info drawn from the question, no failed calls, step management.

The prompts are written in our own words.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, Protocol, runtime_checkable

from pydantic import BaseModel, ConfigDict, Field

from m1.data.metrics import is_correct, normalize_answer
from m1.models.base import ChatModel, ChatRequest, ModelError, SamplingParams
from m1.schema import AgentRecord, Episode, Question
from m1.text import format_span
from m1.registry import GLOBAL_SAMPLING, GROUNDING_TOOL, PAPER_TOOLS, SPACE_TOOL, TIME_STAMP_RETRIEVAL, TOOLS
from m1.tools import BROWSE_TOOLS, SELECT_TOOLS

log = logging.getLogger(__name__)

RUBRIC_JUDGE_NAME = "offline-rubric-judge"
# Bump when a prompt text changes: it is part of every cache key, so old verdicts stop matching.
PROMPT_VERSION = "m1-judge-v2"
PlanRubric = Literal["cues", "outcome", "none"]
PLAN_RUBRICS: tuple[str, ...] = ("cues", "outcome", "none")
MAX_OUTPUT_CHARS = 800  # per tool output in the rendered trajectory
MAX_REPLY_CHARS = 4_000  # judge replies longer than this are cut before parsing

__all__ = [
    "RUBRIC_JUDGE_NAME", "PROMPT_VERSION", "Verdict", "JudgeItem", "CorrectItem", "Judge",
    "LLMJudge", "RubricJudge", "RateLimiter", "parse_verdict", "render_trajectory",
    "collaboration_messages", "correctness_messages", "question_cues",
    "key_info_problem", "judge_items", "PLAN_RUBRICS", "PlanRubric",
]


# ----------------------------------------------------------------------------- records
class Verdict(BaseModel):
    """One binary judgement. `ok` is False when the judge's reply could not be read (value 0)."""

    model_config = ConfigDict(extra="forbid")

    value: Literal[0, 1]
    ok: bool = True
    reason: str = ""
    judge: str
    lenient: bool = False  # read only by the lenient parser (format was off, meaning was clear)
    cached: bool = False
    raw: str = ""
    criteria: dict[str, bool] = Field(default_factory=dict)  # per-criterion results (rubric judge)
    error: str | None = None


@dataclass
class JudgeItem:
    """One agent's trajectory to judge: the question and that agent's memory record."""

    question: Question
    agent: str
    record: AgentRecord
    episode_id: str = ""
    # None when the agent's plan reply parsed in the strict format; else that reply. The team then ran a plan it
    # read leniently or filled in (the question as key info, default tools): judging that plan would credit the
    # agent for the system's repair, which MARL learned to exploit on the mini team (README, mini team).
    unreadable_plan: str | None = None

    @classmethod
    def from_episode(cls, episode: Episode, agent: str) -> JudgeItem:
        if agent not in episode.memory:
            raise KeyError(f"episode {episode.id!r}: agent {agent!r} has no memory record "
                           f"(agents with records: {sorted(episode.memory)})")
        rec = episode.memory[agent]
        if rec.answer is None:  # the answer phase writes both; prefer the memory, fall back to answers
            ans = next((a for a in episode.answers if a.agent == agent), None)
            if ans is not None:
                rec = rec.model_copy(update={"answer": ans.answer, "reason": ans.reason})
        bad = next((g.completion for g in episode.generations
                    if g.agent == agent and g.phase == "plan" and not g.parse_ok), None)
        return cls(question=episode.question, agent=agent, record=rec, episode_id=episode.id, unreadable_plan=bad)


@dataclass
class CorrectItem:
    """An open-ended answer to check against the question's reference answer."""

    question: Question
    answer: str


@runtime_checkable
class Judge(Protocol):
    name: str

    def judge(self, items: list[JudgeItem]) -> list[Verdict]:
        """One collaboration verdict per item, in order."""
        ...

    def correct(self, items: list[CorrectItem]) -> list[Verdict]:
        """One correctness verdict per open-ended answer, in order (1 = means the reference)."""
        ...


# ----------------------------------------------------------------------------- rendering
def _clip(text: str, limit: int) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= limit else text[:limit] + " ...[cut]"


def render_trajectory(item: JudgeItem, max_output_chars: int = MAX_OUTPUT_CHARS) -> str:
    """The agent's record as plain numbered text: plan, every tool call with output and decision,
    the answer. Deterministic, so it can be hashed for the cache."""
    q, rec = item.question, item.record
    lines = [f"Question: {q.text}"]
    if q.options:
        lines.append("Options:\n" + q.options_block())
    lines.append(f"Task type: {q.task}")
    if item.unreadable_plan is not None:
        lines.append(f"The agent's plan reply was not in the required format: {_clip(item.unreadable_plan, 300)!r}. "
                     "The plan below was read leniently or filled in by the system, not written by the agent.")
    lines.append("Planned tools: " + (", ".join(rec.plan) if rec.plan else "(no plan)"))
    lines.append(f"What the agent looks for: {rec.key_info or '(nothing stated)'}")
    if not rec.turns:
        lines.append("Tool calls: none")
    for i, t in enumerate(rec.turns, 1):
        head = f"Call {i}: {t.tool}"
        if t.key_info:
            head += f" | looking for: {_clip(t.key_info, 200)}"
        if t.timestamps:
            head += f" | frames {t.timestamps[0]:.1f}s-{t.timestamps[-1]:.1f}s ({len(t.timestamps)} frames)"
        lines.append(head)
        if t.error:
            lines.append(f"  error: {_clip(t.error, max_output_chars)}")
        else:
            lines.append(f"  output: {_clip(t.output, max_output_chars) or '(empty)'}")
        if t.answer is not None:
            lines.append(f"  answer suggested by the tool: {t.answer}")
        if t.span is not None:
            lines.append(f"  span suggested by the tool: [{t.span[0]:g} - {t.span[1]:g}]")
        d = t.decision
        if d is None:
            lines.append("  decision afterwards: (none)")
        elif d.action == "add_tool":
            lines.append(f"  decision afterwards: add tool {d.tool} for: {d.key_info or '(no key info)'}")
        else:
            lines.append(f"  decision afterwards: {d.action}")
    lines.append(f"Final answer of the agent: {rec.answer if rec.answer is not None else '(none)'}")
    if rec.reason:
        lines.append(f"Its reason: {_clip(rec.reason, max_output_chars)}")
    return "\n".join(lines)


# The paper's tools by group, as the judge prompt lists them (not tools registered later: the prompt stays put).
_PAPER_SELECT, _PAPER_BROWSE = ([t for t in PAPER_TOOLS if TOOLS[t].group == g] for g in ("select", "browse"))
_COLLAB_SYSTEM = (
    "You review how a video question-answering agent used its tools. The agent cannot watch the "
    f"video directly: it first picks frames with a selection tool ({', '.join(_PAPER_SELECT)}) "
    f"and then has them described by a browsing tool ({', '.join(_PAPER_BROWSE)}). "
    "Between calls it may keep its plan or add "
    "a tool after reading its teammates' notes. You grade the process, not whether the final "
    "answer happens to be right."
)

_COLLAB_TASK = (
    "Decide whether this trajectory is sound. Give 1 only if all three hold:\n"
    "1. Feasible plan - the planned tools can actually answer this question: frames are selected "
    "before they are browsed, and the selection targets the part of the video the question is "
    "about. A plan the agent did not write in the required format is not feasible.\n"
    "2. Fitting tools - each call suits the question (for example a stated time calls for Time "
    "Stamp Retrieval, left/right or distance questions for the Space Tool, finding when something "
    "happens for the Grounding Tool, counting for sampling across the whole video), what each "
    "call looks for is taken from the question (the objects, times and events it names, not "
    "others), and failed calls were not ignored.\n"
    "3. Sound step management - no pointless repeats, no extra tools once the answer was clear, "
    "and no more than {limit} tool calls in total.\n"
    "Otherwise give 0.\n\n"
    "Reply with exactly two lines and nothing else:\n"
    "##Verdict: 1 or 0\n"
    "##Reason: one short sentence"
)

# The first two criteria of the prompt under each plan rubric; criterion 3 and the reply format are shared.
# `cues` is the original text (its prompts, hence its cache keys, are unchanged).
_COLLAB_CRITERIA = {
    "cues": _COLLAB_TASK.split("3. Sound step management")[0],
    "outcome": (
        "Decide whether this trajectory is sound. Give 1 only if all three hold:\n"
        "1. Workable plan - frames are selected before they are browsed, no tool is planned twice, and the "
        "planned tools were actually called (unless the agent stopped early or ran out of calls). Any selection "
        "and browsing tools may serve a question: do not prefer or require particular tools for particular "
        "questions (a stated time, a spatial relation, a count or an event may each be found in many ways). A "
        "plan the agent did not write in the required format is not workable.\n"
        "2. Results used - at least one browsing call returned a description, what each call looks for is taken "
        "from the question (the objects, times and events it names, not others), failed calls were not ignored, "
        "and the final answer follows from what the agent's tools reported.\n"),
    "none": (
        "Decide whether this trajectory is sound. Give 1 only if all three hold:\n"
        "1. Own plan - the agent wrote its plan in the required format. Do not judge which tools it planned or "
        "called: any tools may serve a question.\n"
        "2. Sound calls - at least one tool was called, what each call looks for is taken from the question (the "
        "objects, times and events it names, not others), and failed calls were not ignored.\n"),
}
_COLLAB_REST = "3. Sound step management" + _COLLAB_TASK.split("3. Sound step management")[1]


def _plan_rubric(value: str, who: str) -> str:
    if value not in PLAN_RUBRICS:
        raise ValueError(f"{who}: plan_rubric must be one of {list(PLAN_RUBRICS)}, got {value!r}")
    return value


_CORRECT_SYSTEM = (
    "You check answers to questions about videos against a reference answer. Accept a candidate "
    "when it states the same fact as the reference, even in other words; reject it when it "
    "contradicts the reference, is vaguer in a way that matters, or gives several answers."
)

_CORRECT_TASK = (
    "Question: {question}\n{options}Reference answer: {reference}\nCandidate answer: {answer}\n\n"
    "Reply with exactly two lines and nothing else:\n"
    "##Verdict: 1 if the candidate is correct, 0 if not\n"
    "##Reason: one short sentence"
)


def collaboration_messages(item: JudgeItem, tool_call_limit: int = 5,
                           max_output_chars: int = MAX_OUTPUT_CHARS,
                           plan_rubric: PlanRubric = "cues") -> list[dict[str, str]]:
    task = _COLLAB_CRITERIA[_plan_rubric(plan_rubric, "collaboration_messages")] + _COLLAB_REST
    user = ("Trajectory:\n" + render_trajectory(item, max_output_chars) + "\n\n"
            + task.format(limit=tool_call_limit))
    return [{"role": "system", "content": _COLLAB_SYSTEM}, {"role": "user", "content": user}]


def correctness_messages(item: CorrectItem) -> list[dict[str, str]]:
    q = item.question
    if q.answer is None:
        raise ValueError(f"question {q.id!r}: no reference answer, so correctness cannot be judged")
    options = f"Options:\n{q.options_block()}\n" if q.options else ""
    user = _CORRECT_TASK.format(question=q.text, options=options, reference=q.answer, answer=item.answer)
    return [{"role": "system", "content": _CORRECT_SYSTEM}, {"role": "user", "content": user}]


# ----------------------------------------------------------------------------- parsing
_STRICT_VERDICT = re.compile(r"##Verdict:[ \t]*([01])[ \t]*(?:\n|$)")
_STRICT_REASON = re.compile(r"##Reason:[ \t]*(.+)")
_LENIENT_VERDICT = re.compile(
    r"(?:verdict|score|rating|grade|judg(?:e)?ment)\W{0,6}(?:is\W{0,3})?"
    r"(1|0|yes|no|pass|fail|coherent|incoherent)(?!\w|\.\d)",
    re.IGNORECASE)
_LENIENT_WORDS = {"1": 1, "yes": 1, "pass": 1, "coherent": 1, "0": 0, "no": 0, "fail": 0, "incoherent": 0}
_LENIENT_REASON = re.compile(r"reason\W{0,6}[:：]\s*(.+)", re.IGNORECASE)


def _strip_thinking(text: str) -> str:
    close = text.rfind("</think>")
    if close >= 0:
        text = text[close + len("</think>"):]
    return text.replace("<think>", "").strip()


def parse_verdict(text: object, judge: str) -> Verdict:
    """Strict `##Verdict: 0|1` at the start of the reply first; then a lenient search for a
    verdict-like word followed by 0/1/yes/no/pass/fail (all mentions must agree); else value 0
    with ok=False. Never raises."""
    raw = "" if text is None else str(text)[:MAX_REPLY_CHARS]
    body = _strip_thinking(raw)
    m = _STRICT_VERDICT.match(body)
    if m and len(_STRICT_VERDICT.findall(body)) == 1:
        rm = _STRICT_REASON.search(body)
        rest = body[m.end():].strip()
        reason = rm.group(1) if rm else (rest.splitlines()[0] if rest else "")
        return Verdict(value=int(m.group(1)), ok=True, reason=_clip(reason, 300), judge=judge, raw=raw)
    found = {_LENIENT_WORDS[w.lower()] for w in _LENIENT_VERDICT.findall(body.replace("*", ""))}
    if len(found) == 1:
        rm = _LENIENT_REASON.search(body.replace("*", ""))
        return Verdict(value=found.pop(), ok=True, lenient=True, raw=raw, judge=judge,
                       reason=_clip(rm.group(1), 300) if rm else "")
    why = "conflicting verdicts" if len(found) > 1 else "no verdict found"
    return Verdict(value=0, ok=False, raw=raw, judge=judge, error=f"unreadable judge reply ({why})",
                   reason=f"unreadable judge reply ({why}); scored 0")


# ----------------------------------------------------------------------------- rate limit
class RateLimiter:
    """Token bucket for requests per minute: starts full (one minute's budget), refills
    continuously. `acquire(n)` blocks (via the injected `sleep`) until n requests may go."""

    def __init__(self, rate_per_minute: float, clock: Callable[[], float] = time.monotonic,
                 sleep: Callable[[float], None] = time.sleep):
        if not rate_per_minute > 0:
            raise ValueError(f"RateLimiter: rate_per_minute must be > 0, got {rate_per_minute!r}")
        self.rate = float(rate_per_minute)
        self.capacity = max(1, int(rate_per_minute))
        self.clock, self.sleep = clock, sleep
        self.tokens = float(self.capacity)
        self.last = clock()
        self.waited = 0.0

    def _refill(self) -> None:
        now = self.clock()
        self.tokens = min(self.capacity, self.tokens + (now - self.last) * self.rate / 60.0)
        self.last = now

    def acquire(self, n: int) -> float:
        """Take n tokens (n <= capacity); returns the seconds spent waiting."""
        if n > self.capacity:
            raise ValueError(f"RateLimiter: a burst of {n} requests exceeds the budget of "
                             f"{self.capacity} per minute; split it first")
        waited = 0.0
        self._refill()
        while self.tokens + 1e-9 < n:
            delay = (n - self.tokens) * 60.0 / self.rate
            self.sleep(delay)
            waited += delay
            self._refill()
        self.tokens -= n
        self.waited += waited
        return waited


# ----------------------------------------------------------------------------- LLM judge
class LLMJudge:
    """A judge backed by any ChatModel: batched, rate-limited, cached on disk.

    Retries and concurrency belong to the backend (the OpenAI client retries with backoff).
    A backend failure (ModelError) is raised by default: silently scoring a whole batch 0 during
    an outage would corrupt training. With `on_model_error="zero"` those items get value 0,
    ok=False and the error text instead (and are not cached).
    Only readable verdicts are cached, so an unreadable reply is asked again next time.
    """

    def __init__(self, model: ChatModel, cache_dir: Path | str | None = None,
                 rate_per_minute: float | None = None, *, tool_call_limit: int = 5,
                 max_new_tokens: int = 96, max_batch: int | None = None,
                 max_output_chars: int = MAX_OUTPUT_CHARS,
                 on_model_error: Literal["raise", "zero"] = "raise", plan_rubric: PlanRubric = "cues",
                 clock: Callable[[], float] = time.monotonic, sleep: Callable[[float], None] = time.sleep):
        if not isinstance(model, ChatModel):
            raise TypeError(f"LLMJudge: model {model!r} does not implement ChatModel (name, generate)")
        if on_model_error not in ("raise", "zero"):
            raise ValueError(f"LLMJudge: on_model_error must be 'raise' or 'zero', got {on_model_error!r}")
        if max_batch is not None and max_batch < 1:
            raise ValueError(f"LLMJudge: max_batch must be >= 1, got {max_batch}")
        self.model = model
        self.name = f"llm-judge:{model.name}"
        self.cache_dir = Path(cache_dir) if cache_dir is not None else None
        if self.cache_dir is not None:
            self.cache_dir.mkdir(parents=True, exist_ok=True)
        self.limiter = RateLimiter(rate_per_minute, clock, sleep) if rate_per_minute else None
        self.tool_call_limit = tool_call_limit
        self.max_batch = max_batch
        self.max_output_chars = max_output_chars
        self.on_model_error = on_model_error
        self.plan_rubric = _plan_rubric(plan_rubric, "LLMJudge")
        self.params = SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0, logprobs=False)
        self.calls = 0  # generate calls made
        self.requests = 0  # prompts sent
        self.cache_hits = 0

    # -- public API
    def judge(self, items: list[JudgeItem]) -> list[Verdict]:
        msgs = [collaboration_messages(it, self.tool_call_limit, self.max_output_chars, self.plan_rubric)
                for it in items]
        return self._run("collab", msgs)

    def correct(self, items: list[CorrectItem]) -> list[Verdict]:
        return self._run("correct", [correctness_messages(it) for it in items])

    # -- machinery
    def cache_key(self, kind: str, messages: list[dict[str, str]]) -> str:
        blob = json.dumps({"kind": kind, "model": self.model.name, "version": PROMPT_VERSION,
                           "messages": messages}, sort_keys=True, ensure_ascii=False)
        return hashlib.sha256(blob.encode("utf-8")).hexdigest()

    def _cache_path(self, key: str) -> Path | None:
        return self.cache_dir / f"{key}.json" if self.cache_dir is not None else None

    def _load(self, key: str) -> Verdict | None:
        path = self._cache_path(key)
        if path is None or not path.exists():
            return None
        try:
            v = Verdict.model_validate_json(path.read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            log.warning("%s: unreadable cache file %s (%s); asking the model again", self.name, path, exc)
            return None
        return v.model_copy(update={"cached": True})

    def _store(self, key: str, verdict: Verdict) -> None:
        path = self._cache_path(key)
        if path is None or not verdict.ok:
            return
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-", suffix=".json")
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(verdict.model_dump_json())
        os.replace(tmp, path)  # atomic: parallel workers never read half a file

    def _chunks(self, n: int) -> list[tuple[int, int]]:
        size = n
        if self.max_batch:
            size = min(size, self.max_batch)
        if self.limiter:
            size = min(size, self.limiter.capacity)
        return [(i, min(i + size, n)) for i in range(0, n, max(size, 1))]

    def _run(self, kind: str, messages: list[list[dict[str, str]]]) -> list[Verdict]:
        keys = [self.cache_key(kind, m) for m in messages]
        out: list[Verdict | None] = [None] * len(messages)
        todo: dict[str, list[int]] = {}  # identical prompts are asked once
        for i, k in enumerate(keys):
            hit = self._load(k)
            if hit is not None:
                out[i] = hit
                self.cache_hits += 1
            else:
                todo.setdefault(k, []).append(i)
        uniq = list(todo)
        for lo, hi in self._chunks(len(uniq)):
            part = uniq[lo:hi]
            if self.limiter:
                self.limiter.acquire(len(part))
            requests = [ChatRequest(messages=messages[todo[k][0]]) for k in part]
            self.calls += 1
            self.requests += len(requests)
            try:
                replies = self.model.generate(requests, self.params)
                if len(replies) != len(requests):
                    raise ModelError(f"{self.model.name}: {len(replies)} completions for {len(requests)} requests")
                verdicts = [parse_verdict(r.text, self.name) for r in replies]
            except ModelError as exc:
                if self.on_model_error == "raise":
                    raise ModelError(f"{self.name}: judge call failed: {exc}") from exc
                log.warning("%s: judge call failed for %d items, scored 0: %s", self.name, len(part), exc)
                verdicts = [Verdict(value=0, ok=False, judge=self.name, error=str(exc),
                                    reason=f"judge call failed; scored 0: {exc}") for _ in part]
            for k, v in zip(part, verdicts):
                if not v.ok:
                    log.warning("%s: %s: %r", self.name, v.error, v.raw[:200])
                self._store(k, v)
                for i in todo[k]:
                    out[i] = v
        missing = [i for i, v in enumerate(out) if v is None]
        if missing:
            raise RuntimeError(f"{self.name}: no verdict for items {missing} (internal error)")
        return out  # type: ignore[return-value]


# ----------------------------------------------------------------------------- rubric judge
_TIME_CUE = re.compile(
    r"(?<![\d:.])\d{1,4}:\d{2}(?::\d{2})?(?![\d:])"
    r"|(?<![\w.])\d+(?:\.\d+)?\s*(?:s|sec|secs|seconds?|min|mins|minutes?)(?![A-Za-z])",
    re.IGNORECASE)
_SPATIAL_CUE = re.compile(
    r"\b(?:left|right(?!\s+(?:after|before|away|now|when|then))|above|below|behind|in front of|"
    r"next to|beside|relative to|closest|nearest|farthest|furthest|distance|direction|on top of|under)\b",
    re.IGNORECASE)
_COUNT_CUE = re.compile(r"\b(?:how many|how often|count|number of)\b", re.IGNORECASE)


def question_cues(question: Question) -> dict[str, bool]:
    """Which tool-demanding cues a question carries (the rubric judge's notion of fit)."""
    text = question.text
    return {
        "time": bool(_TIME_CUE.search(text)),
        "grounding": question.task == "grounding",
        "spatial": bool(_SPATIAL_CUE.search(text)),
        "counting": bool(_COUNT_CUE.search(text)),
    }


_KEY_STOPWORDS = frozenset(
    "the a an and or of in on at to is are was were be it its this that these those which what when where who "
    "how does do did with from by for as while both each every any all one than then there their into onto over "
    "under".split())
_KEY_TOKEN = re.compile(r"\d+:\d+(?::\d+)?|\d+(?:\.\d+)?|[a-z]+")
KEY_INFO_MIN_SHARE = 0.75  # share of the key info's content words that must come from the question


def _content_tokens(text: str) -> list[str]:
    """Times, numbers and crudely stemmed content words (>= 3 letters, no stopwords) of a text."""
    out = []
    for t in _KEY_TOKEN.findall(text.lower()):
        if t[0].isdigit():
            out.append(t)
        elif len(t) >= 3 and t not in _KEY_STOPWORDS:
            for suffix in ("ing", "ed", "es", "s", "e"):
                if t.endswith(suffix) and len(t) - len(suffix) >= 3:
                    t = t[:-len(suffix)]
                    break
            out.append(t)
    return out


def key_info_problem(question: Question, key_info: str | None) -> str | None:
    """Why a key info is not drawn from the question, or None when it is.

    Drawn from the question: it names something, every time or number in it appears in the question or its
    options, and at least KEY_INFO_MIN_SHARE of its content words do (so a few linking words are allowed but
    another colour, object or time is not).
    """
    words = _content_tokens(key_info or "")
    if not words:
        return f"the key info {key_info!r} names nothing to look for"
    source = set(_content_tokens(question.text + " " + " ".join(question.options or [])))
    foreign_numbers = [w for w in words if w[0].isdigit() and w not in source]
    if foreign_numbers:
        return f"the key info {key_info!r} names times or numbers {foreign_numbers} that the question does not"
    share = sum(w in source for w in words) / len(words)
    if share < KEY_INFO_MIN_SHARE:
        return f"the key info {key_info!r} is not drawn from the question ({share:.0%} of its words are)"
    return None


# cue -> (tools that satisfy it, what to say when missing)
_CUE_TOOLS: dict[str, tuple[tuple[str, ...], str]] = {
    "time": ((TIME_STAMP_RETRIEVAL.name,),
             f"the question states a time but {TIME_STAMP_RETRIEVAL.name} was not used"),
    "grounding": ((GROUNDING_TOOL.name,), f"a grounding question without the {GROUNDING_TOOL.name}"),
    "spatial": ((SPACE_TOOL.name,), f"a spatial question without the {SPACE_TOOL.name}"),
    "counting": ((GLOBAL_SAMPLING.name,), f"a counting question without {GLOBAL_SAMPLING.name} over the whole video"),
}


class RubricJudge:
    """The offline rubric judge: deterministic rules standing in for the LLM judge on CPU runs.

    Verdict 1 iff all three criteria hold:
    - plan_feasible: the agent's plan reply parsed in the strict format (not repaired or filled in by
      the parser), has >= 1 selection and >= 1 browsing tool, the first is a selection tool, and
      every name is a known tool.
    - tools_appropriate: at least one tool was called; the called tools cover every cue of the
      question (a stated time -> Time Stamp Retrieval, grounding task -> Grounding Tool,
      spatial words -> Space Tool, counting words -> Global Sampling, which samples the whole
      video); no call ended in an error; every key info the tools were given is drawn from the
      question (`key_info_problem`: a search for another object or time misleads the tools).
    - steps_managed: at most `tool_call_limit` calls; no two calls of the same tool with the same
      key info; no `add tool` decision once a tool had already suggested an answer.
    That is `plan_rubric="cues"`. With `outcome` no cue asks for a tool; plan_feasible also asks that no tool is
    planned twice and every planned tool ran (`_plan_ran`), and tools_appropriate that a browsing call returned
    notes and the answer follows the agent's own tools' suggestions (`_notes_used`). With `none` plan_feasible
    only asks for the strict format and no cue asks for a tool. The three criteria keep their names in every mode.
    `correct` is a normalised exact match against the reference answer.
    """

    name = RUBRIC_JUDGE_NAME

    def __init__(self, tool_call_limit: int = 5, plan_rubric: PlanRubric = "cues"):
        if tool_call_limit < 1:
            raise ValueError(f"RubricJudge: tool_call_limit must be >= 1, got {tool_call_limit}")
        self.tool_call_limit = tool_call_limit
        self.plan_rubric = _plan_rubric(plan_rubric, "RubricJudge")

    def judge(self, items: list[JudgeItem]) -> list[Verdict]:
        out = []
        for it in items:
            criteria, problems = self.check(it)
            value = int(all(criteria.values()))
            reason = f"{self.name}: " + ("all three criteria hold" if value else "; ".join(problems))
            out.append(Verdict(value=value, ok=True, reason=reason, judge=self.name, criteria=criteria))
            log.debug("%s verdict %d for %s/%s: %s", self.name, value, it.episode_id, it.agent, reason)
        return out

    def correct(self, items: list[CorrectItem]) -> list[Verdict]:
        out = []
        for it in items:
            if it.question.answer is None:
                raise ValueError(f"question {it.question.id!r}: no reference answer to compare with")
            got, ref = normalize_answer(it.answer), normalize_answer(it.question.answer)
            value = int(bool(got) and got == ref)
            out.append(Verdict(value=value, ok=True, judge=self.name,
                               reason=f"{self.name}: normalised exact match {'holds' if value else 'fails'}"))
        return out

    def check(self, item: JudgeItem) -> tuple[dict[str, bool], list[str]]:
        """(criterion -> holds, list of problems found) for one trajectory."""
        rec = item.record
        problems: list[str] = []

        # 1. feasible plan
        plan_problems = []
        unknown = [t for t in rec.plan if t not in SELECT_TOOLS and t not in BROWSE_TOOLS]
        if item.unreadable_plan is not None:
            plan_problems.append("the plan reply was not in the required format (the plan run was repaired or "
                                 "filled in by the parser)")
        if self.plan_rubric == "none":
            pass  # the plan's content is not judged
        elif not rec.plan:
            plan_problems.append("no plan")
        else:
            if unknown:
                plan_problems.append(f"unknown tools in plan {unknown}")
            if not any(t in SELECT_TOOLS for t in rec.plan):
                plan_problems.append("plan has no selection tool")
            if not any(t in BROWSE_TOOLS for t in rec.plan):
                plan_problems.append("plan has no browsing tool")
            if rec.plan[0] not in SELECT_TOOLS:
                plan_problems.append(f"plan starts with {rec.plan[0]!r}, not a selection tool")
            if self.plan_rubric == "outcome":
                twice = sorted({t for t in rec.plan if rec.plan.count(t) > 1})
                if twice:
                    plan_problems.append(f"plan names {twice} more than once")
                plan_problems += self._plan_ran(rec)
        problems += plan_problems

        # 2. appropriate tools
        tool_problems = []
        used = {t.tool for t in rec.turns}
        if not rec.turns:
            tool_problems.append("no tool was called")
        if self.plan_rubric == "cues":
            for cue, present in question_cues(item.question).items():
                fits, why = _CUE_TOOLS[cue]
                if present and not used.intersection(fits):
                    tool_problems.append(why)
        elif self.plan_rubric == "outcome" and rec.turns:
            tool_problems += _notes_used(item.question, rec)
        for ki in dict.fromkeys(t.key_info for t in rec.turns):
            why = key_info_problem(item.question, ki)
            if why:
                tool_problems.append(why)
        errors = [f"call {i} ({t.tool})" for i, t in enumerate(rec.turns, 1) if t.error]
        if errors:
            tool_problems.append("error in " + ", ".join(errors))
        problems += tool_problems

        # 3. step management
        step_problems = []
        if len(rec.turns) > self.tool_call_limit:
            step_problems.append(f"{len(rec.turns)} tool calls exceed the limit of {self.tool_call_limit}")
        seen: set[tuple[str, str]] = set()
        for i, t in enumerate(rec.turns, 1):
            sig = (t.tool, normalize_answer(t.key_info))
            if sig in seen:
                step_problems.append(f"call {i} repeats {t.tool} with the same key info")
            seen.add(sig)
        answered_at = next((i for i, t in enumerate(rec.turns, 1) if t.answer is not None), None)
        if answered_at is not None:
            for i, t in enumerate(rec.turns[answered_at - 1:], answered_at):
                if t.decision is not None and t.decision.action == "add_tool":
                    step_problems.append(f"added {t.decision.tool} after call {i} although call "
                                         f"{answered_at} already suggested an answer")
        problems += step_problems

        criteria = {"plan_feasible": not plan_problems, "tools_appropriate": not tool_problems,
                    "steps_managed": not step_problems}
        return criteria, problems

    def _plan_ran(self, rec: AgentRecord) -> list[str]:
        """`outcome`: the planned tools that never ran, unless the agent chose to stop or used up its calls (a
        plan that cannot run within the budget is not executable)."""
        called = {t.tool for t in rec.turns}
        missing = [t for t in dict.fromkeys(rec.plan) if t not in called]
        stopped = any(t.decision is not None and t.decision.action == "stop" for t in rec.turns)
        if not missing or stopped or len(rec.turns) >= self.tool_call_limit:
            return []
        return [f"planned tools {missing} never ran"]


# what a browsing tool writes when its model said nothing (m1/tools/browse.py `finish`)
_EMPTY_BROWSE = "(the browser returned nothing)"


def _agrees(question: Question, suggestion: str, answer: str | None) -> bool:
    """Whether `answer` would be scored right if the tool's suggestion were the truth (m1.data.metrics: MCQ letter,
    grounding IoU >= 0.5, numeric value, open normalised text); a suggestion that is no valid answer agrees with
    nothing."""
    try:
        return is_correct(question.model_copy(update={"answer": suggestion}), answer)
    except ValueError:
        return False


def _notes_used(question: Question, rec: AgentRecord) -> list[str]:
    """`outcome`: a browsing call returned a description, the agent answered, and when its own tools suggested
    answers (or spans) its answer agrees with one of them. Which tools produced them does not matter."""
    out = []
    notes = [t for t in rec.turns if t.tool in BROWSE_TOOLS and not t.error
             and t.output.strip() and not t.output.strip().startswith(_EMPTY_BROWSE)]
    if not notes:
        out.append("no browsing call returned a description")
    answer = rec.answer if rec.answer is not None and str(rec.answer).strip() else None
    if answer is None:
        out.append("no final answer")
    if question.task == "grounding":  # a span is the grounding answer; an answer line without one is prose
        suggested = [format_span(t.span) for t in rec.turns if not t.error and t.span is not None]
    else:
        suggested = [t.answer for t in rec.turns if not t.error and t.answer and t.answer.strip()]
    if answer is not None and suggested and not any(_agrees(question, s, answer) for s in suggested):
        out.append(f"the answer {answer!r} follows none of its tools' suggestions {suggested}")
    return out


def judge_items(episode: Episode, agents: Sequence[str] | None = None) -> list[JudgeItem]:
    """JudgeItems for the given agents (default: every agent with a memory record)."""
    names = list(agents) if agents is not None else [a for a in episode.topology.agents if a in episode.memory]
    return [JudgeItem.from_episode(episode, a) for a in names]
