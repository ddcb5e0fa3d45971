"""Benchmark metrics as pure functions over `{question id: prediction}` and `Question` lists.

Every score dict holds rates as floats in [0, 1] and counts as ints; `format_table` turns rates
into percentages. A question with no prediction counts as wrong (the denominator is every
labelled question, as lmms-eval does); `accuracy` also reports `accuracy_answered`, the
Video-MME official variant that divides by the questions whose answer could be read.
Questions without a ground truth (`answer=None`, e.g. a hidden test split) are not scored and
are counted under `unlabeled`.

Predictions are the team's final answers as text. The readers here are deterministic (no random
fallback as in some benchmark scripts): `extract_choice` for MCQ letters, `parse_span` for
`[s - e]` spans, `parse_number` for numeric answers.
"""
from __future__ import annotations

import math
import re
from collections import defaultdict
from typing import Any, Iterable, Mapping, Sequence

import numpy as np

from m1.text import parse_span as parse_text_span
from m1.schema import LETTERS, Question

Preds = Mapping[str, Any]

# ---------------------------------------------------------------------------------------------
# reading predictions


def normalize_answer(text: str | None) -> str:
    """The exact-match form of an open-ended answer: lower case, punctuation to spaces, single spaces. The one
    normaliser of evaluation and of the training reward (m1/marl/reward/rewards.py), so the two never disagree."""
    return re.sub(r"\s+", " ", re.sub(r"[^\w\s]", " ", (text or "").lower())).strip()


def truth_letter(question: Question) -> str:
    """The ground truth of an MCQ question as its option letter (given as a letter or as the option's text)."""
    gt = (question.answer or "").strip()
    valid = LETTERS[:len(question.options)] if question.options else ""
    if len(gt) == 1 and gt.upper() in valid:
        return gt.upper()
    letter = extract_choice(gt, question.options)
    if not letter:
        raise ValueError(f"question {question.id!r}: MCQ ground truth {question.answer!r} is not one of "
                         f"the option letters {valid or '(no options)'}")
    return letter


def extract_choice(pred: Any, options: Sequence[str] | int) -> str:
    """Read an option letter from free text; "" when none can be read.

    Order: a bare letter ("b", "(B)", "B."); text equal to an option; then letter candidates
    ranked by where they sit - leading letter (5), trailing letter (4), after "answer"/"option"
    (3), "(X)" (2), "X." / "X:" / "X)" (1), any standalone capital (0) - highest rank wins, the
    later position on a tie. A capital that starts a word ("After", "Answer") never counts.
    """
    if pred is None:
        return ""
    n = options if isinstance(options, int) else len(options)
    valid = LETTERS[:n]
    text = str(pred).strip()
    if not text or not valid:
        return ""
    bare = text.strip(" \t\n()[]{}.:;,!?'\"*").upper()
    if len(bare) == 1 and bare in valid:
        return bare
    if not isinstance(options, int):
        norm = normalize_answer(text)
        for i, option in enumerate(options):
            if norm and norm == normalize_answer(option):
                return LETTERS[i]
    body = text.strip(" \t\n.,!?;:'\"*")
    letter = rf"([{valid}])(?![A-Za-z])"
    patterns = [
        (5, rf"^\(?{letter}"),
        (4, rf"(?<![A-Za-z]){letter}\)?$"),
        (3, rf"(?i:answer|option|choice)(?:\s+is)?\s*[:：]?\s*\(?{letter}"),
        (2, rf"\({letter}\)"),
        (1, rf"(?<![A-Za-z])([{valid}])[.:)]"),
        (0, rf"(?<![A-Za-z]){letter}"),
    ]
    best: tuple[int, int, str] | None = None
    for rank, pat in patterns:
        for m in re.finditer(pat, body):
            cand = (rank, m.start(1), m.group(1))
            if best is None or cand[:2] > best[:2]:
                best = cand
    return best[2] if best else ""


def parse_span(pred: Any) -> tuple[float, float] | None:
    """A predicted span: a (start, end) pair as is, or text read by the agents' span parser
    (`[s - e]`, `s-e`, `from s to e`, mm:ss forms; reversed ends swapped); None if absent."""
    if pred is None:
        return None
    if isinstance(pred, (list, tuple)):
        if len(pred) != 2:
            return None
        try:
            s, e = float(pred[0]), float(pred[1])
        except (TypeError, ValueError):
            return None
        if not (math.isfinite(s) and math.isfinite(e)):
            return None
        return (s, e) if s <= e else (e, s)
    return parse_text_span(str(pred))


_UNITS = {w: i for i, w in enumerate(
    "zero one two three four five six seven eight nine ten eleven twelve thirteen fourteen fifteen "
    "sixteen seventeen eighteen nineteen".split())}
_TENS = {w: 10 * (i + 2) for i, w in enumerate("twenty thirty forty fifty sixty seventy eighty ninety".split())}
_SCALES = {"hundred": 100, "thousand": 1000}
_NUM_WORD = "|".join([*_UNITS, *_TENS, *_SCALES])
_DIGITS = re.compile(r"-?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?")
_WORDS = re.compile(rf"\b(?:{_NUM_WORD})(?:(?:\s+and\s+|[\s-]+)(?:{_NUM_WORD}))*\b", re.I)


def _words_value(run: str) -> float:
    total, current = 0, 0
    for word in re.findall(r"[a-z]+", run.lower()):
        if word in _UNITS:
            current += _UNITS[word]
        elif word in _TENS:
            current += _TENS[word]
        elif word == "hundred":
            current = max(current, 1) * 100
        elif word == "thousand":
            total += max(current, 1) * 1000
            current = 0
    return float(total + current)


def parse_number(pred: Any) -> float | None:
    """The first number in the text, as digits ("3.5", "1,200") or English words ("twenty-one")."""
    if pred is None:
        return None
    if isinstance(pred, (int, float)) and not isinstance(pred, bool):
        return float(pred) if math.isfinite(pred) else None
    text = str(pred)
    found = [(m.start(), float(m.group().replace(",", ""))) for m in [_DIGITS.search(text)] if m]
    found += [(m.start(), _words_value(m.group())) for m in [_WORDS.search(text)] if m]
    return min(found)[1] if found else None


# ---------------------------------------------------------------------------------------------
# elementary metrics


def iou(a: Sequence[float], b: Sequence[float]) -> float:
    """Temporal IoU of two spans (start, end).

    Disjoint spans give 0, identical spans 1. Zero-length spans: two equal points give 1.0 (an
    identical span is a perfect match); any other pair with an empty union gives 0.0, so the
    function never divides by zero. (lmms-eval returns 0 for two equal points; the case cannot
    arise when scoring Charades-STA because the loader rejects ground truths with start >= end.)
    A span with start > end or a non-finite end raises ValueError.
    """
    (s1, e1), (s2, e2) = (tuple(map(float, a)), tuple(map(float, b)))
    for s, e in ((s1, e1), (s2, e2)):
        if not (math.isfinite(s) and math.isfinite(e)) or s > e:
            raise ValueError(f"span ({s}, {e}) needs finite ends with start <= end")
    inter = max(0.0, min(e1, e2) - max(s1, s2))
    union = (e1 - s1) + (e2 - s2) - inter
    if union <= 0:
        return 1.0 if (s1, e1) == (s2, e2) else 0.0
    return inter / union


# VSI-Bench: thresholds 0.50, 0.55, ..., 0.95 (ten values), as its scoring code builds them
MRA_THRESHOLDS = np.linspace(0.5, 0.95, 10)


def mra(pred: float | None, gt: float) -> float:
    """VSI-Bench mean relative accuracy: the share of thresholds t in {0.50, ..., 0.95} with
    |pred - gt| / |gt| <= 1 - t.

    `<=` follows the benchmark's scoring code (the paper writes `<`); the two differ only when
    the relative error lands exactly on a threshold, e.g. pred 15 for gt 10 scores 0.1 here.
    A missing or non-finite prediction scores 0. A ground truth of 0 raises ValueError (the
    relative error is undefined; the loaders reject such records).
    """
    gt = float(gt)
    if not math.isfinite(gt) or gt == 0:
        raise ValueError(f"mra needs a finite non-zero ground truth, got {gt}")
    if pred is None or not math.isfinite(float(pred)):
        return 0.0
    rel = abs(float(pred) - gt) / abs(gt)
    return float(np.mean(rel <= 1 - MRA_THRESHOLDS))


def _labelled(questions: Iterable[Question], tasks: Sequence[str]) -> tuple[list[Question], int]:
    chosen, unlabeled = [], 0
    for q in questions:
        if q.task not in tasks:
            continue
        if q.answer is None:
            unlabeled += 1
        else:
            chosen.append(q)
    return chosen, unlabeled


def _group_order(item: tuple[str, Any]) -> tuple[int, float, str]:
    """Numeric group values (LongVideoBench duration groups) sort as numbers, others as text."""
    try:
        return (0, float(item[0]), item[0])
    except ValueError:
        return (1, 0.0, item[0])


def accuracy(preds: Preds, questions: Iterable[Question], group_by: Sequence[str] = ()) -> dict:
    """Accuracy of MCQ (letter) and open (normalised exact text) questions, overall and per value
    of each meta key in `group_by` (as `by_<key>`: {value: {accuracy, correct, total}}).

    Raises ValueError when no labelled mcq/open question is given.
    """
    scored, unlabeled = _labelled(questions, ("mcq", "open"))
    if not scored:
        raise ValueError("accuracy: no labelled mcq/open questions to score")
    correct = answered = 0
    groups: dict[str, dict[str, list[int]]] = {k: defaultdict(lambda: [0, 0]) for k in group_by}
    for q in scored:
        pred = preds.get(q.id)
        got = extract_choice(pred, q.options) if q.task == "mcq" else normalize_answer(
            str(pred) if pred is not None else "")
        ok = is_correct(q, pred)
        answered += bool(got)
        correct += ok
        for key in group_by:
            if key in q.meta:
                cell = groups[key][str(q.meta[key])]
                cell[0] += ok
                cell[1] += 1
    out: dict[str, Any] = {
        "accuracy": correct / len(scored),
        "accuracy_answered": correct / answered if answered else 0.0,
        "correct": correct, "answered": answered, "total": len(scored), "unlabeled": unlabeled,
    }
    for key in group_by:
        out[f"by_{key}"] = {v: {"accuracy": c / t, "correct": c, "total": t}
                            for v, (c, t) in sorted(groups[key].items(), key=_group_order)}
    return out


def charades_metrics(preds: Preds, questions: Iterable[Question],
                     thresholds: Sequence[float] = (0.3, 0.5, 0.7)) -> dict:
    """Top-1 temporal grounding: mIoU and R@m (share of queries with IoU >= m).

    Every labelled grounding question counts; an unreadable or missing prediction has IoU 0 and
    is counted under `unparsed`.
    """
    scored, unlabeled = _labelled(questions, ("grounding",))
    if not scored:
        raise ValueError("charades_metrics: no labelled grounding questions to score")
    ious, unparsed = [], 0
    for q in scored:
        gt = parse_span(q.answer)
        if gt is None:
            raise ValueError(f"question {q.id}: ground truth {q.answer!r} is not a '[s - e]' span")
        span = parse_span(preds.get(q.id))
        if span is None:
            unparsed += 1
            ious.append(0.0)
        else:
            ious.append(iou(span, gt))
    out: dict[str, Any] = {"mIoU": float(np.mean(ious))}
    for m in thresholds:
        out[f"R@{m:g}"] = sum(v >= m for v in ious) / len(ious)
    out.update(n=len(scored), unparsed=unparsed, unlabeled=unlabeled)
    return out


def numeric_mra(preds: Preds, questions: Iterable[Question]) -> dict:
    """Mean MRA over labelled numeric questions; predictions are read with `parse_number`."""
    scored, unlabeled = _labelled(questions, ("numeric",))
    if not scored:
        raise ValueError("numeric_mra: no labelled numeric questions to score")
    values = [mra(parse_number(preds.get(q.id)), float(q.answer)) for q in scored]  # type: ignore[arg-type]
    unparsed = sum(parse_number(preds.get(q.id)) is None for q in scored)
    return {"MRA": float(np.mean(values)), "n": len(scored), "unparsed": unparsed, "unlabeled": unlabeled}


# ---------------------------------------------------------------------------------------------
# benchmark tables

VSI_SUBSCORES = ("obj_appearance_order", "object_abs_distance", "object_counting", "object_rel_distance",
                 "object_size_estimation", "room_size_estimation", "route_planning", "object_rel_direction")
_VSI_DIRECTION = ("object_rel_direction_easy", "object_rel_direction_medium", "object_rel_direction_hard")


def vsibench_metrics(preds: Preds, questions: Iterable[Question]) -> dict:
    """VSI-Bench: accuracy per MCA type, MRA per numeric type; the three direction levels are
    averaged with equal weight into `object_rel_direction`; `overall` is the unweighted mean of
    the sub-scores present (all eight on the full benchmark)."""
    scored, unlabeled = _labelled(questions, ("mcq", "numeric"))
    if not scored:
        raise ValueError("vsibench_metrics: no labelled questions to score")
    per_type: dict[str, list[float]] = defaultdict(list)
    kind: dict[str, str] = {}
    for q in scored:
        qtype = str(q.meta.get("question_type", q.task))
        if q.task == "numeric":
            per_type[qtype].append(mra(parse_number(preds.get(q.id)), float(q.answer)))  # type: ignore[arg-type]
            kind[qtype] = "MRA"
        else:
            per_type[qtype].append(float(extract_choice(preds.get(q.id), q.options) == q.answer))
            kind[qtype] = "accuracy"
    by_type = {t: {"score": float(np.mean(v)), "metric": kind[t], "n": len(v)} for t, v in sorted(per_type.items())}
    sub: dict[str, float] = {t: s["score"] for t, s in by_type.items() if t not in _VSI_DIRECTION}
    directions = [by_type[t]["score"] for t in _VSI_DIRECTION if t in by_type]
    if directions:
        sub["object_rel_direction"] = float(np.mean(directions))
    out: dict[str, Any] = {"overall": float(np.mean(list(sub.values())))}
    out.update({k: sub[k] for k in sorted(sub)})
    out.update(n=len(scored), unlabeled=unlabeled, by_question_type=by_type)
    return out


def _mlvu(preds: Preds, questions: list[Question]) -> dict:
    mcq = [q for q in questions if q.task == "mcq"]
    acc = accuracy(preds, mcq, group_by=("task_type",))
    per_task = acc["by_task_type"]
    out: dict[str, Any] = {"M-avg": float(np.mean([c["accuracy"] for c in per_task.values()])),
                           "accuracy": acc["accuracy"], "correct": acc["correct"], "total": acc["total"],
                           "unlabeled": acc["unlabeled"],
                           # generation tasks need an LLM judge (G-avg); they are only counted here
                           "open_unscored": sum(q.task == "open" for q in questions)}
    out["by_task_type"] = per_task
    return out


def _generic(preds: Preds, questions: list[Question], group_by: Sequence[str] | None) -> dict:
    tasks = {q.task for q in questions if q.answer is not None}
    if not tasks:
        raise ValueError("score_benchmark: no labelled questions to score")
    out: dict[str, Any] = {"n": len(questions)}
    if tasks & {"mcq", "open"}:
        keys = group_by if group_by is not None else [
            k for k in ("task_type", "question_type", "duration_group", "family")
            if any(k in q.meta for q in questions)]
        acc = accuracy(preds, questions, group_by=keys)
        out.update({k: v for k, v in acc.items() if k not in ("unlabeled",)})
    if "grounding" in tasks:
        g = charades_metrics(preds, questions)
        out.update({k: g[k] for k in g if k.startswith(("mIoU", "R@"))}, grounding_n=g["n"],
                   grounding_unparsed=g["unparsed"])
    if "numeric" in tasks:
        m = numeric_mra(preds, questions)
        out.update(MRA=m["MRA"], numeric_n=m["n"], numeric_unparsed=m["unparsed"])
    return out


def score_benchmark(name: str, preds: Preds, questions: Iterable[Question],
                    group_by: Sequence[str] | None = None) -> dict:
    """The metrics table a benchmark reports, from `{question id: final answer text}`.

    - longvideobench: accuracy, per duration_group / question_category / level
    - videomme: accuracy (all questions) and accuracy_answered (official), acc_short/medium/long,
      per duration / domain / sub_category / task_type
    - mlvu: M-avg (mean of per-task accuracies) and micro accuracy, per task_type
    - charades_sta: mIoU, R@0.3, R@0.5, R@0.7
    - vsibench: overall and the eight sub-scores (accuracy or MRA), per question_type
    - video_holmes: accuracy (total correct / total), per question_type
    - jsonl: accuracy for mcq/open, mIoU/R@m for grounding, MRA for numeric; `group_by` picks
      the meta keys (default: whichever of task_type/question_type/duration_group/family exist)
    """
    questions = list(questions)
    key = name.lower().replace("-", "_")
    if key == "longvideobench":
        return accuracy(preds, questions, group_by=("duration_group", "question_category", "level"))
    if key == "videomme":
        out = accuracy(preds, questions, group_by=("duration", "domain", "sub_category", "task_type"))
        for d in ("short", "medium", "long"):
            if d in out["by_duration"]:
                out[f"acc_{d}"] = out["by_duration"][d]["accuracy"]
        return out
    if key == "mlvu":
        return _mlvu(preds, questions)
    if key == "charades_sta":
        return charades_metrics(preds, questions)
    if key == "vsibench":
        return vsibench_metrics(preds, questions)
    if key == "video_holmes":
        return accuracy(preds, questions, group_by=("question_type",))
    if key == "jsonl":
        return _generic(preds, questions, group_by)
    raise ValueError(f"unknown benchmark {name!r}; choose one of longvideobench, videomme, mlvu, "
                     "charades_sta, vsibench, video_holmes, jsonl")


# ---------------------------------------------------------------------------------------------


def _cell(value: Any, percent: bool) -> str:
    if isinstance(value, bool):
        return str(value)
    if isinstance(value, float):
        return f"{100 * value:.2f}" if percent else f"{value:.4f}"
    return str(value)


def format_table(metrics: Mapping[str, Any], percent: bool = True, title: str | None = None) -> str:
    """Markdown: one `metric | value` table for the flat entries, then one table per group dict.

    Floats are rates and print as percentages when `percent` (ints print as counts).
    """
    lines: list[str] = [f"### {title}", ""] if title else []
    flat = [(k, v) for k, v in metrics.items() if not isinstance(v, Mapping)]
    if flat:
        lines += ["| metric | value |", "|---|---|"]
        lines += [f"| {k} | {_cell(v, percent)} |" for k, v in flat]
    for name, group in metrics.items():
        if not isinstance(group, Mapping):
            continue
        if lines:
            lines.append("")
        label = name[3:] if name.startswith("by_") else name
        cols: list[str] = []
        for row in group.values():
            for c in (row.keys() if isinstance(row, Mapping) else ["value"]):
                if c not in cols:
                    cols.append(c)
        lines += [f"| {label} | " + " | ".join(cols) + " |", "|---" * (len(cols) + 1) + "|"]
        for value, row in group.items():
            row = row if isinstance(row, Mapping) else {"value": row}
            lines.append(f"| {value} | " + " | ".join(_cell(row.get(c, ""), percent) for c in cols) + " |")
    return "\n".join(lines) + "\n"


def is_correct(question: Question, pred: Any, iou_threshold: float = 0.5) -> bool:
    """One question right or wrong: MCQ letter, open normalised text, numeric equal value,
    grounding IoU >= `iou_threshold` (Charades R@0.5 by default)."""
    if question.answer is None or pred is None:
        return False
    if question.task == "mcq":
        return extract_choice(pred, question.options) == truth_letter(question)
    if question.task == "numeric":
        got, want = parse_number(pred), parse_number(question.answer)
        return got is not None and want is not None and abs(got - want) < 1e-9
    if question.task == "grounding":
        got, want = parse_span(pred), parse_span(question.answer)
        return got is not None and want is not None and iou(got, want) >= iou_threshold
    got = normalize_answer(str(pred))
    return bool(got) and got == normalize_answer(question.answer)
