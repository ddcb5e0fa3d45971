"""Supervised fine-tuning of the team's agents on plans a teacher team wrote.

Data (`build_sft_data`): run a teacher team (the rule-based teacher of M1-Synth, or an API team such as GPT-4o
agents) over questions and keep a generation by the paper's rule: **at least one agent of the episode answered
right, and the writing agent's plan was never changed** (it never added a tool during communication). "Right" is a
positive result reward R_res (MCQ: the right letter; grounding: IoU above 0.5; numeric: MRA above 0.5; open: the
judge's or an exact-match verdict). By default only plan generations are kept (`phases: [plan]`), as in the paper.
The other phases (ours) need only the first condition: the plan condition is about plans, and an episode whose plan
was revised is exactly where the communicate step that revised it, and the answers written from the revised evidence,
are worth learning (on M1-Synth the teacher revises every "flash near the end" plan, so the strict rule would leave
the students almost no open-ended answers). `keep_revised_plans` (ours) also keeps the plan of an agent that revised
it when that agent itself answered right: the revision is then learnt from its communicate example, and questions the
teacher always revises (M1-Synth's late flashes: 0 of 640 plans kept by the strict rule) get plan examples at all.
The prompts are the teacher's chats, so any student can be trained on them with its own tokenizer.

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
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable

from m1.data.metrics import truth_letter
from m1.evidence import ChatEvidence
from m1.files import write_whole
from m1.marl.checkpoint import find_latest_checkpoint, load_checkpoint, resume_point, save_checkpoint
from m1.marl.config import GRPOSettings, SFTConfig, load_sft_config
from m1.marl.groups import build_learners, host_driver_models, reserve_placement
from m1.marl.launch import infer_command, run_training
from m1.marl.learner_io import seed_everything
from m1.marl.loop import run_steps
from m1.marl.rewards import RewardConfig, batch_agent_rewards, seed_rewards
from m1.marl.rollout import training_team_config
from m1.marl.stream import QuestionStream, load_questions
from m1.marl.team_kinds import seed_phases
from m1.marl.trackers import require_trackers
from m1.schema import LETTERS, Episode, Question, Turn
from m1.models.hub import ModelHub
from m1.plots import plot_finished_run
from m1.team.kinds import make_team
from m1.team.single import SingleAgentTeam

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


@dataclass
class SFTExample:
    """One kept generation: the chat the teacher agent saw and what it wrote."""

    agent: str
    question_id: str
    phase: str
    messages: list[dict[str, Any]]
    completion: str
    video: str | None = None  # the video of the messages' image parts (seed kinds): a VLM student decodes them again
    # where the completion reads the messages, as the teacher recorded it (m1/evidence.py ChatEvidence); None: not
    # recorded (older files, served teachers). Read by `learner.attention` (the evidence attention loss)
    evidence: list[ChatEvidence] | None = None

    def __post_init__(self):  # read back from JSON, each entry is a dict
        if self.evidence is not None:
            self.evidence = [e if isinstance(e, ChatEvidence) else ChatEvidence(**e) for e in self.evidence]

    @classmethod
    def from_json(cls, line: str, where: str = "") -> SFTExample:
        try:
            return cls(**json.loads(line))
        except (TypeError, ValueError) as exc:
            raise ValueError(f"{where}: not an SFT example ({exc})") from exc


# ------------------------------------------------------------------------------------------------ the keep rule
def plan_unchanged(episode: Episode, agent: str) -> bool:
    """True when the agent never added a tool to its plan during communication."""
    rec = episode.memory.get(agent)
    if rec is None:
        return False
    return not any(t.decision is not None and t.decision.action == "add_tool" for t in rec.turns)


def right_agents(episodes: Sequence[Episode], rewards: RewardConfig, judge=None) -> list[list[str]]:
    """Per episode, the agents whose own answer earns a positive result reward."""
    cfg = rewards.model_copy(update={"w_col": 0.0})  # only R_res matters here: no collaboration verdicts needed
    ok = [e for e in episodes if e.error is None]
    scored = iter(batch_agent_rewards(ok, cfg, judge))
    out = []
    for e in episodes:
        per = next(scored) if e.error is None else {}
        out.append([a for a, b in per.items() if b.res > 0])
    return out


def select_examples(episodes: Sequence[Episode], rewards: RewardConfig, judge=None,
                    phases: Sequence[str] = ("plan",), keep_revised_plans: bool = False,
                    plan_filter: str = "keep_rule") -> tuple[list[SFTExample], dict[str, int]]:
    """Apply the keep rule to episodes (plan examples also need an unchanged plan, or with `keep_revised_plans` an
    agent that answered right after revising it; with `plan_filter="all"` every plan is kept); returns the examples
    and counts of why others were dropped."""
    stats = {"episodes": len(episodes), "episodes_failed": 0, "episodes_nobody_right": 0, "kept": 0,
             "dropped_plan_changed": 0}
    if keep_revised_plans:
        stats["kept_revised_plans"] = 0
    examples: list[SFTExample] = []
    for ep, right in zip(episodes, right_agents(episodes, rewards, judge)):
        if ep.error is not None:
            stats["episodes_failed"] += 1
            continue
        if not right:
            stats["episodes_nobody_right"] += 1
        for gen in ep.generations:
            if gen.phase not in phases:
                continue
            if gen.phase == "plan" and plan_filter == "all":
                pass
            elif not right:
                continue
            elif gen.phase == "plan" and not plan_unchanged(ep, gen.agent):
                if not (keep_revised_plans and gen.agent in right):
                    stats["dropped_plan_changed"] += 1
                    continue
                stats["kept_revised_plans"] += 1
            examples.append(SFTExample(agent=gen.agent, question_id=ep.question.id, phase=gen.phase,
                                       messages=gen.prompt, completion=gen.completion, video=ep.question.video,
                                       evidence=gen.evidence))
            stats["kept"] += 1
    return examples, stats


def corrected_calls(episode: Episode, agent: str) -> int:
    """Tool calls that correct an earlier one (VideoZoomer's reflection pattern): any call after a call that returned
    an error, or the same tool again over a span that strictly contains an earlier call's span (a zoom that missed,
    then a wider one). Calls over other spans (both ends of an event, say) are a plan, not a correction."""
    rec = episode.memory.get(agent)
    turns = rec.turns if rec is not None else []

    def widens(t: Turn, e: Turn) -> bool:
        return (t.tool == e.tool and t.span is not None and e.span is not None and tuple(t.span) != tuple(e.span)
                and t.span[0] <= e.span[0] and e.span[1] <= t.span[1])

    return sum(any(e.error for e in turns[:i]) or any(widens(t, e) for e in turns[:i]) for i, t in enumerate(turns))


def select_seed_examples(episodes: Sequence[Episode], kind: str,
                         phases: Sequence[str] | None = None) -> tuple[list[SFTExample], dict[str, int]]:
    """Seed-kind trajectories (weaver / zoomer / sage): every turn of a right episode is an example (its chat so far,
    tool observations included, as the prompt; its reply as the target), `phases` (act, answer) when given. Right
    is the seed reward's `correct` (m1.data.metrics.is_correct on the final answer). A right episode that corrected
    a tool call on the way (`corrected_calls`) is kept like any other: these are VideoZoomer's reflection
    trajectories, counted in `kept_reflection_episodes`."""
    stats = {"episodes": len(episodes), "episodes_failed": 0, "episodes_wrong": 0, "kept": 0,
             "kept_episodes": 0, "kept_reflection_episodes": 0}
    examples: list[SFTExample] = []
    for ep, per in zip(episodes, seed_rewards(episodes, kind)):
        if ep.error is not None:
            stats["episodes_failed"] += 1
            continue
        reward = next(iter(per.values()))
        if reward.correct != 1.0:
            stats["episodes_wrong"] += 1
            continue
        stats["kept_episodes"] += 1
        stats["kept_reflection_episodes"] += corrected_calls(ep, reward.agent) > 0
        for gen in ep.generations:
            if phases is not None and gen.phase not in phases:
                continue
            examples.append(SFTExample(agent=gen.agent, question_id=ep.question.id, phase=gen.phase,
                                       messages=gen.prompt, completion=gen.completion, video=ep.question.video,
                                       evidence=gen.evidence))
            stats["kept"] += 1
    return examples, stats


def build_sft_data(team, questions: Sequence[Question], rewards: RewardConfig, judge=None,
                   phases: Sequence[str] = ("plan",), rollouts: int = 1,
                   rotate: bool = False, keep_revised_plans: bool = False, progress: bool = False,
                   plan_filter: str = "keep_rule") -> tuple[list[SFTExample], dict[str, int]]:
    """Run the teacher `team` `rollouts` times over every question and keep plans by the paper's rule (see
    `select_examples`); with `rotate`, rollout r of an MCQ question sees its options rotated by r places.
    A seed-kind teacher (m1/team/single.py) keeps every turn of its right episodes instead (`select_seed_examples`;
    `phases` at its default ["plan"] means all turns)."""
    kind = team.kind if isinstance(team, SingleAgentTeam) else None
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
    if kind is not None:

        return select_seed_examples(episodes, kind, seed_phases(phases, "data.phases", kind, ["plan"]))
    return select_examples(episodes, rewards, judge, phases, keep_revised_plans, plan_filter)


def thin_communicate(examples: list[SFTExample], per_episode: int) -> list[SFTExample]:
    """The first `per_episode` communicate examples of each (question, agent), every other example kept."""
    seen: dict[tuple[str, str], int] = {}
    out = []
    for e in examples:
        if e.phase == "communicate":
            key = (e.question_id, e.agent)
            seen[key] = seen.get(key, 0) + 1
            if seen[key] > per_episode:
                continue
        out.append(e)
    return out


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
    return out


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


def prepare_examples(cfg: SFTConfig, teacher_hub=None, progress: Callable[[str], None] | None = None
                     ) -> tuple[list[SFTExample], dict[str, Any]]:
    """The SFT examples of `cfg`: read from `data.examples` when it exists (and, when its stats file records other
    data settings, built again), otherwise built by the teacher over `data.questions` and written with a
    `<examples>.stats.json` (keep-rule counts, examples per phase, the settings)."""
    say = progress or (lambda msg: log.info("%s", msg))
    d = cfg.data
    path = examples_path(cfg)
    settings = data_settings(cfg)
    if path.is_file():
        recorded = stats_path(path)
        if not recorded.is_file():  # a file made elsewhere: taken as it is
            return read_examples(path), {}
        stats = json.loads(recorded.read_text())
        if stats.get("data") == settings:
            return read_examples(path), stats
        old = stats.get("data") or {}
        changed = sorted(k for k in set(old) | set(settings) if old.get(k) != settings.get(k))
        say(f"{path}: built with other data settings ({', '.join(changed)}): building it again")
    teacher = cfg.teacher_config()
    if teacher is None or not d.questions:
        raise ValueError(f"data.examples {path} does not exist and no teacher + questions are given to build it")
    questions = load_questions(d.questions, d.video_dir)
    shards = video_shards(questions, d.workers)
    say(f"SFT data: teacher {teacher.name} over {len(questions)} questions x {d.rollouts_per_question} rollouts"
        + (f" in {len(shards)} worker processes" if len(shards) > 1 else ""))
    if len(shards) > 1:
        if teacher_hub is not None:
            raise ValueError("data.workers > 1: the teacher's models are hosted by the run (placement: ray); "
                             "set data.workers=1")
        import multiprocessing as mp
        from concurrent.futures import ProcessPoolExecutor

        with ProcessPoolExecutor(max_workers=len(shards), mp_context=mp.get_context("spawn")) as ex:
            parts = list(ex.map(_teacher_shard, [cfg] * len(shards), shards))
        examples = [e for part, _ in parts for e in part]
        stats = {}
        for _, part_stats in parts:
            for k, v in part_stats.items():
                stats[k] = stats.get(k, 0) + v
    else:
        examples, stats = build_sft_data(make_team(teacher, hub=teacher_hub), questions, cfg.rewards, None, d.phases,
                                         d.rollouts_per_question, d.rotate_options, d.keep_revised_plans,
                                         progress=cfg.log.progress, plan_filter=d.plan_filter)
    if d.communicate_per_episode is not None:
        thinned = thin_communicate(examples, d.communicate_per_episode)
        stats["thinned_communicate"] = len(examples) - len(thinned)
        examples = thinned
    stats["by_phase"] = {ph: sum(e.phase == ph for e in examples) for ph in sorted({e.phase for e in examples})}
    stats["data"] = settings
    write_examples(path, examples)
    write_whole(stats_path(path), json.dumps(stats, indent=1).encode())  # after the examples: a stats file vouches for them
    say(f"SFT data: {len(examples)} examples -> {path} ({ {k: v for k, v in stats.items() if k != 'data'} })")
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
        self.examples = examples if examples is not None else self._load_or_build(teacher_hub)
        if not self.examples:
            raise ValueError("SFT: no examples were kept; nothing to train on")
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
                    teacher_hub.register(key, model, kind=model.kind)
        return prepare_examples(self.cfg, teacher_hub)[0]

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
