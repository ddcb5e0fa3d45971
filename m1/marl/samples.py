"""What a training step trained on, kept for a person to read (`log.samples_every`).

Every `log.samples_every` steps, <out_dir>/samples/step-NNNNNN/ receives:
- samples.jsonl: one line per generation of a trained agent in each of the step's episodes: the question, the
  rollout, the agent and phase, the prompt (chat messages) and the completion, the reward, its parts (R_res,
  R_format, R_col, ... as the reward function reports them) and the advantage, and whether it was trained on;
- the trace page of each episode (m1/trace.py, the page `m1 infer --trace-dir` writes), each generation showing
  its reward and advantage, and the folder's index.html.
The trackers get the same rows as a table (`Trackers.table`). `m1 view RUN_DIR` lists the steps (m1/marl/view.py).
"""
from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from m1.files import write_whole
from m1.run import write_trace
from m1.trace import INDEX_NAME, _content
from m1.trace_index import TraceIndex

SAMPLES_DIR = "samples"
SAMPLES_FILE = "samples.jsonl"
TABLE_COLUMNS = ["question_id", "rollout", "agent", "phase", "prompt", "completion", "reward", "advantage",
                 "trained"]
_TABLE_TEXT = 2000  # characters of a prompt or completion in a tracker table (the JSONL keeps them whole)


def step_dir(out_dir: str | Path, step: int) -> Path:
    return Path(out_dir) / SAMPLES_DIR / f"step-{step:06d}"


def due(samples_every: int | None, step: int) -> bool:
    """Whether step `step` (1-based) writes its samples."""
    return bool(samples_every) and step % samples_every == 0


def _num(x) -> float | None:
    return None if x is None or (isinstance(x, float) and math.isnan(x)) else float(x)


def _parts(value) -> dict[str, Any]:
    """An agent's reward on one episode as its named parts (a RewardBreakdown, a seed-kind breakdown, a number)."""
    if value is None:
        return {}
    if hasattr(value, "model_dump"):
        return {k: (_num(v) if isinstance(v, float) else v) for k, v in value.model_dump().items()}
    return {"total": _num(float(getattr(value, "total", value)))}


def _prompt_text(messages: list[dict]) -> list[dict[str, str]]:
    return [{"role": m.get("role", "?"), "content": _content(m.get("content"))} for m in messages]


def write_step_samples(out_dir: str | Path, step: int, batch, credit: dict, live: dict | None = None,
                       pool=None) -> tuple[Path, list[dict[str, Any]]]:
    """Write step `step`'s samples.jsonl, trace pages and index into its folder (whole files: a killed run leaves
    no torn one, and a resumed run rewrites the step). `credit`: `m1.marl.rollout.episodes.generation_credit` of the
    step; `live` (dynamic sampling): agent -> per-question flags, False where the question's group tied and was dropped.
    Returns the folder and the rows."""
    folder = step_dir(out_dir, step)
    folder.mkdir(parents=True, exist_ok=True)
    index = TraceIndex(folder)
    rows: list[dict[str, Any]] = []
    seen: set[str] = set()
    k_count = len(batch.episodes[0]) if batch.episodes else 0
    for g, group in enumerate(batch.episodes):
        for k, ep in enumerate(group):
            name = f"{ep.id}.r{k}" if f"{ep.id}.r{k}" not in seen else f"{ep.id}.q{g}.r{k}"
            seen.add(name)
            parts = batch.breakdowns[g * k_count + k] if batch.breakdowns else {}
            gens = []
            for i, gen in enumerate(ep.generations):
                c = credit.get((g, k, i))
                if c is None:  # an agent that is not trained: its generations are context
                    gens.append(gen)
                    continue
                trained = c.trained and (live is None or bool(live[gen.agent][g]))
                info = {"reward": _num(c.reward), "advantage": _num(c.advantage), "trained": trained}
                reward_parts = _parts(parts.get(gen.agent))
                gens.append(gen.model_copy(update={"credit": {**info, "parts": reward_parts}}))
                row = {"step": step, "episode": name, "question_id": ep.question.id, "group": g, "rollout": k,
                       "agent": gen.agent, "phase": gen.phase, "turn": gen.step,
                       "prompt": _prompt_text(gen.prompt), "completion": gen.completion, "parse_ok": gen.parse_ok,
                       **info, "reward_parts": reward_parts, "error": ep.error}
                rows.append(row)
            write_trace(folder, ep.model_copy(update={"id": name, "generations": gens}), pool=pool, index=index)
    write_whole(folder / SAMPLES_FILE, "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows).encode())
    up = (f"../../{INDEX_NAME}", "the training run (`m1 view` writes its page)")
    write_whole(folder / INDEX_NAME, index.html(f"M1 training samples · step {step}", up=up).encode())
    return folder, rows


def table_rows(rows: list[dict[str, Any]]) -> list[list]:
    """The rows as a tracker table (TABLE_COLUMNS): the prompt is its last message, texts cut to a readable size."""
    out = []
    for r in rows:
        prompt = r["prompt"][-1]["content"] if r["prompt"] else ""
        out.append([r["question_id"], r["rollout"], r["agent"], r["phase"], prompt[-_TABLE_TEXT:],
                    r["completion"][:_TABLE_TEXT], r["reward"], r["advantage"], r["trained"]])
    return out
