"""Functions the lmms-eval task `m1_synth` names with `!function utils.<name>` (lmms-eval imports this file from
the folder of the YAML that includes `m1_synth_base.yaml`, i.e. from here).

A record of the task's JSONL (written by `run.py`) is flat, so `datasets` reads it without a schema:
`{"id", "video" (absolute path), "question", "options" (list, empty for open questions), "task" (mcq | open),
"answer" (a letter for mcq, the text for open)}`.

Scoring calls M1's own `is_correct` (m1/data/metrics.py), the rule `m1 eval -b jsonl` applies to every question,
so lmms-eval's accuracy and m1 eval's can be compared exactly. This file runs inside lmms-eval's venv, which does
not install M1: the repository root is put on sys.path (M1's metrics need only numpy and pydantic, which
lmms-eval brings).
"""
from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from m1.data.metrics import is_correct  # noqa: E402
from m1.schema import LETTERS, Question  # noqa: E402

# lmms-eval writes this in place of the reply when a request failed after all its retries (and scores it wrong)
FAILED_MARKER = "[LMMS_EVAL_REQUEST_FAILED"
# The instruction line of an mcq question. `m1 serve` drops a line starting "Answer with" after the option lines, so
# the team reads the bare question, as under `m1 eval`. Open questions get none: with no option lines the server
# keeps every line, and an instruction would change the question the team reads.
MCQ_INSTRUCTION = "Answer with the letter of the correct option only."
TASKS = ("mcq", "open")  # the kinds a chat text can carry: lettered lines make mcq, no lines make open
FIELDS = ("id", "video", "question", "options", "task", "answer")


class RecordError(ValueError):
    """A task record lmms-eval handed over that the task cannot use (names the record and the field)."""


def _check(doc: dict) -> None:
    missing = [f for f in FIELDS if f not in doc]
    if missing:
        raise RecordError(f"m1_synth record {doc.get('id', '?')!r}: missing field {missing[0]!r}")
    if doc["task"] not in TASKS:
        raise RecordError(f"m1_synth record {doc['id']!r}: task {doc['task']!r} is not one of {', '.join(TASKS)} "
                          "(numeric and grounding questions need m1.task, which lmms-eval cannot send)")
    if doc["task"] == "mcq" and len(doc["options"] or []) < 2:
        raise RecordError(f"m1_synth record {doc['id']!r}: an mcq record needs at least 2 options")


def doc_to_visual(doc: dict) -> list[str]:
    """The video as one path: lmms-eval's openai model sends it as a file:// video_url part (pass_video_url=True)."""
    _check(doc)
    path = Path(doc["video"])
    if not path.is_absolute() or not path.is_file():
        raise RecordError(f"m1_synth record {doc['id']!r}: video {doc['video']!r} is not an existing absolute path")
    return [str(path)]


def doc_to_text(doc: dict, lmms_eval_specific_kwargs: dict | None = None) -> str:
    """The question; for mcq its options as lines `A. text` and one instruction line (pre/post prompts from the
    YAML wrap the whole when set)."""
    _check(doc)
    kw = lmms_eval_specific_kwargs or {}
    lines = [doc["question"].strip()]
    if doc["task"] == "mcq":
        lines += [f"{LETTERS[i]}. {opt}" for i, opt in enumerate(doc["options"])] + [MCQ_INSTRUCTION]
    return f"{kw.get('pre_prompt', '')}" + "\n".join(lines) + f"{kw.get('post_prompt', '')}"


def is_failed_request(reply: object) -> bool:
    """True for lmms-eval's stand-in answer of a request that never got a reply."""
    return isinstance(reply, str) and reply.lstrip().startswith(FAILED_MARKER)


def as_question(doc: dict) -> Question:
    """The record as M1's Question, the form M1's scorer reads."""
    _check(doc)
    return Question(id=doc["id"], video=doc["video"], text=doc["question"], options=list(doc["options"] or []),
                    task=doc["task"], answer=doc["answer"])


def process_results(doc: dict, results: list) -> dict:
    """One question's scores: `accuracy` 1.0 when the reply is right under M1's rule (mcq: the option letter read
    from the reply; open: the normalised text), and `failed_requests` 1.0 when lmms-eval got no reply at all."""
    reply = results[0] if results else None
    failed = is_failed_request(reply)
    ok = (not failed) and is_correct(as_question(doc), reply)
    return {"accuracy": float(ok), "failed_requests": float(failed)}


def count(items: list) -> float:
    """Aggregation: the sum (how many requests failed), not the mean."""
    return float(sum(items))
