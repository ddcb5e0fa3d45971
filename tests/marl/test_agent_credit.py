"""Per-agent credit (`rollout.credit: agent`).

With episode credit every agent samples at once, so an agent's advantage also measures its teammates' random
draws. Agent credit gives each question one focus agent: it samples, its teammates decode greedily, and only its
generations are trained on, normalised within its question's K episodes. These tests check that the teammates
really are deterministic within a group, that the focus agent's advantages do not move with a teammate's
sampling noise (they do under episode credit), that samples and group ids belong to focus agents only, and that
training with the option moves every trained agent and resumes exactly.
"""
import random

import pytest

from tests.fakes import FakeVision, scripted_reply
from m1.config import TeamConfig
from m1.marl.algo.credit import AgentCredit
from m1.marl.algo.advantages import group_advantages
from m1.marl.rollout.episodes import build_samples, run_rollouts, sample_topology, score, training_team_config
from m1.models.base import Completion
from tests.marl.test_trainer import AGENTS, COMPARED, make_trainer, questions, team_dict, train_cfg


class NoisyChat:
    """A scripted agent whose answer letter is its only random choice: drawn from (call seed, row, `salt`) when
    sampling, always B when greedy. `salt` stands for the model's own sampling noise; `temps` records each call's
    temperature."""

    def __init__(self, salt=0):
        self.salt, self.temps = salt, []

    def generate(self, requests, params):
        self.temps.append(params.temperature)
        outs = []
        for i, r in enumerate(requests):
            text = scripted_reply(r.messages)
            if text.startswith("##Answer"):
                letter = random.Random(f"{params.seed}/{i}/{self.salt}").choice("AB") if params.temperature > 0 \
                    else "B"
                text = f"##Answer: {letter} ##Reason: drawn"
            ids = [ord(c) % 97 for c in text]
            outs.append(Completion(text=text, prompt_ids=[1, 2, 3], completion_ids=ids, logprobs=[-0.1] * len(ids)))
        return outs


def noisy_team(beta_salt):
    """The two-agent team on NoisyChat models (beta's noise set by `beta_salt`), seeded like a training step."""
    from m1.models.hub import ModelHub
    from m1.team.cpp import Team

    cfg = training_team_config(TeamConfig.model_validate({**team_dict(), "models": {
        "qa": {"interface": "chat", "path": "fake/a"}, "qb": {"interface": "chat", "path": "fake/b"},
        "vlm": {"interface": "vision", "path": "fake/v"}}}), 1.0)
    hub = ModelHub(cfg.models)
    chats = {"alpha": NoisyChat(), "beta": NoisyChat(beta_salt)}
    hub.register("qa", chats["alpha"])
    hub.register("qb", chats["beta"])
    hub.register("vlm", FakeVision(reply=lambda req: "the square is white"))
    team = Team(cfg, hub=hub)
    team.reseed(1234)
    return team, chats


def team_reward(episodes):
    """A shared team term, as in the paper's rewards: each agent gets its own answer's correctness plus the share
    of the team that answered right, so under episode credit a teammate's lucky draw raises everyone's reward."""
    out = []
    for e in episodes:
        right = {a.agent: float(a.answer == "A") for a in e.answers}
        out.append({a: right[a] + sum(right.values()) / len(right) for a in AGENTS})
    return out


def credit(video, beta_salt, focus):
    """One step's rollouts, rewards, advantages and samples on the noisy team (focus None: episode credit)."""
    team, chats = noisy_team(beta_salt)
    dag = sample_topology(AGENTS, "complete", 1.0, 0.0, None)
    batch = run_rollouts(team, questions(video, 2), 6, dag, focus=focus)
    batch = score(batch, AGENTS, team_reward)
    rewards = batch.rewards
    credited = AgentCredit().credited(rewards, focus) if focus else rewards
    adv = {a: group_advantages(r) for a, r in credited.items()}
    return batch, adv, build_samples(batch, adv, {a: 1.0 for a in AGENTS}), chats


def test_focus_agent_advantages_ignore_teammates_sampling_noise(video):
    """What agent credit is for: under it, changing only beta's sampling noise leaves alpha's advantages and
    samples exactly as they were; under episode credit the same change moves alpha's advantages."""
    import torch

    _, ep_a, _, _ = credit(video, 0, None)
    _, ep_b, _, _ = credit(video, 1, None)
    assert not torch.equal(ep_a["alpha"], ep_b["alpha"])  # episode credit: beta's draws reach alpha's credit

    focus = ["alpha", "alpha"]
    batch_a, adv_a, samples_a, chats = credit(video, 0, focus)
    batch_b, adv_b, samples_b, _ = credit(video, 1, focus)
    assert torch.equal(adv_a["alpha"], adv_b["alpha"])
    assert adv_a["alpha"].abs().sum() > 0  # alpha's own draws still give it a signal
    assert [(s.completion_ids, s.advantage) for s in samples_a["alpha"]] == [
        (s.completion_ids, s.advantage) for s in samples_b["alpha"]]
    assert samples_a["beta"] == [] and float(adv_a["beta"].abs().sum()) == 0.0  # beta is credited nowhere here
    # the engine ran beta greedily in every call and alpha at the rollout temperature
    assert set(chats["beta"].temps) == {0.0} and set(chats["alpha"].temps) == {1.0}
    answers = [[a.answer for a in e.answers if a.agent == "beta"] for e in batch_a.flat]
    assert answers == [["B"]] * len(batch_a.flat)


def test_engine_groups_calls_by_model_and_episode_temperature(video):
    """Questions focused on different agents share each phase's batch: each model gets one call per effective
    temperature, and an unknown agent in the override is an error."""
    team, chats = noisy_team(0)
    dag = sample_topology(AGENTS, "complete", 1.0, 0.0, None)
    batch = run_rollouts(team, questions(video, 2), 3, dag, focus=["alpha", "beta"])
    for name in AGENTS:
        temps = chats[name].temps
        assert 0.0 in temps and 1.0 in temps  # sampled where it is the focus, greedy elsewhere
    plan_calls = chats["alpha"].temps[:2]
    assert sorted(plan_calls) == [0.0, 1.0]  # the plan phase: one call per temperature, not one per episode
    assert batch.focus == ["alpha", "beta"]
    for g, f in enumerate(batch.focus):
        mate = next(a for a in AGENTS if a != f)
        assert {e.answers[[a.agent for a in e.answers].index(mate)].answer for e in batch.episodes[g]} == {"B"}
    with pytest.raises(ValueError, match="no agents \\['gamma'\\]"):
        team.run(questions(video, 1), topologies=[dag], temperatures=[{"gamma": 0.0}])
    from m1.marl.rollout.episodes import RolloutError

    with pytest.raises(RolloutError, match="one agent of"):
        run_rollouts(team, questions(video, 2), 2, dag, focus=["alpha"])


def test_focus_agents_rotate_over_the_runs_questions():
    rule = AgentCredit()
    assert rule.focus(["a", "b", "c"], 0, 4) == ["a", "b", "c", "a"]
    assert rule.focus(["a", "b", "c"], 4, 4) == ["b", "c", "a", "b"]  # step 2 of 4 questions goes on from there
    nan_rows = rule.credited({"a": [[1.0, 2.0], [3.0, 4.0]]}, ["a", "b"])["a"]
    assert nan_rows[0] == [1.0, 2.0] and all(x != x for x in nan_rows[1])


@pytest.fixture(scope="module")
def agent_step(tmp_path_factory, video, m1_cache):
    """One training step with credit agent on the tiny models, with its rollouts and samples captured."""
    import m1.marl.algo.credit as credit_mod
    import m1.marl.trainer as trainer_mod

    seen = {}
    real_run, real_build = trainer_mod.run_rollouts, credit_mod.build_samples
    mp = pytest.MonkeyPatch()
    mp.setattr(trainer_mod, "run_rollouts", lambda *a, **kw: seen.setdefault("batch", real_run(*a, **kw)))
    mp.setattr(credit_mod, "build_samples",
               lambda *a, **kw: seen.setdefault("samples", (a[1], real_build(*a, **kw)))[1])
    try:
        cfg = train_cfg(tmp_path_factory.mktemp("agent"), rollout={"credit": "agent", "num_generations": 3})
        row = make_trainer(cfg, video).train_step()
    finally:
        mp.undo()
    return seen["batch"], seen["samples"][0], seen["samples"][1], row


@pytest.mark.slow
def test_teammates_are_greedy_within_a_focus_group(agent_step):
    """Within a focus group the teammate's generations repeat whenever its prompt does (greedy decoding); its plan,
    which sees only the question, is the same in all K episodes, while the focus agent's plans differ."""
    batch, _, _, _ = agent_step
    assert batch.focus == ["alpha", "beta"]
    for g, focus in enumerate(batch.focus):
        mate = next(a for a in AGENTS if a != focus)
        plans = {a: [tuple(gen.completion_ids) for e in batch.episodes[g] for gen in e.generations
                     if gen.agent == a and gen.phase == "plan"] for a in AGENTS}
        assert len(plans[mate]) == 3 and len(set(plans[mate])) == 1
        assert len(set(plans[focus])) == 3
        by_prompt = {}
        for e in batch.episodes[g]:
            for gen in e.generations:
                if gen.agent == mate:
                    by_prompt.setdefault(tuple(gen.prompt_ids), set()).add(tuple(gen.completion_ids))
        assert by_prompt and all(len(c) == 1 for c in by_prompt.values())


@pytest.mark.slow
def test_agent_credit_samples_belong_to_focus_agents_with_their_group(agent_step):
    """Samples exist only for each question's focus agent, carry that question's group id and its advantage; the
    agent gets no advantage in questions it was not the focus of."""
    batch, adv, samples, row = agent_step
    for g, focus in enumerate(batch.focus):
        mine = [s for s in samples[focus] if s.group == g]
        gens = [(k, gen) for k, e in enumerate(batch.episodes[g]) for gen in e.generations
                if gen.agent == focus and gen.completion_ids]
        assert len(mine) == len(gens) > 0
        for s, (k, gen) in zip(mine, gens):
            assert (s.rollout, s.question_id, s.completion_ids) == (k, batch.questions[g].id, gen.completion_ids)
            assert s.advantage == pytest.approx(float(adv[focus][g, k]))
    for a in AGENTS:
        assert {s.group for s in samples[a]} == {batch.focus.index(a)}
        others = [g for g, f in enumerate(batch.focus) if f != a]
        assert float(adv[a][others].abs().sum()) == 0.0
        assert row[f"{a}/samples"] == len(samples[a])
    assert any(s.advantage != 0 for a in AGENTS for s in samples[a])


def test_agent_credit_config_combinations():
    assert train_cfg("unused").rollout.credit == "episode"  # the default is unchanged
    cfg = train_cfg("unused", rollout={"credit": "agent"}, grpo={"baseline": "greedy", "scale_rewards": False})
    assert (cfg.rollout.credit, cfg.grpo.baseline) == ("agent", "greedy")  # its baseline: the all-greedy run


@pytest.mark.slow
def test_agent_credit_training_moves_every_agent_and_resumes_exactly(tmp_path, video, m1_cache):
    """Two steps with credit agent move every parameter of both agents (each is the focus of one question per
    step); a run killed after step 1 and resumed repeats the uninterrupted run's metrics exactly."""
    import torch

    kw = dict(steps=2, rollout={"credit": "agent"})
    tr = make_trainer(train_cfg(tmp_path / "a", **kw), video)
    before = {a: tr.learners.parameters(a) for a in AGENTS}
    full = tr.train()
    for a in AGENTS:
        after = tr.learners.parameters(a)
        unchanged = [n for n in after if torch.equal(after[n], before[a][n])]
        assert not unchanged, f"{a}: parameters that did not move: {unchanged}"
        assert all(r[f"{a}/samples"] > 0 for r in full)
    killed = make_trainer(train_cfg(tmp_path / "b", **kw), video)
    first = killed.train(stop_after=1)
    del killed
    resumed = make_trainer(train_cfg(tmp_path / "b", **kw), video)
    assert resumed.step == 1
    second = resumed.train()
    for want, got in zip(full, first + second):
        for key in COMPARED:
            assert got[key] == want[key], f"step {want['step']} {key}: {got[key]!r} != {want[key]!r}"


def test_samples_carry_the_temperature_of_their_phase(video):
    """With a per-phase rollout temperature each sample is scored at the temperature its phase was sampled at; the
    others at their agent's. training_team_config puts the run's phase temperatures over the team's."""
    batch, adv, _, _ = credit(video, 0, None)
    samples = build_samples(batch, adv, {a: 1.0 for a in AGENTS}, phase_temperature={"communicate": 1.5})
    by_phase = {(s.phase, s.temperature) for rows in samples.values() for s in rows}
    assert ("communicate", 1.5) in by_phase and ("plan", 1.0) in by_phase
    assert all(t == (1.5 if ph == "communicate" else 1.0) for ph, t in by_phase)
    team, _ = noisy_team(0)
    both = training_team_config(team.cfg.model_copy(update={"sampling": team.cfg.sampling.model_copy(
        update={"phase_temperature": {"plan": 0.9, "communicate": 1.2}})}), 1.0, {"communicate": 1.5})
    assert both.sampling.phase_temperature == {"plan": 0.9, "communicate": 1.5} and both.sampling.temperature == 1.0
