"""What a MARL trainer is built from, assembled before it exists: the learner group (and rollout engines) of the
trained agents, the model hub the team reads (the learners registered under their agents' model keys, so the team
generates with the weights being trained), the judge and the reward function. `make_trainer` is the one way from a
config to a `Trainer` (m1/marl/trainer.py): `prepare_run`, then these parts, then the trainer, which only runs steps
on them; a failure on the way releases what was already built."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from m1.contracts import LearnerGroup, RolloutEngine
from m1.marl.actor.groups import build_learners, host_driver_models
from m1.marl.config import TrainConfig
from m1.marl.reward.llm_judge import LLMJudge
from m1.marl.reward.rubric_judge import RubricJudge
from m1.marl.rollout.episodes import RewardFn
from m1.marl.rollout.stream import QuestionStream, load_questions
from m1.marl.rollout_engines import HFSamplers, RolloutEngines
from m1.marl.trainer import PreparedRun, Trainer, prepare_run
from m1.models.hub import ModelHub


@dataclass
class TrainingParts:
    """The built parts a trainer runs on; `close` shuts down what holds processes or servers."""

    learners: LearnerGroup
    engines: RolloutEngine | None  # vLLM servers or the hf sampler copies; None: the learners' own samplers
    hub: ModelHub
    judge: object | None
    reward_fn: RewardFn

    def close(self) -> None:
        if self.engines is not None:
            self.engines.close()
        self.learners.shutdown()


def build_judge(cfg: TrainConfig, model=None):
    """The collaboration-reward judge; `model`: the LLM judge's model when it is already loaded (hosted on a GPU)."""
    j = cfg.judge
    if j.method == "none":
        return None
    if j.method == "rubric":
        return RubricJudge(tool_call_limit=cfg.rewards.tool_call_limit, plan_rubric=j.plan_rubric)
    if model is None:
        if j.model is None:
            raise ValueError(f"judge.method {j.method!r} needs judge.model")
        model = ModelHub({"judge": j.model}).chat("judge")
    cache = j.cache_dir or str(Path(cfg.out_dir) / "judge_cache")
    return LLMJudge(model, cache_dir=cache, rate_per_minute=j.rate_per_minute,
                    tool_call_limit=cfg.rewards.tool_call_limit, plan_rubric=j.plan_rubric)


def build_parts(run: PreparedRun, hub: ModelHub | None = None, reward_fn: RewardFn | None = None,
                judge=None) -> TrainingParts:
    """Load the trained agents' learners (and engines) and register them in `hub` (default: one over the team's
    models); on GPUs, the driver models the plan hosts. `reward_fn` / `judge` given replace the team kind's."""
    s = run.settings
    cfg, keys, models = s.cfg, s.model_keys, s.team.models
    hub = hub if hub is not None else ModelHub(models)
    hub.specs.update(models)  # split keys of agents that shared a model
    specs = {a: (keys[a], models[keys[a]]) for a in s.trained}
    judged = {"judge": cfg.judge.model} if cfg.judge.model is not None else {}
    hosted = host_driver_models(run.placement, {**models, **judged}) if run.placement is not None else {}
    learners = build_learners(specs, cfg.learner, cfg.grpo, cfg.seed, cfg.placement, cfg.ray, cfg.out_dir,
                              {a: cfg.cluster.gpus_of(a, cfg.learner) for a in s.trained}, run.placement)
    engines = None
    try:
        if cfg.rollout.engine == "vllm":  # each trained agent generates on a vLLM server, synced before every step
            engines = RolloutEngines(cfg, specs, learners, run.placement)
        elif cfg.rollout.max_staleness > 0:  # hf, asynchronous: copies of the learners' models sample
            engines = HFSamplers(learners, cfg.out_dir)
        chats = engines.chat_models() if engines is not None else learners.chat_models()
        for agent, chat in chats.items():  # a vision-language policy is fetched as a vision model (m1/team/single.py)
            hub.register(keys[agent], chat, interface=models[keys[agent]].interface)
        for key, model in hosted.items():
            if key != "judge":
                hub.register(key, model, interface=model.interface)
        if reward_fn is None and s.kind.needs_judge and judge is None:
            judge = build_judge(cfg, hosted.get("judge"))
        reward_fn = reward_fn or s.kind.reward_fn(cfg, s.team, judge)
    except BaseException:
        if engines is not None:
            engines.close()
        learners.shutdown()
        raise
    return TrainingParts(learners=learners, engines=engines, hub=hub, judge=judge, reward_fn=reward_fn)


def make_trainer(cfg: TrainConfig, questions: list | None = None, hub: ModelHub | None = None,
                 reward_fn: RewardFn | None = None, judge=None) -> Trainer:
    """A `Trainer` for `cfg` (resumed from its newest checkpoint when `checkpoint.resume`): `questions` given
    replace `data.questions`; `hub`, `reward_fn` and `judge` given replace the ones the config builds."""
    run = prepare_run(cfg)
    parts = None
    try:
        cfg = run.settings.cfg
        data = QuestionStream(questions if questions is not None else
                              load_questions(cfg.data.questions, cfg.data.video_dir), cfg.seed, cfg.data.shuffle)
        parts = build_parts(run, hub, reward_fn, judge)
        return Trainer(run, parts.learners, parts.engines, parts.hub, parts.reward_fn, data, judge=parts.judge)
    except BaseException:
        if parts is not None:
            parts.close()
        if run.placement is not None:
            run.placement.release()
        raise
