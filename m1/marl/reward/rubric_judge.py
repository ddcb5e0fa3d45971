"""The offline rubric judge of R_col: deterministic rules over the LLM judge's three criteria (m1/marl/reward/judge.py),
for CPU runs and tests where no judge model is available."""
from __future__ import annotations

import logging
import re

from m1.data.metrics import is_correct, normalize_answer
from m1.marl.reward.judge import CorrectItem, JudgeItem, PlanRubric, Verdict, check_plan_rubric
from m1.registry import GLOBAL_SAMPLING, GROUNDING_TOOL, SPACE_TOOL, TIME_STAMP_RETRIEVAL
from m1.schema import AgentRecord, Question
from m1.text import format_span
from m1.tools import BROWSE_TOOLS, SELECT_TOOLS

log = logging.getLogger(__name__)

RUBRIC_JUDGE_NAME = "offline-rubric-judge"


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
        self.plan_rubric = check_plan_rubric(plan_rubric, "RubricJudge")

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
        plan_problems = self._plan_problems(item)
        tool_problems = self._tool_problems(item)
        step_problems = self._step_problems(item.record)
        criteria = {"plan_feasible": not plan_problems, "tools_appropriate": not tool_problems,
                    "steps_managed": not step_problems}
        return criteria, plan_problems + tool_problems + step_problems

    def _plan_problems(self, item: JudgeItem) -> list[str]:
        """Criterion 1, a feasible plan: written in the strict format and, unless the rubric is `none`, known tools
        with a selection tool first and a browser (`outcome`: no tool named twice, and the plan ran)."""
        rec = item.record
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
        return plan_problems

    def _tool_problems(self, item: JudgeItem) -> list[str]:
        """Criterion 2, fitting tools: some tool ran, the question's cues were served (`cues`) or the notes were used
        (`outcome`), every key info is drawn from the question, and no call failed."""
        rec = item.record
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
        return tool_problems

    def _step_problems(self, rec: AgentRecord) -> list[str]:
        """Criterion 3, managed steps: within the call limit, no call repeated with the same key info, and no tool
        added once a tool had suggested an answer."""
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
        return step_problems

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
