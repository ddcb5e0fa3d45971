"""Multi-agent GRPO trainer: one learner per agent, trained jointly on the team's own rollouts.

One training step, top to bottom (`Trainer.train_step`):

1. take the next `questions_per_step` questions (a seeded permutation per epoch; the cursor is checkpointed);
2. sample one communication DAG for the step (random edges, agent dropout);
3. run every question K times over that DAG at temperature 1 through the `Team` engine — the agents generate with
   their learners' current weights, because each learner is registered in the model hub under its agent's key;
4. score every agent in every episode (R_res + R_format + R_col), normalise each agent's rewards within its K
   rollouts of a question (GRPO advantages), and turn every generation into a sample (m1/marl/rollout.py);
5. update each agent's learner: recompute the log-probs of its completions, add the clipped GRPO surrogate and
   beta * k3 KL to the reference (m1/marl/grpo.py), accumulate gradients over micro-batches, clip, AdamW step;
6. log metrics (JSONL, the trackers of `log.backends`, progress bar), every `log.samples_every` steps the step's
   episodes with their rewards and advantages (m1/marl/samples.py), and checkpoint every `checkpoint.every` steps.

A seed-kind team (weaver / zoomer / sage, m1/team/single.py) trains through the same loop: its one agent on the
complete topology, its kind's reward (m1.marl.rewards.seed_rewards), and every policy turn a sample whose prompt is
the chat so far (tool observations are context only) and whose advantage is its episode's.

The learners (policy, reference, optimizer; local or Ray actors) live in m1/marl/learner.py, checkpoints in
m1/marl/checkpoint.py, the question stream and metrics log in m1/marl/stream.py, the command in m1/marl/launch.py.

Exact resume: a checkpoint holds each agent's weights (or adapter) and optimizer state, the Python/NumPy/torch RNG
states, the step and the data cursor. Rollout randomness (DAG, sampling seeds) is derived from (seed, step), so a
resumed run repeats an uninterrupted one exactly on CPU. The checkpoint is checked against its manifest before the
models load (a damaged one stops the run with an error naming the file, see m1/marl/checkpoint.py), and a stop flag
(SIGTERM/SIGINT, set by `stop_on_signals`) ends the loop after the current step with a checkpoint of it.
"""
from __future__ import annotations

import json
import logging
import math
import shutil
import time
from pathlib import Path
from typing import Any

from m1.marl.checkpoint import (CHECKPOINT_DIR, StopFlag, finished_checkpoints, load_checkpoint, naming_full_disk,
                                 resume_point, save_checkpoint)
from m1.marl.config import CPP_PHASES, TrainConfig, seed_kind, seed_phases
from m1.marl.groups import build_learners, host_driver_models, reserve_placement, stop_on_lost_ranks
from m1.marl.learner import derive_seed, seed_everything
from m1.marl.rewards import answer_rewards
from m1.marl.recipe import informative_groups, merge_batches, plan_entropy, step_topology
from m1.marl.rollout import (RewardFn, RolloutError, advantages_for, agent_temperature, build_samples, focus_agents,
                             focus_only, generation_credit, resample_answers, run_rollouts, score,
                             training_team_config)
from m1.marl.samples import due
from m1.marl.stream import MetricsLog, QuestionStream, load_questions

log = logging.getLogger(__name__)


def build_judge(cfg: TrainConfig, model=None):
    """The collaboration-reward judge; `model`: the LLM judge's model when it is already loaded (hosted on a GPU)."""
    from m1.marl.judge import LLMJudge, RubricJudge

    j = cfg.judge
    if j.kind == "none":
        return None
    if j.kind == "rubric":
        return RubricJudge(tool_call_limit=cfg.rewards.tool_call_limit, plan_rubric=j.plan_rubric)
    if model is None:
        from m1.models.hub import ModelHub

        model = ModelHub({"judge": j.model}).chat("judge")
    cache = j.cache_dir or str(Path(cfg.out_dir) / "judge_cache")
    return LLMJudge(model, cache_dir=cache, rate_per_minute=j.rate_per_minute,
                    tool_call_limit=cfg.rewards.tool_call_limit, plan_rubric=j.plan_rubric)


# ================================================================================================ the trainer
class Trainer:
    """Multi-agent GRPO over a team. `train()` runs to `cfg.steps`, resuming from out_dir's newest checkpoint."""

    def __init__(self, cfg: TrainConfig, questions: list | None = None, hub=None, reward_fn: RewardFn | None = None,
                 judge=None):
        from m1.models.hub import ModelHub
        from m1.video import VideoPool

        from m1.marl.trackers import require_trackers

        self.cfg = cfg
        self.out = Path(cfg.out_dir)
        require_trackers(cfg.log.backends)  # a tracker that is not installed is named before any model loads
        # the checkpoint to resume from, verified before anything loads: a damaged one is reported in seconds
        resume = resume_point(self.out, cfg.checkpoint.resume_from) if cfg.checkpoint.resume else None
        seed_everything(cfg.seed)
        self.team_cfg = training_team_config(cfg.team_config(), cfg.rollout.temperature)
        if self.team_cfg.limits.max_prompt_tokens is None:  # the team trims to what the learner takes whole
            self.team_cfg = self.team_cfg.model_copy(update={"limits": self.team_cfg.limits.model_copy(
                update={"max_prompt_tokens": cfg.learner.max_prompt_tokens})})
        if cfg.rollout.engine == "vllm":  # an engine batches on its own: all of a step's episodes in one call each
            limits = self.team_cfg.limits
            step_episodes = cfg.rollout.questions_per_step * cfg.rollout.num_generations
            self.team_cfg = self.team_cfg.model_copy(update={"limits": limits.model_copy(
                update={"batch_episodes": max(limits.batch_episodes, step_episodes)})})
        self.agents = [a.name for a in self.team_cfg.agents]
        # weaver / zoomer / sage: a team of one in a multi-turn tool loop; every turn is a sample with the episode's
        # advantage, the tool observations in its prompt only (m1/team/single.py); None: the CPP team
        self.seed_kind = seed_kind(self.team_cfg)
        self.trained = list(cfg.train_agents or self.agents)
        self.temperatures = {a: agent_temperature(self.team_cfg, a) for a in self.trained}
        self.hub = hub if hub is not None else ModelHub(self.team_cfg.models)
        self.hub.specs.update(self.team_cfg.models)  # split keys of agents that shared a model
        self.pool = VideoPool()
        self.data = QuestionStream(questions if questions is not None else
                                   load_questions(cfg.data.questions, cfg.data.video_dir), cfg.seed, cfg.data.shuffle)
        key_of = self.model_keys = {a.name: a.model for a in self.team_cfg.agents}
        specs = {a: (key_of[a], self.team_cfg.models[key_of[a]]) for a in self.trained}
        # on GPUs (placement ray): the plan's GPUs reserved before anything loads; learners and the driver's models
        # each in the bundles the plan gave them
        self.placement = reserve_placement(cfg) if cfg.placement == "ray" else None
        if cfg.rollout.engine == "hf" and cfg.rollout.batch_episodes is not None:
            # episodes at once: the configured number, or (auto) as many as the plan fits in the learners' memory
            from m1.marl.cluster import rollout_batch

            n = rollout_batch(cfg, self.placement.plan if self.placement is not None else None)
            log.info("rollouts: %d episodes at once (rollout.batch_episodes: %s)", n, cfg.rollout.batch_episodes)
            self.team_cfg = self.team_cfg.model_copy(update={"limits": self.team_cfg.limits.model_copy(
                update={"batch_episodes": n})})
        hosted = host_driver_models(self.placement, {**self.team_cfg.models, **(
            {"judge": cfg.judge.model} if cfg.judge.model is not None else {})}) if self.placement else {}
        self.learners = build_learners(specs, cfg.learner, cfg.grpo, cfg.seed, cfg.placement, cfg.ray, cfg.out_dir,
                                       {a: cfg.cluster.gpus_of(a, cfg.learner) for a in self.trained},
                                       self.placement)
        # rollout.engine vllm: the trained agents generate on a vLLM server each, synced before every step
        self.engines = None
        if cfg.rollout.engine == "vllm":
            from m1.marl.engines import RolloutEngines

            try:
                self.engines = RolloutEngines(cfg, specs, self.learners, self.placement)
            except BaseException:
                self.close()
                raise
        chats = self.engines.chat_models() if self.engines is not None else self.learners.chat_models()
        for agent, chat in chats.items():  # a vision-language policy is fetched as a vision model (m1/team/single.py)
            self.hub.register(key_of[agent], chat, kind=self.team_cfg.models[key_of[agent]].kind)
        for key, model in hosted.items():
            if key != "judge":
                self.hub.register(key, model, kind=model.kind)
        self.judge = judge
        if reward_fn is None and self.seed_kind is not None:
            from m1.marl.rewards import reward_kind, seed_rewards

            kind = reward_kind(cfg.rewards, self.team_cfg)
            reward_fn = lambda eps: seed_rewards(eps, kind)  # noqa: E731
        if reward_fn is None:
            from m1.marl.rewards import batch_agent_rewards

            self.judge = judge if judge is not None else build_judge(cfg, hosted.get("judge"))
            reward_fn = lambda eps: batch_agent_rewards(eps, cfg.rewards, self.judge)  # noqa: E731
        self.reward_fn = reward_fn
        self.step = 0
        self.checkpointed = 0  # the step of the newest checkpoint on disk (a stop writes one unless it is current)
        self.history: list[dict[str, Any]] = []
        self.tracker_ids: dict[str, str] = {}  # the tracker runs this run logs to (kept in its checkpoints)
        self.trackers = None  # open while train() runs
        try:
            if resume is not None:
                self.load_checkpoint(resume, verified=True)
            if cfg.average.include_start and self.step == 0:
                self.save_start()
        except BaseException:
            self.close()
            raise

    # ------------------------------------------------------------------ the loop
    def train(self, stop_after: int | None = None, stop: StopFlag | None = None) -> list[dict[str, Any]]:
        """Train until `cfg.steps` (or `stop_after` more steps, e.g. to simulate a killed run).

        `stop`: once set (by a signal), the loop ends after the current step and checkpoints it (an interim checkpoint
        when it is off the `checkpoint.every` schedule), so nothing done is lost.
        """
        cfg = self.cfg
        last = cfg.steps if stop_after is None else min(cfg.steps, self.step + stop_after)
        if stop is not None:
            stop.reclaim()  # a Ray started while the models loaded took SIGTERM over
        with naming_full_disk(self.out / "metrics.jsonl"):  # it drops the lines after the resumed step
            logger = MetricsLog(self.out, cfg.steps, self.step, cfg.log.progress)
        failed = True
        try:
            from m1.marl.trackers import open_trackers

            self.trackers = logger.trackers = open_trackers(cfg, self.placement, self.tracker_ids)
            self.tracker_ids = self.trackers.run_ids()
            while self.step < last and not stop:
                try:
                    row = self.train_step()
                except Exception as exc:
                    stop_on_lost_ranks(self.learners, exc, f"step {self.step + 1} of {cfg.steps}", self.checkpointed)
                    raise
                with naming_full_disk(logger.path):
                    logger.write(row)
                self.history.append(row)
                if self.step % cfg.checkpoint.every == 0 or self.step == cfg.steps:
                    try:
                        self.save_checkpoint()
                    except Exception as exc:
                        stop_on_lost_ranks(self.learners, exc, f"the checkpoint of step {self.step}", self.checkpointed)
                        raise
            if stop and self.step != self.checkpointed:
                self.save_checkpoint(interim=True)
            failed = False
        finally:
            self.trackers = None
            logger.close(failed)
        if self.step == cfg.steps and cfg.average.checkpoints:
            self.write_average()
        return self.history

    def train_step(self) -> dict[str, Any]:
        cfg, step = self.cfg, self.step
        t0 = time.perf_counter()

        # 1-2. this step's questions and its communication DAG (agent dropout; rollout.complete_share /
        # anneal_share schedule it toward the complete graph evaluation uses)
        first = self.data.cursor  # the run's number of the step's first question
        questions = self.data.take(cfg.rollout.questions_per_step)
        topology = step_topology(self.agents, cfg.rollout, cfg.seed, step, cfg.steps, complete=bool(self.seed_kind))

        # 3. K episodes per question, generated with the current weights (rollout engines get them first)
        synced = self.engines.sync(step) if self.engines is not None else {}
        t_sync = time.perf_counter()
        team = self._team(step)
        if cfg.rollout.dynamic_sampling:  # rounds of rollouts until the step has enough informative groups
            batch, rounds, live, dropped = self._dynamic_rollouts(team, questions, first, topology)
            focus = batch.focus
        else:
            focus = None  # credit agent: one sampling agent per question, its teammates greedy
            if cfg.rollout.credit == "agent":
                focus = focus_agents(self.trained, first, len(questions))
            batch = run_rollouts(team, questions, cfg.rollout.num_generations, topology, cfg.rollout.rotate_options,
                                 focus)
            rounds, live = [batch], None
        greedy = None  # grpo.baseline greedy: each question once more, greedily, as the baseline (not trained on)
        if cfg.grpo.baseline == "greedy":
            greedy = run_rollouts(self._team(step, greedy=True), questions, 1, topology)
        t_rollout = time.perf_counter()

        # 4. rewards -> per-agent group advantages -> one sample per generation
        rewards = batch.rewards if live is not None else score(batch, self.trained, self.reward_fn)
        base = score(greedy, self.trained, self.reward_fn) if greedy is not None else None
        # credit agent: an agent is credited only in the questions it was the focus of
        advantages = advantages_for(focus_only(rewards, focus) if focus else rewards, cfg.grpo.scale_rewards, base)
        answer_adv = None
        if cfg.rollout.credit == "phase":  # answers: the advantage of their own outcome only
            if not batch.outcomes:
                raise RolloutError("rollout.credit 'phase' needs rewards with an `outcome` part (RewardBreakdown); "
                                   "this reward function returns plain numbers")
            answer_adv = advantages_for(batch.outcomes, cfg.grpo.scale_rewards,
                                        greedy.outcomes if greedy is not None else None)
        answer_groups = []
        if cfg.rollout.answer_samples:  # answers: M more per answer prompt, credited within that prompt's answers
            answer_groups = resample_answers(
                batch, self.trained, lambda a: self.hub.chat(self.model_keys[a]), cfg.rollout.answer_samples,
                self.temperatures, self.team_cfg.limits.answer_tokens, derive_seed(cfg.seed, step, "answers"),
                lambda pairs: answer_rewards(pairs, cfg.rewards, self.judge), cfg.grpo.scale_rewards)
        phases = cfg.rollout.train_phases
        if self.seed_kind is not None:  # the default: every turn (act and answer)
            phases = seed_phases(phases, "rollout.train_phases", self.seed_kind, CPP_PHASES)
        samples = build_samples(batch, advantages, self.temperatures, answer_adv, answer_groups, phases)
        if live is not None:  # dynamic sampling: a kept question's tied groups are dropped too
            samples = {a: [s for s in rows if live[a][s.group]] for a, rows in samples.items()}
        if cfg.rollout.plan_temperature is not None and not self.seed_kind:  # plans were sampled at their own
            for rows in samples.values():
                for s in rows:
                    if s.phase == "plan":
                        s.temperature = cfg.rollout.plan_temperature
        if self.engines is not None:
            self.engines.check_versions(samples, step)
        t_reward = time.perf_counter()

        # 5. one optimizer step per agent
        stats = self.learners.update(samples, self.lr_at(step), "grpo")
        self.step += 1
        t_end = time.perf_counter()
        seconds = {"sync": t_sync - t0, "rollout": t_rollout - t_sync, "reward": t_reward - t_rollout,
                   "update": t_end - t_reward, "step": t_end - t0}
        if due(cfg.log.samples_every, self.step):  # what this step trained on, for a person to read
            credit = generation_credit(batch, advantages, answer_adv, answer_groups, phases)
            self.write_samples(batch, credit, live)
            seconds["samples"] = time.perf_counter() - t_end

        # 6. metrics
        row = self._metrics(batch, rewards, advantages, stats, topology, answer_groups, seconds)
        for agent, seconds in synced.items():
            row[f"{agent}/sync_seconds"] = seconds
        if not self.seed_kind:  # how much the plan phase still explores, per question family
            row.update(plan_entropy(rounds, self.trained, self.team_cfg.tools.enabled))
        if live is not None:
            row["groups/dropped_share"] = dropped
            row["groups/refill_rounds"] = len(rounds) - 1
            row["groups/kept"] = len(batch.questions)
        if greedy is not None:  # the greedy team on this step's questions: what evaluation measures
            flat = [r for a in base for g in base[a] for r in g if not math.isnan(r)]
            row["greedy/reward"] = sum(flat) / len(flat) if flat else float("nan")
            if all(hasattr(v, "team_res") for per in greedy.breakdowns for v in per.values()):
                from m1.marl.rewards import summarize

                row.update({f"greedy/{k.split('/', 1)[1]}": v for k, v in summarize(greedy.breakdowns).items()
                            if k in ("reward/res", "reward/team_res")})
        return row

    def write_samples(self, batch, credit, live=None) -> Path:
        """<out_dir>/samples/step-NNNNNN/ (samples.jsonl and trace pages) and the trackers' samples table."""
        from m1.marl.samples import TABLE_COLUMNS, table_rows, write_step_samples

        with naming_full_disk(self.out / "samples"):
            folder, rows = write_step_samples(self.out, self.step, batch, credit, live, self.pool)
        if self.trackers is not None:
            self.trackers.table("samples", TABLE_COLUMNS, table_rows(rows), self.step)
        return folder

    def _dynamic_rollouts(self, team, questions, first: int, topology):
        """`rollout.dynamic_sampling`: run `questions`, score them, keep each question where some agent's group
        has reward spread, and run the next questions of the data cursor in place of the others, for at most
        `max_refill` more rounds. Returns the kept questions' merged batch (scored), every round's batch, which
        (agent, kept question) groups carry signal, and the share of all groups that tied."""
        cfg = self.cfg
        r = cfg.rollout
        parts, rounds, flags = [], [], {a: [] for a in self.trained}
        groups = tied = 0
        while True:
            focus = focus_agents(self.trained, first, len(questions)) if r.credit == "agent" else None
            batch = run_rollouts(team, questions, r.num_generations, topology, r.rotate_options, focus)
            rewards = score(batch, self.trained, self.reward_fn)
            credited = focus_only(rewards, focus) if focus else rewards
            live = informative_groups(credited, batch.outcomes if r.credit == "phase" else None)
            keep = [g for g in range(len(questions)) if any(live[a][g] for a in self.trained)]
            for a in self.trained:
                groups += sum(f is not None for f in live[a])
                tied += sum(f is False for f in live[a])
                flags[a] += [bool(live[a][g]) for g in keep]
            rounds.append(batch)
            parts.append((batch, keep))
            need = r.questions_per_step - sum(len(k) for _, k in parts)
            if need == 0 or len(rounds) > r.max_refill:
                break
            first = self.data.cursor
            questions = self.data.take(need)
        return merge_batches(parts), rounds, flags, tied / groups if groups else 0.0

    def _team(self, step: int, greedy: bool = False):
        """One team for the whole run (so CLIP embeddings and decoded frames are reused), reseeded
        from (seed, step) so rollouts repeat exactly after a resume; `greedy`: its copy decoding greedily."""
        from m1.team.cpp import make_team

        name = "_greedy_team" if greedy else "_team_obj"
        if getattr(self, name, None) is None:
            cfg = self.team_cfg.greedy() if greedy else self.team_cfg
            setattr(self, name, make_team(cfg, hub=self.hub, pool=self.pool))
            if not greedy and self.cfg.rollout.plan_temperature is not None and not self.seed_kind:
                getattr(self, name).phase_temperatures["plan"] = self.cfg.rollout.plan_temperature
        team = getattr(self, name)
        team.reseed(derive_seed(self.cfg.seed, step, "greedy" if greedy else "sampling"))
        return team

    def lr_at(self, step: int) -> float:
        return self.cfg.learner.lr_at(step, self.cfg.steps)

    def _metrics(self, batch, rewards, advantages, stats, topology, answer_groups, seconds) -> dict[str, Any]:
        import torch

        row: dict[str, Any] = {"step": self.step, "epoch": self.data.epoch, "lr": self.lr_at(self.step - 1)}
        losses = [s["loss"] for s in stats.values() if "loss" in s]
        row["loss"] = sum(losses) / len(losses) if losses else float("nan")
        all_r = [r for a in rewards for g in rewards[a] for r in g if not math.isnan(r)]
        row["reward/mean"] = sum(all_r) / len(all_r) if all_r else float("nan")
        for agent, st in stats.items():
            for k, v in st.items():
                row[f"{agent}/{k}"] = v
            adv = advantages[agent]
            row[f"{agent}/adv_abs_mean"] = float(torch.as_tensor(adv).abs().mean()) if adv.numel() else 0.0
            flat = [r for g in rewards[agent] for r in g if not math.isnan(r)]
            row[f"{agent}/reward"] = sum(flat) / len(flat) if flat else float("nan")
        if batch.breakdowns and all(hasattr(v, "res") for per in batch.breakdowns for v in per.values()):
            from m1.marl.rewards import summarize

            row.update(summarize(batch.breakdowns))
        elif batch.breakdowns and all(hasattr(v, "kind") for per in batch.breakdowns for v in per.values()):
            from m1.marl.rewards import summarize_seed

            row.update(summarize_seed(batch.breakdowns))
        if answer_groups:  # how often the resampled answers disagreed (only those groups carry signal)
            row["answer_groups/reward"] = sum(sum(x.rewards) for x in answer_groups) / sum(
                len(x.rewards) for x in answer_groups)
            row["answer_groups/mixed"] = sum(max(x.rewards) > min(x.rewards) for x in answer_groups) / len(
                answer_groups)
        row["topology/active"] = len(topology.active)
        row["topology/edges"] = len(topology.edges)
        row["episodes/failed"] = sum(e.error is not None for e in batch.flat)
        gens = [g for e in batch.flat for g in e.generations]  # the prompt budget: share of prompts trimmed to fit it
        row["prompts/trimmed"] = sum(g.trimmed > 0 for g in gens) / len(gens) if gens else 0.0
        row["prompts/dropped"] = sum((e.error or "").startswith("dropped:") for e in batch.flat)
        row.update({f"time/{k}": v for k, v in seconds.items()})
        return row

    # ------------------------------------------------------------------ checkpoints
    def save_checkpoint(self, interim: bool = False) -> Path:
        folder = save_checkpoint(self.out, self.step, self.learners, self._state(), self.cfg.checkpoint.keep_last,
                                 interim)
        self.checkpointed = self.step
        return folder

    def save_start(self) -> None:
        """The weights before the first update, for average.include_start (written once, atomically)."""
        from m1.marl.average import START_DIR

        final = self.out / START_DIR
        if (final / "agents").is_dir():
            return
        tmp = self.out / f".{START_DIR}.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        self.learners.save(tmp / "agents")
        tmp.rename(final)

    def write_average(self) -> Path:
        """<out>/average: the mean of the newest `average.checkpoints` checkpoints (and the start), unless the
        folder already holds exactly those members."""
        from m1.marl.average import AVERAGE_DIR, START_DIR, write_average

        avg = self.cfg.average
        done = finished_checkpoints(self.out, include_interim=False)  # a stop's extra checkpoint is no member
        members = done[-avg.checkpoints:]
        if len(members) < avg.checkpoints or members[-1].name != f"step-{self.cfg.steps:06d}":
            raise FileNotFoundError(f"{self.out / CHECKPOINT_DIR}: average.checkpoints={avg.checkpoints} needs that "
                                    f"many checkpoints ending at step {self.cfg.steps}; found "
                                    f"{[p.name for p in done]}")
        names = ([START_DIR] if avg.include_start else []) + [p.name for p in members]
        info = self.out / AVERAGE_DIR / "average.json"
        if info.is_file() and json.loads(info.read_text()).get("members") == names:
            return info.parent
        folder = write_average(self.out, members, self.trained, self.cfg.learner.finetune, avg.include_start)
        log.info("averaged %s into %s", names, folder)
        return folder

    def _state(self) -> dict[str, Any]:
        return {"step": self.step, "cursor": self.data.cursor, "seed": self.cfg.seed, "agents": self.trained,
                "name": self.cfg.name, "config": self.cfg.model_dump(mode="json"), "trackers": self.tracker_ids}

    def load_checkpoint(self, folder: Path, verified: bool = False) -> None:
        state = load_checkpoint(folder, self.learners, self.trained, self.cfg.seed, verified)
        self.step, self.data.cursor = int(state["step"]), int(state["cursor"])
        self.tracker_ids = dict(state.get("trackers") or {})
        self.checkpointed = self.step
        log.info("resumed from %s (step %d)", folder, self.step)

    def close(self) -> None:
        if self.engines is not None:
            self.engines.close()
        self.learners.shutdown()
        if self.placement is not None:
            self.placement.release()
