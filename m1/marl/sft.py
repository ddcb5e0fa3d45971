"""Supervised fine-tuning of the team's agents on plans a teacher team wrote.

Data (`build_sft_data`): run a teacher team (the rule-based teacher of M1-Synth, or an API team such as GPT-4o
agents) over questions and keep the generations its team kind's rule keeps (m1/marl/sft_examples.py: the paper's keep
rule for CPP teams, right trajectories for a seed kind). The prompts are the teacher's chats, so any student can be
trained on them with its own tokenizer.

Training (`SFTTrainer`): each student agent's learner (LoRA or full, the same `AgentLearner` as MARL) minimises
cross-entropy on the completion tokens only — prompt tokens, tool outputs and memory text are context — averaged over
the tokens of an optimizer step. The completion target ends with the tokenizer's end-of-turn token, exactly what the
agent must generate to stop.
"""
from __future__ import annotations

import json
import logging
import math
import time
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any, Callable

from m1.agents.parsers import parse_decision
from m1.contracts import Team
from m1.data.metrics import truth_letter
from m1.files import write_whole
from m1.marl.checkpoint import find_latest_checkpoint, load_checkpoint, resume_point, save_checkpoint
from m1.marl.config import GRPOSettings, SFTConfig, load_sft_config
from m1.marl.actor.groups import build_learners, host_driver_models, reserve_placement
from m1.marl.launch import infer_command, run_training
from m1.marl.actor.learner_io import seed_everything
from m1.marl.loop import run_steps
from m1.marl.reward.rewards import RewardConfig
from m1.marl.rollout.episodes import training_team_config
from m1.marl.sft_examples import SFTExample
from m1.marl.rollout.stream import QuestionStream, load_questions
from m1.marl.team_training import team_kind
from m1.marl.trackers import require_trackers
from m1.schema import LETTERS, Question
from m1.models.hub import ModelHub
from m1.plots import plot_finished_run
from m1.team.engines_registry import make_team

log = logging.getLogger(__name__)


def rotate_options(question: Question, shift: int) -> Question:
    """The MCQ `question` with its options moved `shift` places down the letters (the last ones wrap to the top)
    and its ground-truth letter moved with them; other questions unchanged."""
    n = len(question.options)
    if question.task != "mcq" or n < 2 or shift % n == 0:
        return question
    truth = question.answer
    if truth is not None:
        truth = LETTERS[(LETTERS.index(truth_letter(question)) + shift) % n]
    options = [question.options[(i - shift) % n] for i in range(n)]
    return question.model_copy(update={"options": options, "answer": truth})


def build_sft_data(team: Team, questions: Sequence[Question], rewards: RewardConfig, judge=None,
                   phases: Sequence[str] = ("plan",), rollouts: int = 1,
                   rotate: bool = False, keep_revised_plans: bool = False, progress: bool = False,
                   plan_filter: str = "keep_rule") -> tuple[list[SFTExample], dict[str, int]]:
    """Run the teacher `team` `rollouts` times over every question and keep what its team kind's rule keeps
    (`TeamKind.sft_examples`: a CPP team's plans by the paper's rule, a seed kind's every turn of its right episodes,
    `phases` at its default ["plan"] meaning all turns); with `rotate`, rollout r of an MCQ question sees its options
    rotated by r places."""
    kind = team_kind(team.cfg)
    repeated = [rotate_options(q, r) if rotate else q for q in questions for r in range(rollouts)]
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=len(repeated), desc="teacher episodes", unit="ep", dynamic_ncols=True)
    try:
        episodes = team.run(repeated, on_episode=(lambda _: bar.update(1)) if bar is not None else None)
    finally:
        if bar is not None:
            bar.close()
    return kind.sft_examples(episodes, rewards, judge, phases, keep_revised_plans, plan_filter)


def is_revision(example: SFTExample) -> bool:
    """A communicate example whose reply adds a tool to the plan (read as the students' decisions are read)."""
    return example.phase == "communicate" and parse_decision(example.completion).decision.action == "add_tool"


def thin_communicate(examples: list[SFTExample], per_episode: int, keep_revisions: bool = False,
                     spread: bool = False) -> list[SFTExample]:
    """At most `per_episode` communicate examples of each (question, agent), every other example kept: the first
    ones, or with `spread` that many drawn from all its rounds (seeded by question and agent: the same on every
    build), so later rounds, where a teacher revises most, are not thinned away. With
    `keep_revisions`, every revision stays and the budget counts the other communicate examples only."""
    import random

    budgeted: dict[tuple[str, str], list[int]] = {}
    for i, e in enumerate(examples):
        if e.phase == "communicate" and not (keep_revisions and is_revision(e)):
            budgeted.setdefault((e.question_id, e.agent), []).append(i)
    dropped: set[int] = set()
    for (qid, agent), at in budgeted.items():
        chosen = (set(random.Random(f"{qid}/{agent}").sample(at, min(per_episode, len(at)))) if spread
                  else set(at[:per_episode]))
        dropped.update(i for i in at if i not in chosen)
    return [e for i, e in enumerate(examples) if i not in dropped]


def data_settings(cfg: SFTConfig) -> dict[str, Any]:
    """What decides which examples the teacher data holds (recorded with them; other settings mean a rebuild)."""
    d = cfg.data
    teacher = d.teacher if isinstance(d.teacher, str) or d.teacher is None else d.teacher.model_dump(mode="json")
    out: dict[str, Any] = {"phases": list(d.phases), "assign": d.assign, "rollouts_per_question": d.rollouts_per_question,
                           "rotate_options": d.rotate_options, "keep_revised_plans": d.keep_revised_plans,
                           "teacher_overrides": list(d.teacher_overrides),
                           "communicate_per_episode": d.communicate_per_episode,
                           "teacher": teacher, "questions": d.questions}
    if d.plan_filter != "keep_rule":  # recorded only when set, so files built before the option stay valid
        out["plan_filter"] = d.plan_filter
    if d.communicate_revisions != "thin":  # the same
        out["communicate_revisions"] = d.communicate_revisions
    if d.communicate_pick != "first":  # the same
        out["communicate_pick"] = d.communicate_pick
    teacher_cfg = cfg.teacher_config()
    if teacher_cfg is not None and any(m.backend == "synth" for m in teacher_cfg.models.values()):
        out["teacher_code"] = synth_teacher_code()
    return out


SYNTH_TEACHER_CODE = ("synth", "kinds", "evidence.py")  # under m1/: what writes a synth teacher's replies


def synth_teacher_code() -> str:
    """A hash of the code that is an M1-Synth teacher (its rule policies, readers and evidence): edit it and the same
    settings write other examples, so a file built before the edit is built again rather than trained on."""
    import hashlib

    root = Path(__file__).resolve().parent.parent
    h = hashlib.sha256()
    for part in SYNTH_TEACHER_CODE:
        for f in sorted((root / part).rglob("*.py")) if (root / part).is_dir() else [root / part]:
            h.update(f.relative_to(root).as_posix().encode() + b"\0" + f.read_bytes() + b"\0")
    return h.hexdigest()[:16]


def video_shards(questions: Sequence[Question], n: int) -> list[list[Question]]:
    """`questions` cut into at most `n` contiguous runs of whole videos (each worker then decodes its own videos)."""
    by_video: dict[str, list[Question]] = {}
    for q in questions:
        by_video.setdefault(q.video, []).append(q)
    videos = list(by_video.values())
    size = math.ceil(len(videos) / max(n, 1)) if videos else 1
    return [[q for v in videos[i:i + size] for q in v] for i in range(0, len(videos), size)]


def _teacher_shard(cfg: SFTConfig, questions: list[Question]) -> tuple[list[SFTExample], dict[str, int]]:
    """One worker process of `prepare_examples`: the teacher over some whole videos, on one torch thread."""
    import torch

    torch.set_num_threads(1)
    d, teacher = cfg.data, cfg.teacher_config()
    if teacher is None:  # prepare_examples checked it before starting the workers
        raise ValueError("data.teacher: no teacher team to run")
    return build_sft_data(make_team(teacher), questions, cfg.rewards, None, d.phases,
                          d.rollouts_per_question, d.rotate_options, d.keep_revised_plans, plan_filter=d.plan_filter)


def examples_path(cfg: SFTConfig) -> Path:
    return Path(cfg.data.examples) if cfg.data.examples else Path(cfg.out_dir) / "sft_examples.jsonl"


def stats_path(path: Path) -> Path:
    return path.with_name(path.name + ".stats.json")


MISSING_SHOWN = 5  # questions and videos named in a message about missing videos (a count says how many in all)


def missing_videos(questions: Sequence[Question]) -> dict[str, list[str]]:
    """Video path -> ids of the questions about it, for the videos that are not on disk."""
    out: dict[str, list[str]] = {}
    for q in questions:
        if not Path(q.video).exists():
            out.setdefault(q.video, []).append(q.id)
    return out


def name_missing(missing: dict[str, list[str]]) -> str:
    """The first few question ids and videos of `missing_videos`: 'q1, q2, ... (40 in all) (2 videos: a, b)'."""
    def first(items: list[str]) -> str:
        return ", ".join(items[:MISSING_SHOWN]) + (f", ... ({len(items)} in all)" if len(items) > MISSING_SHOWN else "")

    videos = list(missing)
    return (f"{first([i for ids in missing.values() for i in ids])} ({len(videos)} video"
            f"{'s' if len(videos) != 1 else ''}: {first(videos)})")


def count_missing(missing: dict[str, list[str]]) -> str:
    """'1 question' / 'N questions': how many `missing_videos` holds."""
    n = sum(len(ids) for ids in missing.values())
    return f"{n} question{'s' if n != 1 else ''}"


def _recorded_examples(path: Path, settings: dict, say, warn) -> tuple[list[SFTExample], dict[str, Any]] | None:
    """The examples file at `path` with its stats when it can be used as it is; None when it must be built (absent,
    built with other data settings, or built while videos were missing that are back)."""
    if not path.is_file():
        return None
    recorded = stats_path(path)
    if not recorded.is_file():  # a file made elsewhere: taken as it is
        return read_examples(path), {}
    stats = json.loads(recorded.read_text())
    absent = stats.get("videos_missing") or {}
    back = [v for v in absent if Path(v).exists()]
    if stats.get("data") == settings and not back:
        if absent:
            warn(f"SFT data: {path} was built without {count_missing(absent)} whose video is missing: "
                 f"{name_missing(absent)}")
        return read_examples(path), stats
    if stats.get("data") == settings:
        say(f"{path}: built while {len(back)} of its videos were missing, which are back: building it again")
    else:
        old = stats.get("data") or {}
        changed = sorted(k for k in set(old) | set(settings) if old.get(k) != settings.get(k))
        say(f"{path}: built with other data settings ({', '.join(changed)}): building it again")
    return None


def _teacher_episodes(cfg: SFTConfig, teacher, questions: list[Question], teacher_hub, say
                      ) -> tuple[list[SFTExample], dict[str, Any]]:
    """The teacher's kept examples over `questions`, in `data.workers` processes over whole videos."""
    d = cfg.data
    shards = video_shards(questions, d.workers)
    say(f"SFT data: teacher {teacher.name} over {len(questions)} questions x {d.rollouts_per_question} rollouts"
        + (f" in {len(shards)} worker processes" if len(shards) > 1 else ""))
    if len(shards) == 1:
        return build_sft_data(make_team(teacher, hub=teacher_hub), questions, cfg.rewards, None, d.phases,
                              d.rollouts_per_question, d.rotate_options, d.keep_revised_plans,
                              progress=cfg.log.progress, plan_filter=d.plan_filter)
    if teacher_hub is not None:
        raise ValueError("data.workers > 1: the teacher's models are hosted by the run (placement: ray); "
                         "set data.workers=1")
    import multiprocessing as mp
    from concurrent.futures import ProcessPoolExecutor

    with ProcessPoolExecutor(max_workers=len(shards), mp_context=mp.get_context("spawn")) as ex:
        parts = list(ex.map(_teacher_shard, [cfg] * len(shards), shards))
    stats: dict[str, Any] = {}
    for _, part_stats in parts:
        for k, v in part_stats.items():
            stats[k] = stats.get(k, 0) + v
    return [e for part, _ in parts for e in part], stats


def prepare_examples(cfg: SFTConfig, teacher_hub=None, progress: Callable[[str], None] | None = None
                     ) -> tuple[list[SFTExample], dict[str, Any]]:
    """The SFT examples of `cfg`: read from `data.examples` when it exists (and, when its stats file records other
    data settings, built again), otherwise built by the teacher over `data.questions` and written with a
    `<examples>.stats.json` (keep-rule counts, examples per phase, the settings).

    Questions whose video is missing are left out and named (the teacher would only fail on them); the stats file
    records them, so that a file built without them is built again once they are back."""
    say = progress or (lambda msg: log.info("%s", msg))
    warn = progress or (lambda msg: log.warning("%s", msg))
    d = cfg.data
    path = examples_path(cfg)
    settings = data_settings(cfg)
    recorded = _recorded_examples(path, settings, say, warn)
    if recorded is not None:
        return recorded
    teacher = cfg.teacher_config()
    if teacher is None or not d.questions:
        raise ValueError(f"data.examples {path} does not exist and no teacher + questions are given to build it")
    questions = load_questions(d.questions, d.video_dir)
    absent = missing_videos(questions)
    if absent:
        kept = [q for q in questions if q.video not in absent]
        if not kept:
            raise ValueError(f"SFT: no examples were kept: the videos of all {len(questions)} questions are missing: "
                             f"{name_missing(absent)}; check data.questions ({d.questions}) and data.video_dir "
                             f"({d.video_dir})")
        warn(f"SFT data: {len(questions) - len(kept)} of {len(questions)} questions left out, their videos are "
             f"missing: {name_missing(absent)}")
        questions = kept
    examples, stats = _teacher_episodes(cfg, teacher, questions, teacher_hub, say)
    revisions = sum(is_revision(e) for e in examples)
    if d.communicate_per_episode is not None:
        thinned = thin_communicate(examples, d.communicate_per_episode, d.communicate_revisions == "keep",
                                   d.communicate_pick == "spread")
        stats["thinned_communicate"] = len(examples) - len(thinned)
        examples = thinned
    communicate = [e for e in examples if e.phase == "communicate"]
    stats["communicate_revisions"] = {"after_keep_rule": revisions, "kept": sum(is_revision(e) for e in communicate),
                                      "communicate_kept": len(communicate)}
    stats["by_phase"] = {ph: sum(e.phase == ph for e in examples) for ph in sorted({e.phase for e in examples})}
    if absent:
        stats["videos_missing"] = absent
    stats["data"] = settings
    write_examples(path, examples)
    write_whole(stats_path(path), json.dumps(stats, indent=1).encode())  # after the examples: a stats file vouches for them
    shown = {k: v for k, v in stats.items() if k not in ("data", "videos_missing")}
    say(f"SFT data: {len(examples)} examples -> {path} ({shown})")
    return examples, stats


def write_examples(path: str | Path, examples: Sequence[SFTExample]) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    # `video` and `evidence` only where set: examples without them are written as before
    rows = [{k: v for k, v in asdict(e).items() if not (k in ("video", "evidence") and v is None)} for e in examples]
    write_whole(path, "".join(json.dumps(r) + "\n" for r in rows).encode())
    return path


def read_examples(path: str | Path) -> list[SFTExample]:
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"SFT examples file not found: {path}")
    return [SFTExample.from_json(line, f"{path}:{i}")
            for i, line in enumerate(path.read_text().splitlines(), 1) if line.strip()]


def why_none_kept(stats: dict[str, Any]) -> str:
    """What the teacher data's stats say about an empty file: the questions left out for their videos, the keep
    rule's counts; '' when nothing is recorded."""
    parts = []
    absent = stats.get("videos_missing") or {}
    if absent:
        parts.append(f"left out {count_missing(absent)} whose video is missing: {name_missing(absent)}")
    counts = {k: v for k, v in stats.items() if isinstance(v, int)}
    if counts:
        parts.append("the teacher's episodes: " + ", ".join(f"{k} {v}" for k, v in counts.items()))
    return f" ({'; '.join(parts)})" if parts else ""


# ------------------------------------------------------------------------------------------------ training
class SFTTrainer:
    """Cross-entropy on kept teacher completions, one learner per student agent; checkpoints like MARL."""

    def __init__(self, cfg: SFTConfig, examples: list[SFTExample] | None = None, teacher_hub=None):
        self.cfg = cfg
        self.out = Path(cfg.out_dir)
        require_trackers(cfg.log.backends)  # a tracker that is not installed is named before any model loads
        # the checkpoint to resume from, checked against its manifest before any model loads
        resume = resume_point(self.out, cfg.checkpoint.resume_from) if cfg.checkpoint.resume else None
        seed_everything(cfg.seed)
        # on GPUs (placement ray): the plan's GPUs are reserved before anything loads, the teacher's tool models
        # included while the examples are still to be built
        self.placement = reserve_placement(cfg) if cfg.placement == "ray" else None
        self.data_stats: dict[str, Any] = {}  # the teacher data's stats when this run read or built them
        self.examples = examples if examples is not None else self._load_or_build(teacher_hub)
        if not self.examples:
            raise ValueError("SFT: no examples were kept; nothing to train on" + why_none_kept(self.data_stats))
        if cfg.learner.attention.on and not any(e.evidence for e in self.examples):
            log.warning("learner.attention is on but none of the %d examples records evidence (a file built before "
                        "the teacher recorded it, or a served teacher's): only the structural heads are trained; "
                        "delete %s to build it again", len(self.examples), examples_path(cfg))
        team = training_team_config(cfg.team_config(), 1.0)  # split shared model keys: one learner per agent
        key_of = {a.name: a.model for a in team.agents}
        self.trained = list(cfg.train_agents or key_of)
        specs = {a: (key_of[a], team.models[key_of[a]]) for a in self.trained}
        self.learners = build_learners(specs, cfg.learner, GRPOSettings(beta=0.0), cfg.seed, cfg.placement, cfg.ray,
                                       cfg.out_dir, {a: cfg.cluster.gpus_of(a, cfg.learner) for a in self.trained},
                                       self.placement)
        self.stream = QuestionStream(self.examples, cfg.seed, shuffle=True)
        per_epoch = math.ceil(len(self.examples) / cfg.batch_size)
        self.total_steps = cfg.max_steps or per_epoch * cfg.epochs
        self.step = 0
        self.checkpointed = 0  # the step of the newest checkpoint on disk
        self.history: list[dict[str, Any]] = []
        self.tracker_ids: dict[str, str] = {}  # the tracker runs this run logs to (kept in its checkpoints)
        self.trackers = None  # open while train() runs
        if resume is not None:
            try:
                state = load_checkpoint(resume, self.learners, self.trained, cfg.seed, verified=True)
            except BaseException:
                self.close()
                raise
            self.step = self.checkpointed = int(state["step"])
            self.stream.cursor = int(state["cursor"])
            self.tracker_ids = dict(state.get("trackers") or {})

    def _load_or_build(self, teacher_hub) -> list[SFTExample]:
        if teacher_hub is None and self.placement is not None and not examples_path(self.cfg).is_file():
            teacher = self.cfg.teacher_config()  # the teacher's tool models on their planned GPUs
            if teacher is not None:
                teacher_hub = ModelHub(teacher.models)
                for key, model in host_driver_models(self.placement, teacher.models).items():
                    teacher_hub.register(key, model, interface=model.interface)
        examples, self.data_stats = prepare_examples(self.cfg, teacher_hub)
        return examples

    def _assigned(self, batch: list[SFTExample], agent: str) -> list[SFTExample]:
        if self.cfg.data.assign == "all":
            return batch
        return [e for e in batch if e.agent == agent]

    def train(self, stop_after: int | None = None, stop=None) -> list[dict[str, Any]]:
        """Train to the last step (or `stop_after` more). `stop` (a StopFlag set by a signal): end after the current
        step with a checkpoint of it (m1/marl/loop.py)."""
        return run_steps(self, self.total_steps, self.train_step, "SFT step", stop_after, stop)

    def train_step(self) -> dict[str, Any]:
        """One optimizer step per student on the next `batch_size` examples; the step's metrics row."""
        cfg, t0 = self.cfg, time.perf_counter()
        batch = self.stream.take(cfg.batch_size)
        samples = {a: self.learners.sft_samples(a, self._assigned(batch, a)) for a in self.trained}
        lr = cfg.learner.lr_at(self.step, self.total_steps)
        stats = self.learners.update(samples, lr, "sft")
        self.step += 1
        row: dict[str, Any] = {"step": self.step, "epoch": self.stream.epoch, "lr": lr}
        for agent, st in stats.items():
            row.update({f"{agent}/{k}": v for k, v in st.items()})
        losses = [st["loss"] for st in stats.values() if "loss" in st]
        row["loss"] = sum(losses) / len(losses) if losses else float("nan")
        row["time/step"] = time.perf_counter() - t0
        return row

    def save_checkpoint(self, interim: bool = False) -> Path:
        cfg = self.cfg
        folder = save_checkpoint(self.out, self.step, self.learners,
                                 {"step": self.step, "cursor": self.stream.cursor, "seed": cfg.seed,
                                  "agents": self.trained, "name": cfg.name, "config": cfg.model_dump(mode="json"),
                                  "trackers": self.tracker_ids},
                                 cfg.checkpoint.keep_last, interim)
        self.checkpointed = self.step
        return folder

    def close(self) -> None:
        self.learners.shutdown()
        if self.placement is not None:
            self.placement.release()


def sft_main(config_path: str | Path, overrides: list[str] | None = None,
             progress: Callable[[str], None] = print) -> list[dict[str, Any]]:
    """`m1 sft --config PATH --set key=value ...`: build (or read) the kept plans, then fine-tune every agent.

    SIGTERM / SIGINT: the current step finishes and is checkpointed, then TrainingStopped (exit status 143 / 130 from
    the command) says so; a second signal stops at once (StoppedAtOnce). Rerunning the command resumes.
    """
    cfg = load_sft_config(config_path, overrides)
    trainer, rows = run_training(
        cfg, SFTTrainer, lambda tr: tr.total_steps,
        lambda tr: progress(f"{cfg.name}: {len(tr.examples)} examples, {tr.total_steps} steps (starting at {tr.step})"),
        progress)
    if rows:
        progress(f"{cfg.name}: last loss {rows[-1]['loss']:.4f}; checkpoints in {Path(cfg.out_dir) / 'checkpoints'}")
    plot_finished_run(cfg.out_dir, progress)

    root = find_latest_checkpoint(Path(cfg.out_dir))
    if root is not None:
        progress("answer with the trained agents: " + infer_command(cfg, trainer.trained, root))
    return rows
