"""The CPP episode engine with scripted models: batching, visibility, errors, JSON."""
import random
import re

import pytest

from tests.fakes import FakeChat, FakeClip, FakeVision, content, scripted_reply
from m1.config import TeamConfig
from m1.models.hub import ModelHub
from m1.schema import Episode, Question, Topology
from m1.team import topology as topo
from m1.team.cpp import Team
from m1.tools import BROWSE_TOOLS, SELECT_TOOLS

AGENTS = ["alpha", "beta", "gamma", "delta"]


def team_cfg(**over):
    data = {
        "name": "fake",
        "models": {
            "m_a": {"interface": "chat", "path": "fake/a"}, "m_b": {"interface": "chat", "path": "fake/b"},
            "vlm": {"interface": "vision", "path": "fake/vlm"},
            "clip": {"interface": "clip", "backend": "open_clip", "clip_name": "fake"},
        },
        "agents": [{"name": "alpha", "model": "m_a"}, {"name": "beta", "model": "m_a"},
                   {"name": "gamma", "model": "m_b"}, {"name": "delta", "model": "m_b"}],
        "tools": {"clip": "clip", "browser": "vlm", "global_frames": 8, "rough_frames": 4},
        "limits": {"max_turns": 3, "max_tool_calls": 4, "batch_episodes": 16},
    }
    for k, v in over.items():
        data[k] = {**data.get(k, {}), **v} if isinstance(v, dict) else v
    return TeamConfig.model_validate(data)


def make_team(cfg=None, reply_a=scripted_reply, reply_b=scripted_reply, vision=None):
    cfg = cfg or team_cfg()
    hub = ModelHub(cfg.models)
    fa, fb, fv = FakeChat("m_a", reply_a), FakeChat("m_b", reply_b), vision or FakeVision()
    for key, model in (("m_a", fa), ("m_b", fb), ("vlm", fv), ("clip", FakeClip())):
        hub.register(key, model)
    return Team(cfg, hub=hub), fa, fb, fv


@pytest.fixture
def videos(video_factory):
    return [str(video_factory(f"v{i}.mp4", seconds=8 + i)) for i in range(3)]


def questions(videos, n):
    return [Question(id=f"q{i}", video=videos[i % len(videos)], text="What colour is the square?",
                     options=["white", "red", "blue", "green"], task="mcq", answer="A") for i in range(n)]


def test_one_generate_call_per_model_per_phase(videos):
    team, fa, fb, fv = make_team()
    n = 5
    eps = team.run(questions(videos, n))
    assert len(eps) == n and all(e.error is None for e in eps)
    # phases run: plan, communicate x2 (after turns 1 and 2), answer -> 4 batched calls per model
    assert fa.calls == fb.calls == 4
    plan_batch = fa.batches[0]
    assert len(plan_batch) == n * 2  # every episode x the two agents on this model
    assert len(fa.batches[-1]) == n * 2  # answer phase
    # browsers: one describe call per turn that had a browse step, for all episodes at once
    assert fv.calls == 1 and len(fv.batches[0]) == n * 4
    for e in eps:
        assert e.final_answer == "A" and e.aggregation == "vote"
        for name in AGENTS:
            rec = e.memory[name]
            assert rec.plan == ["Global Sampling", "Rough Browser"]
            assert [t.tool for t in rec.turns] == ["Global Sampling", "Rough Browser"]
            assert rec.answer == "A"
            assert all(t.decision is not None for t in rec.turns)
        assert e.frames_used == 4  # 4 of the 8 globally sampled frames, shared by all agents
        phases = [g.phase for g in e.generations if g.agent == "alpha"]
        assert phases == ["plan", "communicate", "communicate", "answer"]


def test_communication_prompt_shows_exactly_visible_peers(videos):
    team, *_ = make_team()
    rng = random.Random(3)
    tops = [topo.random_dag(AGENTS, 0.5, 0.25, rng) for _ in range(6)]
    assert any(t.edges for t in tops) and any(len(t.active) < 4 for t in tops)
    eps = team.run(questions(videos, 6), topologies=tops)
    checked = 0
    for e, t in zip(eps, tops):
        for g in e.generations:
            if g.phase != "communicate":
                continue
            names = set(re.findall(r"\[(alpha|beta|gamma|delta)\]", content(g.prompt)))
            assert names == set(t.visible_to(g.agent)) | {g.agent}, (g.agent, t.edges)
            checked += 1
    assert checked >= 24


def test_bad_video_is_an_episode_error(videos, tmp_path):
    bad = tmp_path / "bad.mp4"
    bad.write_text("not a video at all")
    qs = questions(videos, 2) + [Question(id="bad", video=str(bad), text="?", options=["a", "b"], task="mcq")]
    team, *_ = make_team()
    eps = team.run(qs)
    assert [e.error is None for e in eps] == [True, True, False]
    assert "bad.mp4" in eps[2].error and eps[2].final_answer is None


def test_tool_error_goes_to_memory_and_episode_goes_on(videos):
    def reply(messages):
        text = content(messages)
        if "##tool use" in text and "##tool call" not in text and "##Answer" not in text:
            return "##key info: nothing timed\n##tool use: <Time Stamp Retrieval>, <Rough Browser>"
        return scripted_reply(messages)

    team, *_ = make_team(reply_a=reply)
    [e] = team.run(questions(videos, 1))
    assert e.error is None
    t0 = e.memory["alpha"].turns[0]
    assert t0.tool == "Time Stamp Retrieval" and t0.error and "no time" in t0.error
    assert e.memory["alpha"].turns[1].tool == "Rough Browser"  # browsed the fallback global frames
    assert e.final_answer == "A"


def test_garbage_replies_are_format_failures_not_crashes(videos):
    rng = random.Random(0)

    def garbage(messages):
        return "".join(rng.choice("##<>:abc \n\x00é") for _ in range(rng.randint(0, 60)))

    team, *_ = make_team(reply_a=garbage, reply_b=garbage)
    eps = team.run(questions(videos, 3))
    for e in eps:
        assert e.error is None
        assert any(not g.parse_ok for g in e.generations)
        for rec in e.memory.values():
            assert len(rec.plan) >= 2 and rec.turns  # fallback plan executed


def test_add_tool_decision_inserts_the_tool(videos):
    asked = []

    def reply(messages):
        text = content(messages)
        if "##tool call" in text and "##Final Answer" not in text:
            asked.append(text)
            if len(asked) == 1:  # the first communication request of model m_a is alpha's
                return "##tool call: add tool <Fine Browser>\n##key info: look closer at the square"
            return "##tool call: continue()"
        return scripted_reply(messages)

    team, *_ = make_team(reply_a=reply)
    [e] = team.run(questions(videos, 1))
    tools = [t.tool for t in e.memory["alpha"].turns]
    assert tools[:3] == ["Global Sampling", "Fine Browser", "Rough Browser"], tools
    assert e.memory["alpha"].turns[0].decision.action == "add_tool"
    assert e.memory["alpha"].key_info == "look closer at the square"
    assert e.memory["alpha"].turns[1].key_info == "look closer at the square"
    assert [t.tool for t in e.memory["beta"].turns] == ["Global Sampling", "Rough Browser"]
    assert len(e.memory["alpha"].turns[1].timestamps) == 32  # Fine Browser: 32 frames of the focus


def test_vote_tie_asks_the_summarizer(videos):
    def reply_b(messages):
        text = content(messages)
        if "##Final Answer" in text:
            return "##Final Answer: C ##Reason Summary: tie broken"
        if "##Answer" in text and "##tool call" not in text:
            return "##Answer: C ##Reason: I saw C"
        return scripted_reply(messages)

    cfg = team_cfg(aggregation={"summarizer": "gamma"})
    team, fa, fb, _ = make_team(cfg, reply_b=reply_b)
    [e] = team.run(questions(videos, 1))
    assert sorted(a.answer for a in e.answers) == ["A", "A", "C", "C"]
    assert e.final_answer == "C" and e.aggregation == "vote+summary"


def test_episode_json_round_trip(videos):
    team, *_ = make_team()
    [e] = team.run(questions(videos, 1))
    back = Episode.model_validate_json(e.model_dump_json())
    assert back == e
    assert back.generations[0].completion_ids and back.generations[0].logprobs


def test_grounding_uses_summarizer(videos):
    def reply(messages):
        text = content(messages)
        if "##Final Answer" in text:
            return "##Final Answer: [2.0 - 4.0] ##Reason Summary: white square early"
        if "##Answer" in text and "##tool call" not in text:
            return "##Answer: [2 - 5] ##Reason: seen"
        return scripted_reply(messages)

    team, *_ = make_team(reply_a=reply, reply_b=reply)
    q = Question(id="g", video=videos[0], text="When is the square visible?", task="grounding")
    [e] = team.run([q])
    assert e.aggregation == "summarizer" and e.final_answer == "[2 - 4]"


def test_grounding_median_takes_the_median_span_without_a_summary(videos):
    """aggregation.grounding: median: the team's span is the agents' median, and nobody writes a summary."""
    def span(start, end):
        def reply(messages):
            text = content(messages)
            assert "##Final Answer" not in text  # no summary prompt is ever built
            if "##Answer" in text and "##tool call" not in text:
                return f"##Answer: [{start} - {end}] ##Reason: seen"
            return scripted_reply(messages)
        return reply

    team, *_ = make_team(team_cfg(aggregation={"grounding": "median"}), reply_a=span(1, 5), reply_b=span(3, 9))
    q = Question(id="g", video=videos[0], text="When is the square visible?", task="grounding")
    [e] = team.run([q])
    assert e.aggregation == "median" and e.final_answer == "[2 - 7]"
    assert not any(g.phase == "summary" for g in e.generations)


def test_median_is_for_grounding_only():
    with pytest.raises(ValueError, match="aggregation.open: 'median'"):
        team_cfg(aggregation={"open": "median"})


def test_a_phase_temperature_samples_that_phase_alone(videos):
    """sampling.phase_temperature: the communicate calls sample at 1.5 while plans and answers keep the team's 0.7;
    an episode's own temperature still wins; greedy() clears it; only CPP phases, above 0, are accepted."""
    from pydantic import ValidationError

    cfg = team_cfg(sampling={"temperature": 0.7, "phase_temperature": {"communicate": 1.5}})
    team, fa, _, _ = make_team(cfg)
    temps, generate = [], fa.generate

    def recording(requests, params):
        temps.append(params.temperature)
        return generate(requests, params)

    fa.generate = recording
    team.run(questions(videos, 2))
    assert temps == [0.7, 1.5, 1.5, 0.7]  # plan, communicate x2, answer
    temps.clear()
    team.run(questions(videos, 1), temperatures=[{"alpha": 0.0, "beta": 0.0}])
    assert temps == [0.0] * 4
    assert cfg.greedy().sampling.phase_temperature == {}
    with pytest.raises(ValidationError, match="phase 'act' is not one of plan, communicate"):
        team_cfg(sampling={"phase_temperature": {"act": 1.0}})
    with pytest.raises(ValidationError, match="temperature 0.0 must be above 0"):
        team_cfg(sampling={"phase_temperature": {"plan": 0.0}})


PLANS = {"P1": "<Global Sampling>, <Rough Browser>", "P2": "<Image Retrieval>, <Fine Browser>",
         "P3": "<Video Retrieval>, <Rough Browser>"}


def test_distinct_order_samples_the_keys_without_replacement():
    from m1.team.cpp import distinct_order

    assert distinct_order(["a", "a", "b", "a", "c"], 3) == [0, 2, 4]
    assert distinct_order(["a", "a", "b", "a", "c"], 4) == [0, 2, 4, 1]  # too few keys: the earliest left repeat
    assert distinct_order(["a"] * 3, 3) == [0, 1, 2] and distinct_order([None, "a", None], 2) == [0, 1]


def test_distinct_plans_give_a_questions_rollouts_different_plans(videos):
    """sampling.distinct_plans 4: the three rollouts of one question draw four plans each per agent and take them
    in turn, each the next whose tools no earlier rollout took; the draws not taken are no generation of any
    episode; greedy teams and the setting at 0 draw one plan per episode."""
    def drawing(order):
        count = {"n": 0}

        def reply(messages):
            if "##tool use" not in content(messages):
                return scripted_reply(messages)
            count["n"] += 1
            return f"##key info: the square\n##tool use: {PLANS[order(count['n'])]}"
        return reply

    # the six own draws of m_a (3 rollouts x alpha, beta) are P1; the spares then run P1 P2 P1 P3 P1 ...
    order = lambda n: "P1" if n <= 6 or n % 2 else ("P2" if n % 4 == 0 else "P3")  # noqa: E731
    q = questions(videos, 1)[0]
    cfg = team_cfg(sampling={"temperature": 0.7, "distinct_plans": 4})
    team, fa, _, _ = make_team(cfg, reply_a=drawing(order))
    eps = team.run([q] * 3)
    assert len(fa.batches[0]) == 6 + 2 * 3 * 3  # the own draws, then three spares for each of alpha's and beta's
    for name in ("alpha", "beta"):
        plans = [tuple(e.memory[name].plan) for e in eps]
        assert len(set(plans)) == 3, (name, plans)
        assert [sum(g.agent == name and g.phase == "plan" for g in e.generations) for e in eps] == [1, 1, 1]
    for e in eps:  # each episode's plan generation is the draw its plan was read from
        gen = next(g for g in e.generations if g.agent == "alpha" and g.phase == "plan")
        assert list(e.memory["alpha"].plan) == [t.strip("<>") for t in gen.completion.split(": ")[-1].split(", ")]
    same = make_team(team_cfg(sampling={"temperature": 0.7}), reply_a=drawing(order))
    assert {tuple(e.memory["alpha"].plan) for e in same[0].run([q] * 3)} == {("Global Sampling", "Rough Browser")}
    greedy = make_team(cfg.greedy(), reply_a=drawing(order))
    greedy[0].run([q] * 3)
    assert len(greedy[1].batches[0]) == 6 and cfg.greedy().sampling.distinct_plans == 0
    with pytest.raises(Exception, match="distinct_plans: agent 'w' is a seed kind"):
        TeamConfig.model_validate({"name": "s", "models": {"p": {"interface": "chat", "backend": "synth"}},
                                   "agents": [{"name": "w", "model": "p", "kind": "weaver"}],
                                   "sampling": {"distinct_plans": 2}})


def test_plan_fill_uniform_gives_repeats_plans_no_rollout_drew(videos):
    """sampling.plan_fill uniform: when every draw is one plan, the first rollout keeps the policy's draw and the
    others start from other select x browse plans, after the key info the agent wrote, with the tokenizer's ids
    and no sampler log-probs; repeat (the default) repeats the draw; the option needs distinct plans and a model
    with a tokenizer, and greedy teams drop it."""
    one = lambda m: ("##key info: the square\n##tool use: <Global Sampling>, <Rough Browser>"  # noqa: E731
                     if "##tool use" in content(m) else scripted_reply(m))
    q = questions(videos, 1)[0]
    cfg = team_cfg(sampling={"temperature": 0.7, "distinct_plans": 4, "plan_fill": "uniform"})
    team, fa, fb, _ = make_team(cfg, reply_a=one)
    for chat in (fa, fb):
        chat.tokenizer = lambda text, add_special_tokens=False: {"input_ids": [ord(c) % 97 + 1 for c in text]}
        chat.eos_ids = [0]
    eps = team.run([q] * 3)
    for name in ("alpha", "beta"):
        plans = [tuple(e.memory[name].plan) for e in eps]
        assert plans[0] == ("Global Sampling", "Rough Browser") and len(set(plans)) == 3, (name, plans)
        assert all(p[0] in SELECT_TOOLS and p[1] in BROWSE_TOOLS for p in plans)
    for e in eps[1:]:
        gen = next(g for g in e.generations if g.agent == "alpha" and g.phase == "plan")
        assert gen.completion.startswith("##key info: the square\n##tool use: <") and gen.logprobs is None
        assert gen.completion_ids == [ord(c) % 97 + 1 for c in gen.completion] + [0]
    first = next(g for g in eps[0].generations if g.agent == "alpha" and g.phase == "plan")
    assert first.logprobs is not None  # the policy's own draw keeps what the sampler gave
    same = make_team(team_cfg(sampling={"temperature": 0.7, "distinct_plans": 4}), reply_a=one)[0]
    assert {tuple(e.memory["alpha"].plan) for e in same.run([q] * 3)} == {("Global Sampling", "Rough Browser")}
    bare = make_team(cfg, reply_a=one)[0]  # FakeChat has no tokenizer
    with pytest.raises(ValueError, match="plan_fill: uniform: model 'm_a' exposes no tokenizer"):
        bare.run([q] * 3)
    assert cfg.greedy().sampling.plan_fill == "repeat"
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match="plan_fill: 'uniform' fills a group of distinct plans"):
        team_cfg(sampling={"temperature": 0.7, "plan_fill": "uniform"})


def test_plan_fill_shared_gives_every_seat_of_a_filled_episode_one_plan(videos):
    """sampling.plan_fill shared: agents whose own draws agree get the same filled plan in each episode (one
    uniform order per question), where uniform draws each agent's fills on its own."""
    one = lambda m: ("##key info: the square\n##tool use: <Global Sampling>, <Rough Browser>"  # noqa: E731
                     if "##tool use" in content(m) else scripted_reply(m))

    def seats(fill):
        cfg = team_cfg(sampling={"temperature": 0.7, "distinct_plans": 4, "plan_fill": fill})
        team, fa, fb, _ = make_team(cfg, reply_a=one, reply_b=one)
        for chat in (fa, fb):
            chat.tokenizer = lambda text, add_special_tokens=False: {"input_ids": [ord(c) % 97 + 1 for c in text]}
            chat.eos_ids = [0]
        eps = team.run(questions(videos, 1) * 4)
        return [{tuple(e.memory[a].plan) for a in ("alpha", "beta", "gamma", "delta")} for e in eps]

    shared = seats("shared")
    assert all(len(s) == 1 for s in shared) and len(set().union(*shared)) == 4  # one plan a seat, four episodes
    assert any(len(s) > 1 for s in seats("uniform")[1:])
