"""Multi-agent GRPO trainer: one learner per agent, trained jointly on the team's own rollouts.

One training step, top to bottom (`Trainer.train_step`):

1. take the next `questions_per_step` questions (a seeded permutation per epoch; the cursor is checkpointed) and
   the step's communication DAG (random edges, agent dropout; a team of one runs on the complete graph);
2. run every question K times over that DAG through the `Team` engine: the agents generate with their learners'
   current weights, because each learner is registered in the model hub under its agent's key;
3. credit: score every agent in every episode with the team kind's reward and turn the rewards into advantages
   and samples as the run's credit strategy says (m1/marl/algo/credit.py: credit rule, baseline, dynamic sampling);
4. update each agent's learner: recompute the log-probs of its completions, add the clipped GRPO surrogate and
   beta * k3 KL to the reference (m1/marl/algo/reductions.py), accumulate gradients over micro-batches, clip,
   AdamW step;
5. log metrics (JSONL, the trackers of `log.backends`, progress bar), every `log.samples_every` steps the step's
   episodes with their rewards and advantages (m1/marl/samples.py), and checkpoint every `checkpoint.every` steps.

What differs between the CPP team and a seed kind (Weaver, VideoZoomer, SAGE: one policy in a tool loop) is
behind one interface, m1/marl/team_training.py; every setting derived from others is decided once by
m1/marl/resolve.py before anything loads (`prepare_run`, which also verifies the resume point and reserves the
GPUs). The learners (a sampler and an actor per agent; local or Ray actors) live in m1/marl/actor/learner.py and
m1/marl/actor/groups.py, checkpoints in m1/marl/checkpoint.py, the question stream and metrics log in
m1/marl/rollout/stream.py, the command in m1/marl/launch.py.

Exact resume: a checkpoint holds each agent's weights (or adapter) and optimizer state, the Python/NumPy/torch RNG
states, the step and the data cursor. Rollout randomness (DAG, sampling seeds) is derived from (seed, step), so a
resumed run repeats an uninterrupted one exactly on CPU. The checkpoint is checked against its manifest before the
models load (a damaged one stops the run with an error naming the file, see m1/marl/checkpoint.py), and a stop flag
(SIGTERM/SIGINT, set by `stop_on_signals`) ends the loop after the current step with a checkpoint of it.
"""
from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from m1.marl.checkpoint import STATE, StopFlag, load_checkpoint, naming_full_disk, resume_point, save_checkpoint
from m1.marl.config import TrainConfig
from m1.marl.algo.credit import CreditStrategy, StepCredit, StepEpisodes
from m1.marl.actor.groups import RayPlacement, reserve_placement
from m1.contracts import LearnerGroup, RolloutEngine, Team
from m1.marl.actor.learner_io import seed_everything
from m1.marl.loop import run_steps
from m1.marl.producer import Producer, StepItem, sampling_version
from m1.marl.resolve import ResolvedRun, resolve
from m1.marl.rollout.episodes import RewardFn, RolloutError, derive_seed, run_rollouts, score
from m1.marl.samples import TABLE_COLUMNS, due, table_rows, write_step_samples
from m1.marl.rollout.stream import QuestionStream
from m1.marl.trackers import require_trackers
from m1.models.hub import ModelHub
from m1.team.engines_registry import make_team
from m1.video import VideoPool

log = logging.getLogger(__name__)


class StepClock:
    """Seconds of each part of a step, lap by lap."""

    def __init__(self):
        self.start = self.last = time.perf_counter()
        self.seconds: dict[str, float] = {}

    def lap(self, name: str) -> float:
        now = time.perf_counter()
        self.seconds[name], self.last = now - self.last, now
        return self.seconds[name]


# ================================================================================================ the trainer
@dataclass(frozen=True)
class PreparedRun:
    """A MARL run made ready before any model loads (`prepare_run`): its settings resolved, its GPUs reserved
    (placement ray; the trainer built from it releases them) and the checkpoint it resumes from, verified."""

    settings: ResolvedRun
    placement: RayPlacement | None
    resume: Path | None


def prepare_run(cfg: TrainConfig) -> PreparedRun:
    """What `Trainer` needs decided first: a tracker that is not installed and a damaged checkpoint are named in
    seconds, the RNGs are seeded, and on GPUs the plan's GPUs are reserved and sized into the settings."""
    require_trackers(cfg.log.backends)
    resume = resume_point(Path(cfg.out_dir), cfg.checkpoint.resume_from) if cfg.checkpoint.resume else None
    if resume is not None:
        _same_staleness(resume, cfg.rollout.max_staleness)
    seed_everything(cfg.seed)
    placement = reserve_placement(cfg) if cfg.placement == "ray" else None
    try:
        settings = resolve(cfg, placement.plan if placement is not None else None)
    except BaseException:
        if placement is not None:
            placement.release()
        raise
    return PreparedRun(settings=settings, placement=placement, resume=resume)


class Trainer:
    """Multi-agent GRPO over a team. `train()` runs to `cfg.steps`, resuming from out_dir's newest checkpoint.
    Built from values (m1/marl/parts.py `make_trainer` assembles them from a config): the prepared run, the learner
    group and rollout engines, the hub the team reads, the reward function and the question stream."""

    def __init__(self, run: PreparedRun, learners: LearnerGroup, engines: RolloutEngine | None, hub: ModelHub,
                 reward_fn: RewardFn, data: QuestionStream, judge=None):
        self.settings, self.placement = run.settings, run.placement
        self.cfg, self.team_cfg, self.kind, self.trained = run.settings.cfg, run.settings.team, run.settings.kind, \
            run.settings.trained
        self.out = Path(self.cfg.out_dir)
        self.learners: LearnerGroup | None = learners
        self.engines, self.hub, self.reward_fn, self.data, self.judge = engines, hub, reward_fn, data, judge
        self.pool = VideoPool()
        # the sample pages' own pool when a producer thread decodes frames for rollouts at the same time
        self.page_pool = VideoPool() if self.cfg.rollout.max_staleness > 0 else self.pool
        self.step = self.checkpointed = 0  # checkpointed: the newest checkpoint's step (a stop writes one if behind)
        self.cursor_trained = 0  # the data cursor after the questions of the steps trained on (what a checkpoint keeps)
        self.producer: Producer | None = None
        self.resumed_from: Path | None = None
        self._step_ended: float | None = None  # when the previous step of this process ended (throughput)
        self.history: list[dict[str, Any]] = []
        self.tracker_ids: dict[str, str] = {}  # the tracker runs this run logs to (kept in its checkpoints)
        self.trackers = None
        self.teams: dict[str, tuple[Team, int]] = {}  # sampling / greedy -> (team, the step it was seeded for)
        self.credit = CreditStrategy(self.cfg, self.trained)
        if run.resume is not None:
            self.load_checkpoint(run.resume, verified=True)

    @property
    def _learners(self) -> LearnerGroup:
        if self.learners is None:
            raise RuntimeError("the trainer's learners are shut down")
        return self.learners

    @property
    def _engines(self) -> RolloutEngine:
        """The engines where a run has them for sure (asynchronous rollouts always build some)."""
        if self.engines is None:
            raise RolloutError("asynchronous rollouts need rollout engines; none were built")
        return self.engines

    @property
    def _producer(self) -> Producer:
        if self.producer is None:
            raise RolloutError("an asynchronous step runs inside train(), which starts the producer")
        return self.producer

    # ------------------------------------------------------------------ the loop
    def train(self, stop_after: int | None = None, stop: StopFlag | None = None) -> list[dict[str, Any]]:
        """Train until `cfg.steps` (or `stop_after` more steps); `stop`, once set by a signal, ends the run after the
        current step with a checkpoint of it (m1/marl/loop.py). With rollout.max_staleness k > 0 a producer thread
        samples up to k steps ahead of the updates (m1/marl/producer.py)."""
        k = self.cfg.rollout.max_staleness
        if k == 0:
            return run_steps(self, self.cfg.steps, self.train_step, "step", stop_after, stop)
        last = self.cfg.steps if stop_after is None else min(self.cfg.steps, self.step + stop_after)
        self.producer = Producer(self, k, self.step, last)
        try:
            self._stage_for_resume()
            self.producer.begin(self._engines.newest_staged())
            return run_steps(self, self.cfg.steps, self.async_step, "step", stop_after, stop)
        finally:
            self.producer.stop()
            self.producer = None

    def train_step(self) -> dict[str, Any]:
        """One synchronous step: the step's questions and DAG, K episodes each with the current weights, credit,
        one optimizer step per trained agent, and the step's metrics row."""
        started = time.perf_counter()
        synced = self.engines.sync(self.step) if self.engines is not None else {}  # engines get the current weights
        seconds = {"sync": time.perf_counter() - started}
        item = self.produce_step(self.step, self.step)
        row = self._learn(item, {**seconds, **item.seconds}, started)
        row.update({f"{agent}/sync_seconds": s for agent, s in synced.items()})
        return row

    def async_step(self) -> dict[str, Any]:
        """One asynchronous step: the producer's next step (sampled with weights min(step, k) updates old), one
        optimizer step per trained agent, and the new weights staged on the engines for the producer."""
        started = time.perf_counter()
        item = self._producer.get(self.step)
        seconds = {**item.seconds, "wait_rollout": time.perf_counter() - started}
        cpu = time.thread_time()
        row = self._learn(item, seconds, started)
        row["time/learner_cpu"] = time.thread_time() - cpu  # the trainer thread's CPU seconds (cf. producer_cpu)
        t0 = time.perf_counter()
        staged: dict[str, float] = {}
        if self._sampled_later(self.step):
            staged = self._engines.stage(self.step)
            self._producer.publish(self.step)
        self._engines.prune(sampling_version(self.step, self.cfg.rollout.max_staleness))
        row["time/stage"] = time.perf_counter() - t0
        row.update({f"{agent}/sync_seconds": s for agent, s in staged.items()})
        row["async/staleness"] = item.step - item.version
        for agent, rows in item.samples.items():  # the oldest weights that shaped each sample's prompt, per agent
            ages = [item.step - min(s.versions.values()) for s in rows if s.versions]
            if ages:
                row[f"{agent}/staleness_max"] = max(ages)
                row[f"{agent}/staleness_mean"] = sum(ages) / len(ages)
        row["async/queued"] = self._producer.queued
        return row

    def produce_step(self, step: int, version: int) -> StepItem:
        """Step `step`'s rollouts with weight version `version` on the engines: its questions and DAG, K episodes
        each, rewards, advantages and samples. Runs in the producer's thread when rollouts are asynchronous."""
        cfg, clock = self.cfg, StepClock()
        if self.engines is not None and self.engines.version != version:
            self.engines.activate(version)
        clock.lap("activate")
        first = self.data.cursor  # the run's number of the step's first question
        questions = self.data.take(cfg.rollout.questions_per_step)
        topology = self.kind.topology(self.settings.agents, cfg.rollout, cfg.seed, step)
        episodes = self.step_episodes(step, questions, first, topology, clock)  # rollouts, then scores; laps rollout
        credit = self.credit.credit(episodes)
        samples = credit.samples(self.settings.temperatures, self.settings.phases,
                                 self.settings.team.sampling.phase_temperature)
        if self.engines is not None:
            self.engines.check_versions(samples, version)
        clock.lap("reward")
        if self.engines is None or cfg.rollout.max_staleness == 0:
            clock.seconds.pop("activate")
        return StepItem(step, version, credit, samples, topology, self.data.cursor, self.data.epoch,
                        dict(clock.seconds))

    def _learn(self, item: StepItem, seconds: dict[str, float], started: float) -> dict[str, Any]:
        """Update every trained agent on the step's samples, write them when due, and return the metrics row."""
        t0 = time.perf_counter()
        stats = self._learners.update(item.samples, self.lr_at(self.step), "grpo")
        self.step += 1
        self.cursor_trained = item.cursor
        seconds["update"] = time.perf_counter() - t0
        seconds["step"] = time.perf_counter() - started
        if due(self.cfg.log.samples_every, self.step):  # what this step trained on, for a person to read
            t0 = time.perf_counter()
            self.write_samples(item.credit)
            seconds["samples"] = time.perf_counter() - t0
        row = self._metrics(item.credit, stats, item.topology, seconds, item.epoch)
        row.update(self._throughput(item.credit, started))
        return row

    def _throughput(self, credit: StepCredit, started: float) -> dict[str, float]:
        """Episodes and sampled tokens per second of wall time since the previous step ended (this step's start for
        the first): with asynchronous rollouts a step's parts overlap, so their sum is not its cost."""
        now = time.perf_counter()
        wall = now - (self._step_ended if self._step_ended is not None else started)
        self._step_ended = now
        episodes = [e for batch in credit.rounds for e in batch.flat]
        if credit.greedy is not None:
            episodes += credit.greedy.flat
        tokens = sum(len(g.completion_ids or []) for e in episodes for g in e.generations)
        return {"throughput/episodes_per_s": len(episodes) / wall, "throughput/tokens_per_s": tokens / wall,
                "time/wall": wall}

    def step_episodes(self, step: int, questions: list, first: int, topology, clock) -> StepEpisodes:
        """Step `step`'s episodes, run (the clock's `rollout` lap; the teams reseeded for the step) and scored.
        Under dynamic sampling each round is scored as it runs, since how many questions the next round refills
        depends on their rewards; the refill questions come next from the data cursor."""
        credit, rounds, todo = self.credit, [], questions
        while True:
            batch = run_rollouts(self._team(False, step), todo, credit.k, topology, credit.focus(first, len(todo)))
            rounds.append(score(batch, self.trained, self.reward_fn) if credit.dynamic else batch)
            need = credit.refill(rounds)
            if need <= 0:
                break
            first, todo = self.data.cursor, self.data.take(need)
        greedy = run_rollouts(self._team(True, step), questions, 1, topology) if credit.greedy_reference else None
        clock.lap("rollout")
        if not credit.dynamic:
            rounds = [score(rounds[0], self.trained, self.reward_fn)]
        if greedy is not None:
            greedy = score(greedy, self.trained, self.reward_fn)
        return credit.step_episodes(rounds, greedy)

    def _team(self, greedy: bool, step: int) -> Team:
        """One team for the whole run (so CLIP embeddings and decoded frames are reused), reseeded from (seed, step)
        at the first rollouts of each step, so they repeat exactly after a resume (a refill round of the same step
        goes on from where the step's first round left the generator); `greedy`: its copy decoding greedily."""
        name = "greedy" if greedy else "sampling"
        if name not in self.teams:
            cfg = self.team_cfg.greedy() if greedy else self.team_cfg
            self.teams[name] = (make_team(cfg, hub=self.hub, pool=self.pool), -1)
        team, seeded = self.teams[name]
        if seeded != step:
            team.reseed(derive_seed(self.cfg.seed, step, name))
            self.teams[name] = (team, step)
        return team

    def write_samples(self, credit: StepCredit) -> Path:
        """<out_dir>/samples/step-NNNNNN/ (samples.jsonl and trace pages) and the trackers' samples table."""
        with naming_full_disk(self.out / "samples"):
            folder, rows = write_step_samples(self.out, self.step, credit.batch,
                                              credit.generation_credit(self.settings.phases), credit.live, self.page_pool)
        if self.trackers is not None:
            self.trackers.table("samples", TABLE_COLUMNS, table_rows(rows), self.step)
        return folder

    def lr_at(self, step: int) -> float:
        return self.cfg.learner.lr_at(step, self.cfg.steps)

    def _metrics(self, credit: StepCredit, stats, topology, seconds, epoch: float) -> dict[str, Any]:
        batch, rewards = credit.batch, credit.batch.rewards
        row: dict[str, Any] = {"step": self.step, "epoch": epoch, "lr": self.lr_at(self.step - 1)}
        losses = [s["loss"] for s in stats.values() if "loss" in s]  # a NaN loss shows as NaN
        row["loss"] = sum(losses) / len(losses) if losses else float("nan")
        row["reward/mean"] = _mean([r for a in rewards for g in rewards[a] for r in g])
        for agent, st in stats.items():
            row.update({f"{agent}/{k}": v for k, v in st.items()})
            adv = credit.advantages[agent]
            row[f"{agent}/adv_abs_mean"] = float(adv.abs().mean()) if adv.numel() else 0.0
            row[f"{agent}/reward"] = _mean([r for g in rewards[agent] for r in g])
        row.update(self.kind.summary(batch.breakdowns))
        row["topology/active"] = len(topology.active)
        row["topology/edges"] = len(topology.edges)
        row["episodes/failed"] = sum(e.error is not None for e in batch.flat)
        gens = [g for e in batch.flat for g in e.generations]  # the prompt budget: share of prompts trimmed to fit it
        row["prompts/trimmed"] = sum(g.trimmed > 0 for g in gens) / len(gens) if gens else 0.0
        row["prompts/dropped"] = sum((e.error or "").startswith("dropped:") for e in batch.flat)
        row.update({f"time/{k}": v for k, v in seconds.items()})
        row.update(self.kind.step_metrics(credit.rounds, self.trained, self.team_cfg.tools.enabled))
        row.update(credit.metrics)
        if credit.greedy is not None:
            row.update(self.kind.greedy_summary(credit.greedy.breakdowns))
        return row

    # ------------------------------------------------------------------ checkpoints
    def save_checkpoint(self, interim: bool = False) -> Path:
        folder = save_checkpoint(self.out, self.step, self.learners, self._state(), self.cfg.checkpoint.keep_last,
                                 interim, self._version_folders())
        self.checkpointed = self.step
        return folder

    def _state(self) -> dict[str, Any]:
        state = {"step": self.step, "cursor": self.cursor_trained, "seed": self.cfg.seed, "agents": self.trained,
                 "name": self.cfg.name, "config": self.cfg.model_dump(mode="json"), "trackers": self.tracker_ids}
        k = self.cfg.rollout.max_staleness
        if k > 0:
            state["async"] = {"max_staleness": k, "versions": self._pending_versions()}
        return state

    def _pending_versions(self) -> list[int]:
        """The older weight versions the next k steps sample with (asynchronous rollouts): a resume needs them."""
        k = self.cfg.rollout.max_staleness
        steps = range(self.step, min(self.step + k, self.cfg.steps))
        return sorted({sampling_version(t, k) for t in steps} - {self.step})

    def _sampled_later(self, version: int) -> bool:
        """Whether a step of this run samples with weight version `version` (asynchronous rollouts): version 0 by
        steps 0..k, version n > 0 by step n + k."""
        return sampling_version(self.cfg.steps - 1, self.cfg.rollout.max_staleness) >= version

    def _version_folders(self) -> dict[str, Path]:
        return {f"versions/{agent}/v{v:06d}": self._engines.staged_folder(agent, v)
                for v in (self._pending_versions() if self.cfg.rollout.max_staleness > 0 else [])
                for agent in self.trained}

    def _stage_for_resume(self) -> None:
        """Before an asynchronous run's producer starts: the versions its first k steps sample with on the engines,
        from the checkpoint it resumed from (older ones) and from the learners (the current one)."""
        for v in self._pending_versions():
            if self.resumed_from is None:
                raise RolloutError(f"step {self.step}: weight version {v} is needed and no checkpoint holds it")
            self._engines.stage_from(v, {a: self.resumed_from / "versions" / a / f"v{v:06d}" for a in self.trained})
        if self._sampled_later(self.step):
            self._engines.stage(self.step)

    def load_checkpoint(self, folder: Path, verified: bool = False) -> None:
        state = load_checkpoint(folder, self.learners, self.trained, self.cfg.seed, verified)
        _same_staleness(folder, self.cfg.rollout.max_staleness, state)
        self.step, self.data.cursor = int(state["step"]), int(state["cursor"])
        self.cursor_trained = self.data.cursor
        self.resumed_from = Path(folder)
        self.tracker_ids = dict(state.get("trackers") or {})
        self.checkpointed = self.step
        log.info("resumed from %s (step %d)", folder, self.step)

    def close(self) -> None:
        if self.engines is not None:
            self.engines.close()
        if self.learners is not None:
            self.learners.shutdown()
        if self.placement is not None:
            self.placement.release()


def _same_staleness(folder: Path, k: int, state: dict | None = None) -> None:
    """Refuse to resume a checkpoint under another rollout.max_staleness: its next steps sample with the weight
    versions its own k chose (and it holds only those)."""
    if state is None:
        state = json.loads((Path(folder) / STATE).read_text())
    saved = (state.get("async") or {}).get("max_staleness", 0)
    if saved != k:
        raise ValueError(f"{folder}: the run was trained with rollout.max_staleness {saved}, the config says {k}; "
                         "resume with the same value")


def _mean(values) -> float:
    """The mean of the values that are not NaN (NaN when none is)."""
    finite = [v for v in values if v == v]
    return sum(finite) / len(finite) if finite else float("nan")
