"""The LLM judge of R_col (and of open-ended answers): the trajectory rendered as text, the prompts, reading the
judge's reply, a requests-per-minute budget, and `LLMJudge`, which batches, rate-limits and caches verdicts on disk.

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
from collections.abc import Callable
from pathlib import Path
from typing import Literal

from m1.marl.reward.judge import CorrectItem, JudgeItem, PlanRubric, Verdict, check_plan_rubric
from m1.models.base import ChatModel, ChatRequest, ModelError, SamplingParams
from m1.registry import PAPER_TOOLS, TOOLS

log = logging.getLogger(__name__)

# Bump when a prompt text changes: it is part of every cache key, so old verdicts stop matching.
PROMPT_VERSION = "m1-judge-v2"
MAX_OUTPUT_CHARS = 800  # per tool output in the rendered trajectory
MAX_REPLY_CHARS = 4_000  # judge replies longer than this are cut before parsing


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
    task = _COLLAB_CRITERIA[check_plan_rubric(plan_rubric, "collaboration_messages")] + _COLLAB_REST
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
        self.plan_rubric = check_plan_rubric(plan_rubric, "LLMJudge")
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
