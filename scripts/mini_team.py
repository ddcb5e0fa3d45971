"""The mini team on M1-Synth: untrained, SFT on the rule-based teacher, SFT + MARL, and the teacher team itself,
each over several training seeds on one held-out question set; writes the table to docs/mini_team.md.

Per seed s: the four tiny agents of configs/team/mini.yaml are initialised from their spec seeds shifted by s,
fine-tuned on the teacher's kept generations (configs/sft/mini.yaml: each seat learns from the teacher seat of its
name), then trained with multi-agent GRPO from those weights (configs/marl/mini.yaml). The teacher team's row varies
its error-draw seeds with s. Every team answers the same held-out questions (a world seed never used in training)
greedily over the complete graph; accuracy is `m1.data.metrics.is_correct` of the team's final answer.
Rerunning with the same --out resumes a killed run: finished stages are reused, training resumes from its newest
checkpoint, and a folder left by other settings is started again.

    python scripts/mini_team.py            # the full run (3 seeds) -> docs/mini_team.md
    python scripts/mini_team.py --quick    # a short version for CI (1 seed, few questions, few steps)
    python scripts/mini_team.py --dev --rows sft sft+marl --marl-set learner.lr=1e-4   # choose settings

The held-out set is only ever evaluated: settings are chosen with `--dev`, which evaluates on another world
(seed 2001, never trained on, never reported as the result) and writes its table under the work folder.
"""
from __future__ import annotations

import argparse
import json
import logging
import math
import os
import re
import shutil
import statistics
import sys
import time
from collections import defaultdict
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from m1.config import TeamConfig, load_team  # noqa: E402
from m1.models.hf import is_adapter  # noqa: E402
from m1.run import read_questions, team_signature, weight_stamp  # noqa: E402

log = logging.getLogger("mini_team")

ROWS = ("untrained", "sft", "sft+marl", "teacher")
LABELS = {"untrained": "mini team, untrained", "sft": "mini team, SFT", "sft+marl": "mini team, SFT + MARL",
          "teacher": "teacher team (rule-based)"}


@dataclass
class Budget:
    """Everything that sets the size (and CPU time) of a run."""

    seeds: tuple[int, ...] = (0, 1, 2)
    # 20 videos left SFT's seed spread at 7.5 points on the dev world, 40: 2.0 (same steps); 120: 3x the unique
    # questions (held-out SFT 43.3 +- 6.3 against 42.3 +- 3.1 on 40; qwen3_big's plans copy the question's object
    # into their key info for 41 of 143 questions instead of 19)
    train_videos: int = 120
    # 50 videos, 500 questions: one accuracy on 160 questions has a standard error of ~3.9 points, and a MARL gain of
    # 4.8 on 160 held-out questions came with losses on the dev world and on a fresh 500-question world
    eval_videos: int = 50
    duration: float = 120.0  # seconds per video
    questions_per_video: int = 10
    train_seed: int = 1  # world seed of the training questions
    eval_seed: int = 1001  # world seed of the held-out questions (never trained on)
    # world seed of MARL's questions (as many videos as training); None: the training world, whose questions SFT
    # taught from the teacher's episodes. MARL there: held-out +0.0 (dev -0.2); on world 5: +2.8 (dev +1.5) for
    # seeds 0-2, but -0.7 (dev +1.9) for seeds 3-5: +1.1 +- 2.7 over six seeds (docs/mini_team_6seeds.md)
    marl_seed: int | None = 5
    sft_epochs: int | None = None  # None: configs/sft/mini.yaml
    # replaces epochs: ~1.1 passes over the teacher examples of 120 videos. 600 steps (~0.5 passes: each seed saw
    # another half of the examples) gave SFT 45.1 +- 3.4 held-out (dev 44.0, 46.6, 41.6); 1200: 51.5 +- 1.3 held-out
    # (dev 51.6, 55.8, 51.2), open questions 15 -> 42%
    sft_max_steps: int | None = 1200
    marl_steps: int | None = None  # None: configs/marl/mini.yaml
    marl_questions_per_step: int | None = None
    progress: bool = True
    communicate_per_episode: int | None = 1  # communicate examples kept per (question, agent); None: all
    tiny_clip: bool = False  # a random tiny CLIP instead of the configs' trained one (CI: no 4-minute CLIP training)
    overrides_sft: list[str] = field(default_factory=list)
    overrides_marl: list[str] = field(default_factory=list)


FULL = Budget()
DEV_SEED = 2001  # world seed of the dev questions that settings are chosen on (neither trained on nor reported)
QUICK = Budget(seeds=(0,), train_videos=2, eval_videos=1, duration=60.0, questions_per_video=8,
               sft_epochs=2, sft_max_steps=None, marl_steps=2, marl_questions_per_step=2, tiny_clip=True)
# the random CLIP of configs/team/tiny.yaml, for --quick and tests
TINY_CLIP = {"kind": "clip", "backend": "open_clip", "device": "cpu",
             "tiny": {"arch": "open_clip", "hidden_size": 64, "layers": 2, "image_size": 64, "seed": 6}}


# ------------------------------------------------------------------------------------------------ configs
def with_tools(cfg: TeamConfig, clip_cache: Path | None, tiny_clip: bool) -> TeamConfig:
    """Share one on-disk CLIP embedding cache; optionally swap the CLIP for a random tiny one."""
    models = dict(cfg.models)
    if tiny_clip:
        from m1.config import ModelSpec

        models[cfg.tools.clip] = ModelSpec.model_validate(TINY_CLIP)
    tools = cfg.tools.model_copy(update={"clip_cache_dir": str(clip_cache) if clip_cache else None})
    return cfg.model_copy(update={"models": models, "tools": tools})


def mini_config(seed: int, weights: dict[str, Path] | None = None, clip_cache: Path | None = None,
                tiny_clip: bool = False, adapters: dict[str, Path] | None = None) -> TeamConfig:
    """The mini team for training seed `seed`: tiny specs with seeds shifted by 1000*seed, or trained weights
    (with LoRA `adapters` on top of them, for the agents that have one)."""
    cfg = load_team("mini")
    models = {}
    chat_keys = {a.model for a in cfg.agents}
    for key, spec in cfg.models.items():
        if key in chat_keys:
            if weights is not None:
                agent = next(a.name for a in cfg.agents if a.model == key)
                adapter = (adapters or {}).get(agent)
                spec = spec.model_copy(update={"tiny": None, "path": str(weights[agent]),
                                               "adapter": str(adapter) if adapter is not None else None})
            elif spec.tiny is not None:
                spec = spec.model_copy(update={"tiny": spec.tiny.model_copy(update={"seed": spec.tiny.seed + 1000 * seed})})
        models[key] = spec
    return with_tools(cfg.model_copy(update={"models": models}), clip_cache, tiny_clip)


def trained_config(seed: int, base: dict[str, Path], trained: dict[str, Path], clip_cache: Path | None = None,
                   tiny_clip: bool = False) -> TeamConfig:
    """The mini team after a training run: `trained` (`final_weights`) holds full-model folders, which replace
    `base`, or LoRA adapter folders (a run with `learner.finetune: lora`), which go on top of it."""
    adapters = {a: p for a, p in trained.items() if is_adapter(p)}
    weights = {a: (base[a] if a in adapters else p) for a, p in trained.items()}
    return mini_config(seed, weights, clip_cache, tiny_clip, adapters)


def teacher_config(seed: int, clip_cache: Path | None = None, tiny_clip: bool = False) -> TeamConfig:
    """configs/team/synth_teacher.yaml with its error-draw seeds shifted by 100*seed (its own tool budgets)."""
    cfg = load_team("synth_teacher")
    models = {k: (s.model_copy(update={"seed": s.seed + 100 * seed}) if s.backend == "synth" and s.kind == "chat"
                  else s) for k, s in cfg.models.items()}
    return with_tools(cfg.model_copy(update={"models": models}), clip_cache, tiny_clip)


def sft_teacher_config(sft_cfg, clip_cache: Path | None, tiny_clip: bool = False) -> TeamConfig:
    """The teacher that writes SFT data: synth_teacher seated under the students' names, with the students' tools."""
    return with_tools(sft_cfg.teacher_config(), clip_cache, tiny_clip)


# ------------------------------------------------------------------------------------------------ data
def make_world(folder: Path, videos: int, seed: int, b: Budget) -> list:
    """The questions of one synthetic world, rendered into `folder` on first use."""
    from m1.synth.make import make_dataset

    qfile = folder / "questions.jsonl"
    if not qfile.is_file():
        make_dataset(folder, videos, seed, duration=b.duration, questions_per_video=b.questions_per_video,
                     progress=b.progress)
    qs, issues = read_questions(qfile, folder)
    if issues:
        raise ValueError(f"{qfile}: {issues[:3]}")
    return qs


def check_disjoint(held_qs: list, trained: list, what: str, seed: int, b: Budget) -> None:
    """The worlds live in different folders, so compare what the videos hold: a held-out video rendered from a
    training script (the same world seed, say) would let the table score questions the students were trained on."""
    from m1.tools.clip_index import file_sha256

    trained_videos = {file_sha256(v): v for v in {q.video for q in trained}}
    for v in sorted({q.video for q in held_qs}):
        same = trained_videos.get(file_sha256(v))
        if same is not None:
            raise ValueError(f"held-out video {v} has the same bytes as {what} video {same}: the held-out world "
                             f"(seed {b.eval_seed}) must differ from the {what} world (seed {seed})")


def make_sets(out: Path, b: Budget) -> tuple[list, list]:
    """(training questions, held-out questions)."""
    train_qs = make_world(out / "train", b.train_videos, b.train_seed, b)
    held_qs = make_world(out / f"eval{b.eval_seed}", b.eval_videos, b.eval_seed, b)
    check_disjoint(held_qs, train_qs, "training", b.train_seed, b)
    return train_qs, held_qs


def marl_questions(out: Path, b: Budget, train_qs: list, held_qs: list) -> list:
    """MARL's questions: the training world's, or (`marl_seed`) a world of as many videos that SFT never saw."""
    if b.marl_seed is None:
        return train_qs
    qs = make_world(out / f"marl{b.marl_seed}", b.train_videos, b.marl_seed, b)
    check_disjoint(held_qs, qs, "MARL", b.marl_seed, b)
    return qs


# ------------------------------------------------------------------------------------------------ resuming
def run_relative(text: str, root: Path | None) -> str:
    """`text` (JSON) with the paths under `root`, the run's --out, written as `<run>/...`: a `cp -a` copy of a run
    folder then matches the original's records."""
    return text.replace(f'"{root}/', '"<run>/') if root is not None else text


def stage_folder(folder: Path, settings: dict[str, Any], root: Path | None = None) -> None:
    """Keep `folder` (so its trainer resumes from the newest checkpoint) only if it was started with `settings`.

    A killed run then repeats no finished stage and resumes a half-done one; a folder left by other settings is
    cleared, so a stale checkpoint is never mistaken for this run's. Paths under `root` (the run's --out) are
    recorded relative to it, so a copy of a run folder (`cp -a`, which keeps the weight files' times) reuses its
    finished stages: a MARL variant can start from another run's SFT weights without touching that run.
    """
    marker = folder / "settings.json"
    raw = json.dumps(settings, sort_keys=True, default=str)
    text = run_relative(raw, root)
    if marker.is_file() and marker.read_text() in (text, raw):  # raw: a marker written before paths were relative
        marker.write_text(text)
        return
    if folder.exists():
        log.info("%s: started with other settings, starting it again", folder)
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    marker.write_text(text)


def read_metrics(run_dir: Path) -> list[dict]:
    """Every step's row of a (possibly resumed) training run, from its metrics.jsonl."""
    path = run_dir / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.is_file() else []


def evaluate_cached(path: Path, cfg: TeamConfig, questions: list, pool, progress: bool = False,
                    root: Path | None = None) -> dict[str, Any]:
    """`evaluate`, stored in `path` with the team (config and weights) and question ids it was computed for (a
    killed run reuses it; so does a `cp -a` copy of the run folder `root`, whose paths the key holds relative)."""
    raw = json.dumps({"team": team_signature(cfg), "questions": [q.id for q in questions]}, sort_keys=True)
    key = run_relative(raw, root)
    if path.is_file():
        saved = json.loads(path.read_text())
        if saved.get("key") in (key, raw):  # raw: stored before keys were made relative
            return saved["result"]
    path.parent.mkdir(parents=True, exist_ok=True)
    result = evaluate(cfg, questions, pool, progress, traces=path.with_suffix(".traces.jsonl"))
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"key": key, "result": result}))
    tmp.replace(path)
    return result


# ------------------------------------------------------------------------------------------------ evaluation
def evaluate(cfg: TeamConfig, questions: list, pool, progress: bool = False, traces: Path | None = None
             ) -> dict[str, Any]:
    """Greedy team answers on `questions`: accuracy, per-family accuracy, strict-format rates per phase.

    `traces`: also write one JSON line per question (truth, team answer, each agent's answer and which of its
    generations parsed), so a change in accuracy can be traced to questions and agents without rerunning.
    """
    from m1.data.metrics import is_correct
    from m1.marl.rewards import agent_answer
    from m1.synth.teacher import plan_for
    from m1.team.cpp import Team

    team = Team(cfg.greedy(), pool=pool)
    episodes = []
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=len(questions), desc=f"eval {cfg.name}", unit="q", leave=False)
    episodes = team.run(questions, on_episode=(lambda e: bar.update(1)) if bar else None)
    if bar:
        bar.close()
    fam: dict[str, list[bool]] = defaultdict(list)
    parse: dict[str, list[bool]] = defaultdict(list)
    for ep in episodes:
        fam[ep.question.meta.get("family", ep.question.task)].append(bool(is_correct(ep.question, ep.final_answer)))
        for g in ep.generations:
            parse[g.phase].append(bool(g.parse_ok))
    if traces is not None:
        lines = []
        for ep in episodes:
            q = ep.question
            answers = {a: agent_answer(ep, a) for a in ep.memory}
            lines.append(json.dumps({
                "id": q.id, "family": q.meta.get("family", q.task), "truth": q.answer, "answer": ep.final_answer,
                "correct": bool(is_correct(q, ep.final_answer)), "aggregation": ep.aggregation, "error": ep.error,
                "teacher_key_info": plan_for(q.text)[0],
                "agents": {a: {"answer": ans, "correct": bool(is_correct(q, ans)),
                               "parsed": [[g.phase, g.parse_ok] for g in ep.generations if g.agent == a],
                               "notes_letters": notes_letters(ep, a), "key_info": plan_key_info(ep, a)}
                           for a, ans in answers.items()}}))
        tmp = traces.with_suffix(".tmp")
        tmp.write_text("\n".join(lines) + "\n")
        tmp.replace(traces)
    allc = [c for v in fam.values() for c in v]
    return {"accuracy": sum(allc) / len(allc), "n": len(allc),
            "family": {f: sum(v) / len(v) for f, v in sorted(fam.items())},
            "family_n": {f: len(v) for f, v in sorted(fam.items())},
            "parse_ok": {p: sum(v) / len(v) for p, v in sorted(parse.items())},
            "failed": sum(e.error is not None for e in episodes)}


_NOTED_LETTER = re.compile(r"##Answer: ([A-Z])\b")


def plan_key_info(episode, agent: str) -> str:
    """The key info the agent's plan ran with: its first step's ("" without steps). The record's own key_info is
    the latest one, which an added tool's key info replaces."""
    rec = episode.memory.get(agent)
    return rec.turns[0].key_info if rec is not None and rec.turns else ""


def read_traces(path: Path) -> list[dict] | None:
    """The question lines of an evaluation's `.traces.jsonl`, or None when it was not written."""
    if not path.is_file():
        return None
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def notes_letters(episode, agent: str) -> list[str] | None:
    """The option letters the notes in the agent's answer prompt name (the synth browsers end their reports with
    `##Answer: X`; the reply template's `##Answer: <option letter>` does not match). None for non-MCQ questions."""
    if not episode.question.options:
        return None
    prompts = [g.prompt for g in episode.generations if g.agent == agent and g.phase == "answer"]
    return _NOTED_LETTER.findall(prompts[-1][-1]["content"]) if prompts else []


def reading(traces: Path) -> dict[str, int] | None:
    """How agents used their notes on MCQ questions, from a `.traces.jsonl`: agent answers, those whose notes
    named the true letter ("evidence") and those of them answered right ("read"), and the answers for which the
    letter the notes name most often is the truth ("majority": what copying that letter would score). None
    without such traces."""
    lines = read_traces(traces)
    if lines is None:
        return None
    out = {"answers": 0, "evidence": 0, "read": 0, "majority": 0}
    for t in lines:
        for a in t["agents"].values():
            if "notes_letters" not in a:
                return None  # traces written before notes were recorded
            letters = a["notes_letters"]
            if letters is None:
                continue  # not an MCQ question
            out["answers"] += 1
            if letters:
                out["majority"] += max(letters, key=letters.count) == t["truth"]  # ties: the first named
            if t["truth"] in letters:
                out["evidence"] += 1
                out["read"] += bool(a["correct"])
    return out


def key_info_copied(traces: Path) -> dict[str, dict[str, int]] | None:
    """Per agent, on the non-open questions of a `.traces.jsonl` (M1-Synth's open questions have a fixed key info),
    how many plans wrote the key info the teacher writes: the question's object, objects or time, copied. A wrong
    one sends retrieval to the wrong clip. None without such traces."""
    lines = read_traces(traces)
    if lines is None:
        return None
    out: dict[str, dict[str, int]] = {}
    for t in lines:
        if "teacher_key_info" not in t:
            return None  # traces written before key info was recorded
        if t["family"] == "open":
            continue
        for name, a in t["agents"].items():
            c = out.setdefault(name, {"questions": 0, "copied": 0})
            c["questions"] += 1
            c["copied"] += a["key_info"].strip().lower() == t["teacher_key_info"].lower()
    return out


def answer_changes(before: Path, after: Path) -> dict[str, int] | None:
    """How a second team's answers differ from a first's on the same questions, from their `.traces.jsonl`
    files: answers changed, wrong ones made right ("fixed"), right ones made wrong ("broken"). None when either
    file is missing (an evaluation cached before traces were written)."""
    first, second = read_traces(before), read_traces(after)
    if first is None or second is None:
        return None
    a, b = ({t["id"]: t for t in lines} for lines in (first, second))
    if set(a) != set(b):
        raise ValueError(f"{before} and {after} cover different questions")
    return {"n": len(a), "changed": sum(a[i]["answer"] != b[i]["answer"] for i in a),
            "fixed": sum(b[i]["correct"] and not a[i]["correct"] for i in a),
            "broken": sum(a[i]["correct"] and not b[i]["correct"] for i in a)}


# ------------------------------------------------------------------------------------------------ training
def teacher_examples(sft_cfg, questions: list, clip_cache: Path, pool, tiny_clip: bool = False,
                     threads: int | None = None):
    """The teacher's kept generations on `questions` and the keep-rule counts (`m1.marl.sft.build_sft_data`)."""
    if threads is not None:  # a worker process of build_examples
        import torch

        torch.set_num_threads(threads)
    from m1.marl.sft import build_sft_data
    from m1.team.cpp import Team
    from m1.video import VideoPool

    teacher = Team(sft_teacher_config(sft_cfg, clip_cache, tiny_clip), pool=pool if pool is not None else VideoPool())
    return build_sft_data(teacher, questions, sft_cfg.rewards, None, sft_cfg.data.phases,
                          sft_cfg.data.rollouts_per_question, sft_cfg.data.rotate_options,
                          sft_cfg.data.keep_revised_plans)


def video_shards(questions: list, n: int) -> list[list]:
    """`questions` cut into at most `n` contiguous runs of whole videos (each worker then indexes its own videos)."""
    by_video: dict[str, list] = {}
    for q in questions:
        by_video.setdefault(q.video, []).append(q)
    videos = list(by_video.values())
    size = math.ceil(len(videos) / max(n, 1)) if videos else 1
    return [[q for v in videos[i:i + size] for q in v] for i in range(0, len(videos), size)]


def build_examples(sft_cfg, train_qs: list, out: Path, clip_cache: Path, pool, tiny_clip: bool = False,
                   communicate_per_episode: int | None = None, jobs: int = 1):
    """Teacher generations on the training questions, kept by the paper's rule (cached in out/sft_examples.jsonl,
    rebuilt when the data settings recorded in its stats differ from these).

    `communicate_per_episode` thins the communicate examples (almost all `continue()`, and the longest prompts) to
    the first N of each agent per question (over all its rollouts): a data budget applied after the keep rule,
    counted in the stats. `jobs` > 1 runs the teacher over that many shards of whole videos in worker processes;
    the teacher's choices depend only on each prompt (m1/synth/teacher.py), so the shards' examples, concatenated
    in order, are the ones a single process keeps.
    """
    from m1.marl.sft import read_examples, write_examples

    path, stats_path = out / "sft_examples.jsonl", out / "sft_examples.stats.json"
    settings = {**sft_data_settings(sft_cfg), "communicate_per_episode": communicate_per_episode}
    if path.is_file() and stats_path.is_file():
        cached = json.loads(stats_path.read_text())
        if cached.get("data") == settings:
            return read_examples(path), cached
        log.info("%s was built with other data settings: rebuilding it", path)
    shards = video_shards(train_qs, jobs)
    if len(shards) > 1:
        import multiprocessing as mp
        from concurrent.futures import ProcessPoolExecutor

        with ProcessPoolExecutor(max_workers=len(shards), mp_context=mp.get_context("spawn")) as ex:
            parts = list(ex.map(teacher_examples, [sft_cfg] * len(shards), shards, [clip_cache] * len(shards),
                                [None] * len(shards), [tiny_clip] * len(shards), [1] * len(shards)))
        examples = [e for part, _ in parts for e in part]
        stats: dict[str, Any] = defaultdict(int)
        for _, part_stats in parts:
            for k, v in part_stats.items():
                stats[k] += v
        stats = dict(stats)
    else:
        examples, stats = teacher_examples(sft_cfg, train_qs, clip_cache, pool, tiny_clip)
    if communicate_per_episode is not None:
        seen: dict[tuple[str, str], int] = defaultdict(int)
        thinned = []
        for e in examples:
            if e.phase == "communicate":
                seen[(e.question_id, e.agent)] += 1
                if seen[(e.question_id, e.agent)] > communicate_per_episode:
                    continue
            thinned.append(e)
        stats["thinned_communicate"] = len(examples) - len(thinned)
        examples = thinned
    stats["by_phase"] = {ph: sum(e.phase == ph for e in examples) for ph in sorted({e.phase for e in examples})}
    stats["data"] = settings
    write_examples(path, examples)
    stats_path.write_text(json.dumps(stats, indent=1))
    return examples, stats


def sft_data_settings(sft_cfg) -> dict[str, Any]:
    """The settings that decide which teacher examples SFT learns from."""
    d = sft_cfg.data
    return {"phases": list(d.phases), "assign": d.assign, "rollouts_per_question": d.rollouts_per_question,
            "rotate_options": d.rotate_options, "keep_revised_plans": d.keep_revised_plans,
            "teacher_overrides": list(d.teacher_overrides)}


def final_weights(run_dir: Path, agents: list[str], averaged: bool = False) -> dict[str, Path]:
    """The agents' full-model folders of a run, or their LoRA adapter folders (`learner.finetune: lora`): its
    averaged weights (MARL's `average`, m1/marl/average.py) or those of its newest checkpoint."""
    from m1.marl.average import AVERAGE_DIR
    from m1.marl.checkpoint import find_latest_checkpoint

    if averaged:
        root = Path(run_dir) / AVERAGE_DIR
        if not (root / "average.json").is_file():
            raise FileNotFoundError(f"{root}: the run's averaged weights were not written")
    else:
        root = find_latest_checkpoint(run_dir)
        if root is None:
            raise FileNotFoundError(f"{run_dir}: no checkpoint was written")
    out = {a: root / "agents" / a / ("adapter" if is_adapter(root / "agents" / a / "adapter") else "model")
           for a in agents}
    missing = [str(p) for p in out.values() if not ((p / "config.json").is_file() or is_adapter(p))]
    if missing:
        raise FileNotFoundError(f"{root}: no full-model or adapter folder for {missing}")
    return out


def run_sft(seed: int, examples, out: Path, b: Budget, clip_cache: Path) -> tuple[dict[str, Path], list[dict]]:
    from m1.marl.config import load_sft_config
    from m1.marl.sft import SFTTrainer

    cfg = load_sft_config("mini", list(b.overrides_sft))
    if cfg.learner.finetune != "full":  # checked before any training: MARL and the table need whole SFT models
        raise ValueError(f"SFT learner.finetune={cfg.learner.finetune!r}: the mini team's SFT trains randomly "
                         "initialised students, so it must be 'full' (MARL may use LoRA on top of its weights)")
    team = mini_config(seed, clip_cache=clip_cache, tiny_clip=b.tiny_clip)
    update: dict[str, Any] = {"team": team, "team_overrides": [], "seed": seed, "out_dir": str(out),
                              "log": cfg.log.model_copy(update={"progress": b.progress})}
    if b.sft_epochs is not None:
        update["epochs"] = b.sft_epochs
    if b.sft_max_steps is not None:
        update["max_steps"] = b.sft_max_steps
    cfg = cfg.model_copy(update=update)
    stage_folder(out, {"config": cfg.model_dump(mode="json", exclude={"log"}), "examples": len(examples)},
                 root=out.parent.parent)  # out is <run>/seed<k>/sft
    trainer = SFTTrainer(cfg, examples=list(examples))
    trainer.train()
    trainer.learners.shutdown()
    return final_weights(out, [a.name for a in team.agents]), read_metrics(out)


def run_marl(seed: int, sft_weights: dict[str, Path], questions: list, out: Path, b: Budget, clip_cache: Path,
             pool) -> tuple[dict[str, Path], list[dict]]:
    from m1.marl.config import load_train_config
    from m1.marl.trainer import Trainer

    cfg = load_train_config("mini", list(b.overrides_marl))
    team = mini_config(seed, weights=sft_weights, clip_cache=clip_cache, tiny_clip=b.tiny_clip)
    update: dict[str, Any] = {"team": team, "team_overrides": [], "seed": seed, "out_dir": str(out),
                              "log": cfg.log.model_copy(update={"progress": b.progress})}
    if b.marl_steps is not None:
        update["steps"] = b.marl_steps
    if b.marl_questions_per_step is not None:
        update["rollout"] = cfg.rollout.model_copy(update={"questions_per_step": b.marl_questions_per_step})
    cfg = cfg.model_copy(update=update)
    # SFT trained again (new weight files) means MARL starts again. Averaging and checkpoint retention do not change
    # training: a finished stage with other `average` settings is only averaged again (m1/marl/average.py)
    sft_stamp = {a: weight_stamp(p) for a, p in sorted(sft_weights.items())}
    trained = cfg.model_dump(mode="json", exclude={"log": True, "average": True, "checkpoint": {"keep_last"}})
    settings = {"config": trained, "questions": len(questions), "sft": sft_stamp}
    if b.marl_seed is not None:  # absent otherwise, so runs made before the option keep their finished MARL stage
        settings["marl_world"] = b.marl_seed
    stage_folder(out, settings, root=out.parent.parent)  # out is <run>/seed<k>/marl
    trainer = Trainer(cfg, questions=questions)
    trainer.pool = pool  # share decoded frames with the evaluations
    try:
        trainer.train()
    finally:
        trainer.close()
    return final_weights(out, [a.name for a in team.agents], cfg.average.checkpoints > 0), read_metrics(out)


# ------------------------------------------------------------------------------------------------ shipped weights
def export_weights(out: Path, seed: int, dest: Path, averaged: bool) -> None:
    """Copy seed `seed`'s SFT+MARL agents (full-model folders, no optimizer) to `dest`/<agent>, replacing it whole;
    LoRA-trained agents are written with their adapter merged into the SFT weights.

    `configs/team/mini_trained.yaml` (the team of `make demo`) reads the copy shipped in assets/mini_team.
    """
    from m1.models.hf import HFChatModel

    agents = [a.name for a in load_team("mini").agents]
    weights = final_weights(out / f"seed{seed}" / "marl", agents, averaged)
    tmp = dest.parent / f".{dest.name}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    team = trained_config(seed, final_weights(out / f"seed{seed}" / "sft", agents), weights)
    for agent, src in weights.items():
        if is_adapter(src):
            spec = team.models[next(a.model for a in team.agents if a.name == agent)]
            merged = HFChatModel(spec, agent)
            merged.model.save_pretrained(tmp / agent)
            merged.tokenizer.save_pretrained(tmp / agent)
        else:
            shutil.copytree(src, tmp / agent)
    (tmp / "SOURCE.md").write_text(
        f"The mini team after SFT + MARL, training seed {seed}, written by `python scripts/mini_team.py --export "
        f"{dest}` (see docs/mini_team.md for the run and its settings).\n")
    shutil.rmtree(dest, ignore_errors=True)
    tmp.rename(dest)


# ------------------------------------------------------------------------------------------------ the table
def mean_std(xs: list[float]) -> tuple[float, float]:
    return (statistics.fmean(xs), statistics.stdev(xs) if len(xs) > 1 else 0.0)


def fmt(xs: list[float]) -> str:
    m, s = mean_std(xs)
    return f"{100 * m:.1f} ± {100 * s:.1f}" if len(xs) > 1 else f"{100 * m:.1f}"


def render_table(results: dict[str, list[dict]], meta: dict[str, Any]) -> str:
    seeds = meta["seeds"]
    lines = [f"| team | accuracy % (mean ± std over {len(seeds)} seed{'s' if len(seeds) > 1 else ''}) | per seed | "
             "plans in strict format |", "|---|---|---|---|"]
    for row in ROWS:
        rs = results.get(row) or []
        if not rs:
            continue
        acc = [r["accuracy"] for r in rs]
        plan = [r["parse_ok"].get("plan", float("nan")) for r in rs]
        lines.append(f"| {LABELS[row]} | {fmt(acc)} | {', '.join(f'{100 * a:.1f}' for a in acc)} | "
                     f"{100 * statistics.fmean(plan):.0f}% |")
    fams = sorted({f for rs in results.values() for r in rs for f in r["family"]})
    first = next(iter(results.values()))[0]
    fam_lines = ["| family | n | " + " | ".join(LABELS[r] for r in ROWS if results.get(r)) + " |",
                 "|---|---|" + "---|" * sum(bool(results.get(r)) for r in ROWS)]
    for f in fams:
        cells = [fmt([r["family"].get(f, float("nan")) for r in results[row]]) for row in ROWS if results.get(row)]
        fam_lines.append(f"| {f} | {first['family_n'].get(f, 0)} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n\nPer question family (accuracy %, mean ± std over seeds):\n\n" + "\n".join(fam_lines)


def verdict(results: dict[str, list[dict]]) -> str:
    if len(results.get("sft", [])) < 2 or len(results.get("sft+marl", [])) < 2:
        return "No claim about the seed spread: it needs SFT and SFT+MARL rows of 2 or more seeds each."
    sft, marl = [r["accuracy"] for r in results["sft"]], [r["accuracy"] for r in results["sft+marl"]]
    gap = statistics.fmean(marl) - statistics.fmean(sft)
    spread = max(statistics.stdev(sft), statistics.stdev(marl))
    holds = gap > spread
    text = (f"SFT+MARL − SFT = {100 * gap:+.1f} points; the larger seed std is {100 * spread:.1f} points: "
            f"the gain {'exceeds' if holds else 'does NOT exceed'} the seed spread.")
    if len(sft) == len(marl):  # MARL of seed s starts from the SFT weights of seed s: the pairs are comparable
        gains = [m - s for s, m in zip(sft, marl)]
        g_mean, g_std = mean_std(gains)
        text += (f" Per seed (MARL from that seed's SFT weights): {', '.join(f'{100 * g:+.1f}' for g in gains)} "
                 f"points, {100 * g_mean:+.1f} ± {100 * g_std:.1f}; "
                 f"{sum(g > 0 for g in gains)} of {len(gains)} seeds improve.")
    return text


def sign_test_p(fixed: int, broken: int) -> float:
    """Exact two-sided sign (McNemar) test on the questions one team got right and the other wrong: the chance of
    a split at least this uneven if each such question were a fair coin."""
    n, k = fixed + broken, min(fixed, broken)
    return min(1.0, 2 * sum(math.comb(n, i) for i in range(k + 1)) / 2 ** n) if n else 1.0


def paired_gain(c: dict[str, int]) -> tuple[float, float]:
    """MARL's gain in points on these questions and its standard error, paired per question (each question adds
    +1, 0 or −1): a seed's gain on one world is only known to about this, whatever the seed spread."""
    n = c["n"]
    if not n:
        return 0.0, 0.0
    diff = (c["fixed"] - c["broken"]) / n
    var = (c["fixed"] + c["broken"]) / n - diff ** 2
    return 100 * diff, 100 * math.sqrt(max(var, 0.0) / n)


def changes_text(curves: dict[str, Any]) -> list[str]:
    """A paragraph on how many held-out answers MARL changed per seed (a gain made of few fixes and no breaks is
    learning; many changes both ways are a perturbation), or nothing when no traces were compared."""
    parts = []
    for key, c in sorted(curves.items()):
        if key.endswith("/marl_changes") and c:
            gain, se = paired_gain(c)
            parts.append(f"{key.split('/')[0]}: {c['changed']} of {c['n']} team answers changed, {c['fixed']} wrong → "
                         f"right, {c['broken']} right → wrong, gain {gain:+.1f} ± {se:.1f} points (paired standard "
                         f"error; sign test p = {sign_test_p(c['fixed'], c['broken']):.2f})")
    return [f"What MARL changed, against the same seed's SFT team: {'; '.join(parts)}.", ""] if parts else []


def reading_text(curves: dict[str, Any]) -> list[str]:
    """A paragraph on how often agents' notes held the true letter and how often they then answered it, per seed
    and stage (planning finds the evidence, answering has to read it), or nothing without such traces."""
    def one(name: str, r: dict[str, int]) -> str:
        return (f"{name} the truth in the notes of {r['evidence']} of {r['answers']} agent answers, "
                f"{100 * r['read'] / max(r['evidence'], 1):.0f}% of those answered right (the letter the notes name "
                f"most, first on ties: right for {100 * r['majority'] / r['answers']:.0f}% of all)")

    parts = []
    for seed in sorted({key.split("/")[0] for key in curves if key.endswith("_reading")}):
        found = [(name, curves.get(f"{seed}/{stage}_reading")) for name, stage in (("SFT", "sft"), ("MARL", "marl"))]
        stages = [one(name, r) for name, r in found if r and r["answers"]]
        if stages:
            parts.append(f"{seed}: {'; '.join(stages)}")
    return [f"Reading the notes (MCQ; notes are the tool reports an agent sees when it answers): "
            f"{' — '.join(parts)}.", ""] if parts else []


def key_info_text(curves: dict[str, Any]) -> list[str]:
    """A paragraph on how many plans copied the teacher's key info, per seed, stage and agent (finding the evidence
    starts there), or nothing without such traces."""
    parts = []
    for seed in sorted({key.split("/")[0] for key in curves if key.endswith("_key_info")}):
        found = [(name, curves.get(f"{seed}/{stage}_key_info")) for name, stage in (("SFT", "sft"), ("MARL", "marl"))]
        stages = [f"{name} " + ", ".join(f"{a} {c['copied']}/{c['questions']}" for a, c in per.items())
                  for name, per in found if per]
        if stages:
            parts.append(f"{seed}: {'; '.join(stages)}")
    return [f"Key info as the teacher writes it (the question's object, objects or time; open questions excluded), "
            f"plans per agent: {' — '.join(parts)}.", ""] if parts else []


def _folder_cost(meta: dict[str, Any]) -> str:
    calls = meta.get("folder_calls")
    if not calls:
        return ""
    return (f"Calls in this folder so far: {calls['calls']}, {calls['wall_seconds'] / 60:.1f} min wall, "
            f"{calls['cpu_seconds'] / 60:.1f} min CPU (its calls.jsonl; this counts any variants tried there and, "
            "in a `cp -a` copy, the original's calls). ")


def write_doc(path: Path, table: str, meta: dict[str, Any], results: dict[str, list[dict]],
              curves: dict[str, Any] | None = None) -> None:
    curves = curves or {}
    b = meta["budget"]
    marl_world = "" if b.get("marl_seed") is None else (
        f"; MARL on another {b['train_videos']} videos' questions, world seed {b['marl_seed']}, that SFT never saw")
    text = [
        "# The mini team on M1-Synth",
        "",
        "Regenerate with `python scripts/mini_team.py` (this file is written by it; `--quick` is the CI version).",
        "",
        table,
        "",
        verdict(results),
        "",
        *changes_text(curves),
        *reading_text(curves),
        *key_info_text(curves),
        f"{'Dev (settings are chosen here; not held-out)' if b['eval_seed'] == DEV_SEED else 'Held-out'}: "
        f"{meta['n_heldout']} questions on {b['eval_videos']} videos of {b['duration']:.0f} s (world seed "
        f"{b['eval_seed']}); training: {meta['n_train']} questions on {b['train_videos']} videos (world seed "
        f"{b['train_seed']}{marl_world}); SFT examples from the teacher: {meta['n_examples']} (keep-rule stats and "
        "thinning: "
        f"{json.dumps(meta['sft_stats'])}). Seeds {list(meta['seeds'])}: tiny init, data order and rollout "
        "sampling for the mini team; error draws for the teacher team. Answers are greedy; the team aggregates by "
        "vote (MCQ, numeric) or the first agent's summary (open, grounding).",
        "",
        f"Settings: SFT `{meta['sft_settings']}`; MARL `{meta['marl_settings']}`.",
        "",
        f"Run time of this call: {meta['wall_seconds'] / 60:.1f} min wall, {meta['cpu_seconds'] / 60:.1f} min CPU "
        f"(process user + system) on {os.cpu_count()} cores, torch threads {meta['torch_threads']}. Stages (wall s): "
        + ", ".join(f"{k} {v:.0f}" for k, v in meta["stage_seconds"].items()) + ". " + _folder_cost(meta)
        + "One-time builds cached under "
        "`$M1_CACHE` and not counted when already there: the synth tokenizer (~0.5 min) and the trained synth CLIP "
        "(~4 min)" + ("; this run used a random tiny CLIP instead." if b.get("tiny_clip") else "."),
        "",
    ]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(text))


# ------------------------------------------------------------------------------------------------ main
def world_tag(b: Budget) -> str:
    """Suffix of an evaluation's files: none on the held-out world, `_world<seed>` on another (the dev world), so
    settings can be compared on dev in the main run's folder, from its trained weights, without touching its table."""
    return "" if b.eval_seed == FULL.eval_seed else f"_world{b.eval_seed}"


def run_seed(seed: int, out: Path, b: Budget, rows: tuple[str, ...], threads: int | None = None) -> dict[str, Any]:
    """Every row of one training seed: {"results": {row: eval}, "curves": {...}, "stages": {name: wall s}}.

    Reads the held-out/training questions and the teacher's SFT examples that `run` prepared under `out`, so it
    can run in a worker process (`--jobs`) as well as in the parent.
    """
    if threads is not None:
        import torch

        torch.set_num_threads(threads)
    from m1.marl.config import load_sft_config
    from m1.video import VideoPool

    pool, clip_cache = VideoPool(), out / "clip_cache"
    train_qs, held_qs = make_sets(out / "data", b)
    examples, _ = build_examples(load_sft_config("mini", list(b.overrides_sft)), train_qs, out, clip_cache, pool,
                                 b.tiny_clip, b.communicate_per_episode)
    results: dict[str, dict] = {}
    curves: dict[str, Any] = {}
    stages: dict[str, float] = defaultdict(float)
    t = time.perf_counter()

    def stage(name: str) -> None:
        nonlocal t
        now = time.perf_counter()
        stages[name] += now - t
        t = now

    seed_dir = out / f"seed{seed}"
    ev = "eval" + world_tag(b)
    if "untrained" in rows:
        results["untrained"] = evaluate_cached(seed_dir / f"{ev}_untrained.json",
                                               mini_config(seed, None, clip_cache, b.tiny_clip), held_qs, pool,
                                               b.progress, root=out)
        stage("eval")
    if "teacher" in rows:
        results["teacher"] = evaluate_cached(seed_dir / f"{ev}_teacher.json",
                                             teacher_config(seed, clip_cache, b.tiny_clip), held_qs, pool, b.progress,
                                             root=out)
        stage("eval")
    if "sft" in rows or "sft+marl" in rows:
        sft_w, sft_rows = run_sft(seed, examples, seed_dir / "sft", b, clip_cache)
        stage("sft")
        curves[f"seed{seed}/sft_loss"] = [r["loss"] for r in sft_rows]
        if "sft" in rows:
            results["sft"] = evaluate_cached(seed_dir / "sft" / f"{ev}.json",
                                             mini_config(seed, sft_w, clip_cache, b.tiny_clip), held_qs, pool,
                                             b.progress, root=out)
            curves[f"seed{seed}/sft_reading"] = reading(seed_dir / "sft" / f"{ev}.traces.jsonl")
            curves[f"seed{seed}/sft_key_info"] = key_info_copied(seed_dir / "sft" / f"{ev}.traces.jsonl")
            stage("eval")
        if "sft+marl" in rows:
            marl_qs = marl_questions(out / "data", b, train_qs, held_qs)  # rendered by `run` beforehand
            marl_w, marl_rows = run_marl(seed, sft_w, marl_qs, seed_dir / "marl", b, clip_cache, pool)
            stage("marl")
            curves[f"seed{seed}/marl_reward"] = [r.get("reward/mean") for r in marl_rows]
            curves[f"seed{seed}/marl_team_res"] = [r.get("reward/team_res") for r in marl_rows]
            # with grpo.baseline greedy: the greedy team's result per step, the training curve of what is evaluated
            curves[f"seed{seed}/marl_greedy_team_res"] = [r.get("greedy/team_res") for r in marl_rows]
            results["sft+marl"] = evaluate_cached(seed_dir / "marl" / f"{ev}.json",
                                                  trained_config(seed, sft_w, marl_w, clip_cache, b.tiny_clip),
                                                  held_qs, pool, b.progress, root=out)
            stage("eval")
            curves[f"seed{seed}/marl_reading"] = reading(seed_dir / "marl" / f"{ev}.traces.jsonl")
            curves[f"seed{seed}/marl_key_info"] = key_info_copied(seed_dir / "marl" / f"{ev}.traces.jsonl")
            if "sft" in rows:
                curves[f"seed{seed}/marl_changes"] = answer_changes(seed_dir / "sft" / f"{ev}.traces.jsonl",
                                                                    seed_dir / "marl" / f"{ev}.traces.jsonl")
    log.info("seed %d done: %s", seed, {r: v["accuracy"] for r, v in results.items()})
    return {"results": results, "curves": curves, "stages": dict(stages)}


def run(out: Path, b: Budget, doc: Path | None, rows: tuple[str, ...] = ROWS, jobs: int = 1) -> dict[str, Any]:
    """The whole experiment; returns {"results": {row: [per-seed eval]}, "meta": {...}, "table": str}.

    `jobs` > 1 runs that many seeds at once, each in its own process with the parent's torch thread count, and
    builds the teacher's SFT data in that many shards; the reported CPU time then adds the workers' (user + system)
    to the parent's.
    """
    import resource

    import torch

    from m1.marl.config import load_sft_config
    from m1.video import VideoPool

    t_wall, t_cpu = time.perf_counter(), time.process_time()
    children0 = resource.getrusage(resource.RUSAGE_CHILDREN)  # worker processes: teacher data shards and seeds
    stages: dict[str, float] = defaultdict(float)
    out.mkdir(parents=True, exist_ok=True)
    clip_cache = out / "clip_cache"
    pool = VideoPool()
    if not b.tiny_clip:
        # train (or find) the world's CLIP here, where `progress` reaches its bars, rather than on first use inside
        # the teacher's episodes; the workers of --jobs then find it cached instead of each training it
        from m1.synth.clip_train import ensure_synth_clip

        ensure_synth_clip(progress=b.progress)
    t = time.perf_counter()
    train_qs, held_qs = make_sets(out / "data", b)
    if "sft+marl" in rows:  # rendered here, not by each worker of --jobs at once
        marl_questions(out / "data", b, train_qs, held_qs)
    stages["data"] = time.perf_counter() - t
    t = time.perf_counter()
    sft_cfg = load_sft_config("mini", list(b.overrides_sft))
    examples, stats = build_examples(sft_cfg, train_qs, out, clip_cache, pool, b.tiny_clip,
                                     b.communicate_per_episode, jobs=jobs)
    stages["teacher SFT data"] = time.perf_counter() - t
    # each seed reads the examples from disk and opens its own videos, so the parent lets go of its frame cache and
    # readers before the seeds train (it held 4.4 GB after building 120 videos' examples, and was the process the
    # out-of-memory killer took when two runs shared a 24 GB machine; the examples themselves are ~0.2 GB)
    n_examples = len(examples)
    del examples, pool
    if jobs > 1 and len(b.seeds) > 1:
        import multiprocessing as mp
        from concurrent.futures import ProcessPoolExecutor

        with ProcessPoolExecutor(max_workers=jobs, mp_context=mp.get_context("spawn")) as ex:
            futures = [ex.submit(run_seed, seed, out, b, rows, torch.get_num_threads()) for seed in b.seeds]
            per_seed = [f.result() for f in futures]
    else:
        per_seed = [run_seed(seed, out, b, rows) for seed in b.seeds]
    children1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    results: dict[str, list[dict]] = {r: [] for r in rows}
    curves: dict[str, Any] = {}
    for one in per_seed:  # in seed order
        for r, v in one["results"].items():
            results[r].append(v)
        curves.update(one["curves"])
        for k, v in one["stages"].items():
            stages[k] += v
    from m1.marl.config import load_train_config

    marl_cfg = load_train_config("mini", list(b.overrides_marl))
    child_cpu = (children1.ru_utime + children1.ru_stime) - (children0.ru_utime + children0.ru_stime)
    meta = {"seeds": list(b.seeds), "budget": asdict(b), "n_train": len(train_qs), "n_heldout": len(held_qs),
            "n_examples": n_examples,
            "sft_stats": stats, "wall_seconds": time.perf_counter() - t_wall,
            "cpu_seconds": time.process_time() - t_cpu + child_cpu, "torch_threads": torch.get_num_threads(),
            "jobs": jobs, "stage_seconds": dict(stages),
            "sft_settings": _settings(sft_cfg, ("data", "learner", "epochs", "batch_size", "max_steps"),
                                      {k: v for k, v in (("epochs", b.sft_epochs), ("max_steps", b.sft_max_steps))
                                       if v is not None}),
            "marl_settings": _settings(marl_cfg, ("learner", "rollout", "grpo", "rewards", "steps"),
                                       {k: v for k, v in (("steps", b.marl_steps),) if v is not None})}
    meta["folder_calls"] = log_call(out, meta, rows, world_tag(b))
    table = render_table({r: v for r, v in results.items() if v}, meta)
    (out / f"results{world_tag(b)}.json").write_text(json.dumps({"results": results, "meta": meta, "curves": curves},
                                                                 indent=1))
    if doc is not None:
        write_doc(doc, table, meta, results, curves)
    return {"results": results, "meta": meta, "table": table, "curves": curves}


def log_call(out: Path, meta: dict[str, Any], rows: tuple[str, ...], tag: str) -> dict[str, float]:
    """Append this call's cost to <out>/calls.jsonl and return the folder's totals so far: a call that reuses
    every stage (`--export`, a dev evaluation) costs little, and the doc should still say what the run cost."""
    log_path = out / "calls.jsonl"
    with log_path.open("a") as f:
        f.write(json.dumps({"time": time.strftime("%Y-%m-%d %H:%M:%S"), "rows": list(rows), "world": tag or "held-out",
                            "wall_seconds": meta["wall_seconds"], "cpu_seconds": meta["cpu_seconds"],
                            "stage_seconds": meta["stage_seconds"]}) + "\n")
    calls = [json.loads(line) for line in log_path.read_text().splitlines() if line.strip()]
    return {"calls": len(calls), "wall_seconds": sum(c["wall_seconds"] for c in calls),
            "cpu_seconds": sum(c["cpu_seconds"] for c in calls)}


def _settings(cfg, keys: tuple[str, ...], extra: dict[str, Any]) -> str:
    d = cfg.model_dump(mode="json")
    keep = {k: d[k] for k in keys if k in d}
    if "learner" in keep:
        keep["learner"] = {k: keep["learner"][k] for k in ("finetune", "lr", "warmup_steps", "lr_schedule",
                                                           "micro_batch_size", "max_prompt_tokens",
                                                           "max_completion_tokens")}
    if "data" in keep:  # where the SFT examples come from
        keep["data"] = {k: v for k, v in sft_data_settings(cfg).items() if k != "teacher_overrides"}
    if "rollout" in keep and "questions_per_step" in extra:
        keep["rollout"]["questions_per_step"] = extra.pop("questions_per_step")
    keep.update(extra)
    return json.dumps(keep, separators=(", ", ": "))


def marl_world_arg(value: str) -> int | str:
    """`--marl-world`: a world seed, or `train` for the training world."""
    if value == "train":
        return value
    try:
        return int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a world seed (an integer) or `train`, got {value!r}") from None


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="the short CI version (1 seed, few questions and steps)")
    ap.add_argument("--out", type=Path, default=None, help="work folder (default runs/mini_team[_quick])")
    ap.add_argument("--doc", type=Path, default=None,
                    help="where to write the table (default docs/mini_team.md; --quick, --dev: in <out>)")
    ap.add_argument("--seeds", type=int, nargs="+", default=None)
    ap.add_argument("--dev", action="store_true",
                    help=f"evaluate on the dev world (seed {DEV_SEED}) instead of the held-out one, to choose settings; "
                         f"its evaluations and results carry the suffix _world{DEV_SEED}, so --out may be the main "
                         "run's folder (its trained weights are reused)")
    ap.add_argument("--train-videos", type=int, default=None,
                    help=f"videos in the training world (default {FULL.train_videos}, {FULL.questions_per_video} questions each)")
    ap.add_argument("--marl-world", type=marl_world_arg, default=None, metavar="SEED|train",
                    help=f"world seed of MARL's questions (default {FULL.marl_seed}), or `train` for the training "
                         "world's, whose questions SFT trained on")
    ap.add_argument("--rows", nargs="+", choices=ROWS, default=list(ROWS), help="which teams to train/evaluate")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (tiny models run best on 1)")
    ap.add_argument("--jobs", type=int, default=1,
                    help="worker processes: seeds trained at once, one process each, and shards of the teacher data")
    ap.add_argument("--sft-steps", type=int, default=None, help="SFT optimizer steps (default: the budget's)")
    ap.add_argument("--sft-set", action="append", default=[], metavar="KEY=VALUE",
                    help="override configs/sft/mini.yaml (repeatable)")
    ap.add_argument("--marl-set", action="append", default=[], metavar="KEY=VALUE",
                    help="override configs/marl/mini.yaml (repeatable)")
    ap.add_argument("--export", type=Path, default=None, metavar="DIR",
                    help="copy the first seed's SFT+MARL agents to DIR (the shipped copy is assets/mini_team)")
    ap.add_argument("--no-progress", action="store_true")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(message)s")
    log.setLevel(logging.INFO)
    import torch

    torch.set_num_threads(args.threads)
    b = QUICK if args.quick else FULL
    b = replace(b, overrides_sft=args.sft_set, overrides_marl=args.marl_set, progress=not args.no_progress)
    if args.seeds:
        b = replace(b, seeds=tuple(args.seeds))
    if args.dev:
        b = replace(b, eval_seed=DEV_SEED)
    if args.train_videos:
        b = replace(b, train_videos=args.train_videos)
    if args.sft_steps:
        b = replace(b, sft_max_steps=args.sft_steps)
    if args.marl_world is not None:
        b = replace(b, marl_seed=None if args.marl_world == "train" else args.marl_world)
    name = "mini_team" + ("_quick" if args.quick else "") + ("_dev" if args.dev else "")
    out = args.out or REPO / "runs" / name
    doc = args.doc or (out / f"mini_team{world_tag(b)}.md" if args.quick or args.dev
                       else REPO / "docs" / "mini_team.md")
    res = run(out, b, doc, rows=tuple(r for r in ROWS if r in args.rows), jobs=args.jobs)
    if args.export is not None:
        from m1.marl.config import load_train_config

        averaged = load_train_config("mini", list(b.overrides_marl)).average.checkpoints > 0
        export_weights(out, b.seeds[0], args.export, averaged)
    print(res["table"])
    print(verdict(res["results"]))
    m = res["meta"]
    print(f"wall {m['wall_seconds'] / 60:.1f} min, CPU {m['cpu_seconds'] / 60:.1f} min; table in {doc}")


if __name__ == "__main__":
    main()
