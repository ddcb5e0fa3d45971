"""The seed systems as agent kinds (Weaver, VideoZoomer, SAGE): configs, parsers (strict, lenient, fuzzed), tools,
and whole runs on a generated M1-Synth world with the rule-based policies (answers checked against the truth) and
with tiny random models (format failures allowed, no crash)."""
from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
import pytest

from tests.conftest import make_synth_world

from m1.config import TeamConfig, load_team
from m1.config_files import ConfigError
from m1.kinds.parsers import SeedReply, loads_lenient
from m1.kinds.sage import parse_sage
from m1.kinds.settings import settings_for
from m1.kinds.weaver import parse_weaver
from m1.kinds.zoomer import parse_zoomer
from m1.registry import seed_kind
from m1.schema import Episode, Question

MCQ = Question(id="q1", video="v.mp4", text="What colour is the car?", options=["red", "blue", "green", "grey"])
OPEN = Question(id="q2", video="v.mp4", text="What does the boy drop?", task="open")
GROUND = Question(id="q3", video="v.mp4", text="When does the man sit down?", task="grounding")
NUMERIC = Question(id="q4", video="v.mp4", text="How many balls bounce?", task="numeric")
WEAVER = list(seed_kind("weaver").tools)
SAGE = list(seed_kind("sage").tools)
NO_CLIP = ["models.clip.clip_name=null", "models.clip.tiny={arch: open_clip}"]  # the world's CLIP takes minutes


# ----------------------------------------------------------------------------- configs
def _team(**over) -> dict:
    base = {"name": "t", "models": {"p": {"interface": "chat", "backend": "synth"}},
            "agents": [{"name": "a", "model": "p", "kind": "zoomer"}]}
    base.update(over)
    return base


def test_kind_defaults_and_settings_merge():
    cfg = TeamConfig.model_validate(_team(seed_system={"glance_frames": 8}))
    s = settings_for("zoomer", cfg.seed_system)
    assert (s.glance_frames, s.max_turns, s.zoom_frames, s.tools) == (8, 5, 16, ("video_zoom",))
    w = settings_for("weaver", None)
    assert (w.glance_frames, w.max_turns, w.tool_fps) == (128, 10, 1.0) and len(w.tools) == 6
    assert settings_for("sage", None).max_turns == 11


@pytest.mark.parametrize("over, message", [
    ({"agents": [{"name": "a", "model": "p", "kind": "weaver"}, {"name": "b", "model": "p"}]},
     "agents.0.kind: a 'weaver' agent runs alone"),
    ({"agents": [{"name": "a", "model": "p", "kind": "sage"}], "seed_system": {"tools": ["web-search"]}},
     "needs audio or the web"),
    ({"agents": [{"name": "a", "model": "p", "kind": "zoomer"}], "seed_system": {"tools": ["trim"]}},
     "'trim' is not a zoomer tool"),
    ({"agents": [{"name": "a", "model": "p"}], "seed_system": {"max_turns": 3}}, "seed_system: applies to agents"),
    ({"agents": [{"name": "a", "model": "p", "kind": "magic"}]}, "agents.0.kind"),
    ({"models": {"p": {"interface": "clip", "backend": "open_clip", "clip_name": "x"}}}, "needs a chat or vision model"),
])
def test_bad_kind_configs_name_the_field(tmp_path, over, message):
    import yaml

    path = tmp_path / "team.yaml"
    path.write_text(yaml.safe_dump(_team(**over)))
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace("'", ".")):
        load_team(str(path))


def test_cpp_configs_dump_as_before():
    """`kind: cpp` and an unset seed_system stay out of what a team's record holds (its defaults): results files of
    CPP teams recorded without these fields still resume."""
    dumped = load_team("synth_teacher").recorded()
    assert "seed_system" not in dumped and all("kind" not in a for a in dumped["agents"])
    assert load_team("weaver_synth").recorded()["agents"][0]["kind"] == "weaver"


def test_every_shipped_seed_config_loads():
    for name in ("weaver", "zoomer", "sage", "weaver_synth", "zoomer_synth", "sage_synth", "no_tools_synth"):
        cfg = load_team(name)
        assert len(cfg.agents) == 1 and cfg.agents[0].kind in ("weaver", "zoomer", "sage")
    assert load_team("weaver").models["policy"].path == "Qwen/Qwen2.5-VL-7B-Instruct"
    assert load_team("no_tools_synth").seed_system.tools == []


def test_cpp_engine_refuses_a_seed_kind_and_make_team_dispatches():
    from m1.team.cpp import Team
    from m1.team.engines_registry import make_team
    from m1.team.single import SingleAgentTeam

    cfg = load_team("zoomer_synth")
    with pytest.raises(ValueError, match="make_team"):
        Team(cfg)
    assert isinstance(make_team(cfg), SingleAgentTeam)
    assert isinstance(make_team(load_team("synth_teacher", NO_CLIP)), Team)


def test_one_registry_names_each_kind_its_engine_and_trainer_kind():
    """m1/team/engines_registry.py TEAM_KINDS: make_team's engine and team_kind's trainer kind both follow a
    team's kind."""
    from m1.marl.team_training import CPP_PHASES, SEED_PHASES, team_kind
    from m1.team.cpp import Team
    from m1.team.engines_registry import TEAM_KINDS, kind_of
    from m1.team.single import SingleAgentTeam

    assert {k: s.engine for k, s in TEAM_KINDS.items()} == {"cpp": Team, "weaver": SingleAgentTeam,
                                                            "zoomer": SingleAgentTeam, "sage": SingleAgentTeam}
    for config, name, phases, per_phase in (("synth_teacher", "cpp", CPP_PHASES, True),
                                            ("zoomer_synth", "zoomer", SEED_PHASES, False),
                                            ("weaver_synth", "weaver", SEED_PHASES, False)):
        cfg = load_team(config)
        kind = team_kind(cfg)
        assert (kind_of(cfg).name, kind.name, kind.phases, kind.per_phase_rewards) == (name, name, phases, per_phase)


# ----------------------------------------------------------------------------- parsers
def test_weaver_strict_tool_call_and_answer():
    r = parse_weaver('Step 1: ground it.\n<tool_call>{"tool_name": "temporal_grounding", "query": "the man sits"}'
                     '</tool_call>', MCQ, WEAVER)
    assert r.ok and r.calls[0].name == "temporal_grounding" and r.calls[0].args == {"query": "the man sits"}
    r = parse_weaver("It is blue.\n<answer>B</answer>", MCQ, WEAVER)
    assert r.ok and r.answer == "B" and not r.calls
    r = parse_weaver('<tool_call>{"tool_name": "trim", "start": 3, "end": 9.5}</tool_call>', MCQ, WEAVER)
    assert r.ok and r.calls[0].args == {"start": 3.0, "end": 9.5}


@pytest.mark.parametrize("text, name, args", [
    ("<TOOL_CALL> {'tool_name': 'temporal_grounding', 'query': 'x',} </tool_call>", "temporal_grounding",
     {"query": "x"}),
    ('<tool_call>```json\n{"name": "Temporal Count", "query": "jumps"}\n```</tool_call>', "temporal_count",
     {"query": "jumps"}),
    ('<tool_call>{"tool_name": "spatial_grounding", "objects": "cup, knife"}', "spatial_grounding",
     {"objects": ["cup", "knife"]}),
    ('<tool_call>{"tool_name": "trim", "start": "2", "end": "8"}</tool_call><answer>A</answer>', "trim",
     {"start": 2.0, "end": 8.0}),
])
def test_weaver_lenient_calls(text, name, args):
    r = parse_weaver(text, MCQ, WEAVER)
    assert not r.ok and r.lenient and r.error
    assert r.calls[0].name == name and r.calls[0].args == args


@pytest.mark.parametrize("text, q, answer", [
    ("<answer>\\boxed{B}</answer>", MCQ, "B"),
    ("<answer>(c) green", MCQ, "C"),
    ("The final answer is: 4.", NUMERIC, "4"),
    ("<answer>from 12 to 30 s</answer>", GROUND, "[12 - 30]"),
    ("<answer>a red ball</answer>", OPEN, "a red ball"),
])
def test_weaver_answers_normalised_to_the_task(text, q, answer):
    r = parse_weaver(text, q, WEAVER)
    assert r.answer == answer and not r.calls


def test_weaver_failures_are_format_failures():
    for text in ("", "I am not sure.", '<tool_call>{"tool_name": "fly", "query": "x"}</tool_call>',
                 '<tool_call>{"tool_name": "trim", "start": "soon"}</tool_call>', "<tool_call>{{{</tool_call>",
                 '<tool_call>{"tool_name": "temporal_grounding"}</tool_call>'):
        r = parse_weaver(text, MCQ, WEAVER)
        assert not r.ok and not r.calls and r.answer is None and r.error
    r = parse_weaver('<tool_call>{"tool_name": "trim"}</tool_call>', MCQ, ["temporal_grounding"])
    assert not r.calls and "unknown tool" in r.error  # not offered in this run


def test_zoomer_strict_and_lenient():
    r = parse_zoomer('<think>look closer</think><video_zoom>{"segment": [4.0, 6.0], "fps": 2}</video_zoom>', MCQ)
    assert r.ok and r.calls[0].args == {"segment": [4.0, 6.0], "fps": 2.0} and r.reason == "look closer"
    r = parse_zoomer("<think>it is green</think><answer>C</answer>", MCQ)
    assert r.ok and r.answer == "C"
    r = parse_zoomer('<video_zoom>{"segment": "10-20", "fps": "1"}</video_zoom>', MCQ)  # no think, string values
    assert not r.ok and r.lenient and r.calls[0].args == {"segment": [10.0, 20.0], "fps": 1.0}
    r = parse_zoomer("<think>x</think><answer> \\boxed{A. The red} </answer>", MCQ)
    assert not r.ok and r.answer == "A"
    for bad in ('<think>x</think><video_zoom>{"segment": [1], "fps": 2}</video_zoom>', "<think>hmm</think>", ""):
        r = parse_zoomer(bad, MCQ)
        assert not r.ok and not r.calls and r.answer is None


def test_sage_stage_one_and_two():
    first = ('<json>{"video_context": "a kitchen", "query_intent": "colour", "final_answer": "B", '
             '"recommended_tools": {"needed": false, "why_no_tool": "seen", "tool_calls": []}}</json>')
    r = parse_sage(first, MCQ, SAGE)
    assert r.ok and r.answer == "B" and not r.calls and r.reason == "a kitchen"
    call = ('<json>{"answerable": {"verdict": false, "reasoning": "not seen"}, "final_answer": null, '
            '"recommended_tools": {"needed": true, "tool_calls": [{"rationale": "find it", "name": "ground-event", '
            '"arguments": {"event": "the car parks"}}, {"rationale": "look", "name": "Extract Video Parts", '
            '"arguments": {"start": "00:00:10", "end": "00:00:20"}}]}}</json>')
    r = parse_sage(call, MCQ, SAGE)
    assert [c.name for c in r.calls] == ["ground-event", "extract-video-parts"] and r.answer is None
    assert not r.ok and "read as" in r.error  # the fuzzy name is a correction
    r = parse_sage('```json\n{"final_answer": "[3 - 9]", "answerable": {"verdict": true}}\n```', GROUND, SAGE)
    assert r.answer == "[3 - 9]" and not r.ok and r.lenient
    r = parse_sage('<json>{"final_answer": null, "recommended_tools": {"needed": true, "tool_calls": '
                   '[{"name": "web-search", "arguments": {"query": "x"}}]}}</json>', MCQ, SAGE)
    assert not r.calls and "unknown tool" in r.error


def test_loads_lenient_repairs_and_never_raises():
    assert loads_lenient('{"a": 1}') == ({"a": 1}, True, None)
    assert loads_lenient("{'a': true, 'b': [1, 2,],}")[0] == {"a": True, "b": [1, 2]}
    assert loads_lenient('{"a": {"b": 1}')[0] == {"a": {"b": 1}}
    assert loads_lenient("[" * 5000)[0] is None


_TOKENS = ["<tool_call>", "</tool_call>", "<answer>", "</answer>", "<think>", "</think>", "<video_zoom>",
           "</video_zoom>", "<json>", "</json>", "{", "}", "[", "]", '"', "'", ":", ",", "tool_name", "query",
           "segment", "fps", "final_answer", "recommended_tools", "tool_calls", "needed", "true", "null", "name",
           "arguments", "trim", "temporal_grounding", "ground-event", "B", "12", "3.5", "-", "\\boxed{", "\n", " ",
           "\x00", "é", "🙂", "\u202e", "1e999", "NaN", "[[[[", "```"]
_VALID = [
    '<tool_call>{"tool_name": "temporal_grounding", "query": "the red square"}</tool_call>',
    '<tool_call>{"tool_name": "spatial_tracking", "objects": ["a", "b"]}</tool_call>',
    '<think>zoom</think><video_zoom>{"segment": [4.0, 6.0], "fps": 2}</video_zoom>',
    "<think>ok</think><answer>B</answer>",
    '<json>{"answerable": {"verdict": false, "reasoning": "r"}, "final_answer": null, "recommended_tools": '
    '{"needed": true, "tool_calls": [{"rationale": "x", "name": "analyze", "arguments": {"query": "q"}}]}}</json>',
    '<json>{"final_answer": "[1 - 2]", "recommended_tools": {"needed": false}}</json>',
]


def test_fuzz_parsers_never_raise():
    rng = random.Random(0)
    inputs = []
    for _ in range(400):
        inputs.append("".join(chr(rng.randint(0, 0x2FFF)) for _ in range(rng.randint(0, 60))))
    for _ in range(1200):
        inputs.append("".join(rng.choice(_TOKENS) for _ in range(rng.randint(0, 30))))
    for v in _VALID:
        inputs += [v[:k] for k in range(len(v) + 1)]
    inputs += [None, b"<answer>B</answer>", "<answer>" + "9" * 5000 + "</answer>", "{" * 3000]
    for text in inputs:
        for q in (MCQ, OPEN, GROUND, NUMERIC):
            for r in (parse_weaver(text, q, WEAVER), parse_zoomer(text, q), parse_sage(text, q, SAGE)):
                assert isinstance(r, SeedReply)
                assert r.answer is None or isinstance(r.answer, str)
                assert r.ok == (r.error is None)
                assert "internal parser error" not in (r.error or ""), (text, r.error)
                for c in r.calls:
                    assert isinstance(c.name, str) and isinstance(c.args, dict)
                if q is MCQ and r.answer is not None:
                    assert r.answer in "ABCD"


# ----------------------------------------------------------------------------- tools
@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """A tiny M1-Synth world: 3 videos of 60 s, 10 questions each."""
    return make_synth_world(tmp_path_factory.mktemp("world"), 3, 7, 60, 10)


def _tools(kind: str, **section):
    from m1.config import SeedSystemConfig, ToolsConfig
    from m1.kinds.tools import SeedTools

    return SeedTools(settings_for(kind, SeedSystemConfig(**section)), ToolsConfig(browser="vision"), lambda: None)


def _ctx(world):
    from m1.kinds.tools import Context
    from m1.video import VideoPool

    video = VideoPool().open(world[2][0].video)
    return Context(question=world[2][0], video=video, span=(0.0, video.info.duration))


def test_zoom_budget_and_bad_segments_are_error_observations(world):
    tools, ctx = _tools("zoomer"), _ctx(world)
    ok = tools.prepare(ctx, "video_zoom", {"segment": [10.0, 18.0], "fps": 2}).finish([])
    assert ok.error is None and len(ok.indices) == 16 and ctx.span == (10.0, 18.0)
    times = ctx.video.timestamps(ok.indices)
    assert times[0] == 10.0 and abs(times[1] - times[0] - 0.5) < 1e-6
    over = tools.prepare(ctx, "video_zoom", {"segment": [0.0, 20.0], "fps": 2}).finish([])
    assert over.indices == [] and "asks for 40 frames; the budget is 16" in over.error
    for args in ({"segment": [30.0, 20.0], "fps": 1}, {"segment": [99.0, 100.0], "fps": 1},
                 {"segment": [1.0, 2.0], "fps": 0}):
        assert tools.prepare(ctx, "video_zoom", args).finish([]).error
    assert "not an available tool" in tools.prepare(ctx, "trim", {}).finish([]).error


def test_weaver_trim_is_one_fps_and_sets_the_context(world):
    tools, ctx = _tools("weaver"), _ctx(world)
    obs = tools.prepare(ctx, "trim", {"start": 5.0, "end": 15.0}).finish([])
    assert ctx.video.timestamps(obs.indices) == [float(t) for t in range(5, 15)] and ctx.span == (5.0, 15.0)
    whole = tools.prepare(ctx, "trim", {}).finish([])  # defaults: the whole video, capped at max_tool_frames
    assert len(whole.indices) == 60 and ctx.span == (0.0, 60.0)
    assert "before start" in tools.prepare(ctx, "trim", {"start": 9.0, "end": 2.0}).finish([]).error
    no_clip = tools.prepare(ctx, "frame_selection", {"query": "x"}).finish([])
    assert "needs a CLIP model" in no_clip.error


def test_weaver_temporal_grounding_and_count_read_the_pixels(world):
    """On the synth vision model: grounding lands on the object's real span; counting finds its clips."""
    from m1.synth.vision import SynthVisionModel

    d, _, qs = world
    q = next(q for q in qs if q.meta["family"] == "grounding")
    tools = _tools("weaver")
    from m1.kinds.tools import Context
    from m1.video import VideoPool

    video = VideoPool().open(q.video)
    ctx = Context(question=q, video=video, span=(0.0, video.info.duration))
    obj = q.meta["evidence"]["objects"][0]
    p = tools.prepare(ctx, "temporal_grounding", {"query": f"the {obj}"})
    obs = p.finish(SynthVisionModel().describe([r for _, r in p.requests], _params()))
    from m1.data.metrics import iou, parse_span

    assert obs.span is not None and iou(obs.span, parse_span(q.answer)) > 0.5
    assert ctx.span == obs.span and obs.tool_frames and len(obs.indices) >= 1
    p = tools.prepare(Context(question=q, video=video, span=(0.0, video.info.duration)), "temporal_count",
                      {"query": f"the {obj}"})
    assert len(p.requests) == 8
    obs = p.finish(SynthVisionModel().describe([r for _, r in p.requests], _params()))
    assert obs.error is None and int(obs.answer) >= 1 and "clips with" in obs.text


def _params():
    from m1.models.base import SamplingParams

    return SamplingParams(max_new_tokens=128)


# ----------------------------------------------------------------------------- whole runs, rule-based policies
def _run(cfg, qs, out, trace_dir=None):
    from m1.run import run_questions

    summary = run_questions(cfg, qs, out, trace_dir=trace_dir, progress=False)
    rows = [json.loads(x) for x in Path(out).read_text().splitlines()]
    return summary, rows


RULE_TEAMS = {"weaver_synth": NO_CLIP, "zoomer_synth": [], "sage_synth": [], "no_tools_synth": []}


@pytest.fixture(scope="module")
def rule_runs(world):
    """Each rule-based kind over the whole world, once: {team name: (config, episodes)}."""
    from m1.team.engines_registry import make_team

    out = {}
    for name, over in RULE_TEAMS.items():
        cfg = load_team(name, over)
        out[name] = (cfg, make_team(cfg).run(world[2]))
    return out


@pytest.mark.parametrize("name", list(RULE_TEAMS))
def test_rule_policies_answer_from_pixels(world, rule_runs, name):
    from m1.data.metrics import score_benchmark
    from m1.results import result_row

    qs = world[2]
    cfg, eps = rule_runs[name]
    rows = [result_row(e) for e in eps]
    assert [r["id"] for r in rows] == [q.id for q in qs] and not any(r["error"] for r in rows)
    accuracy = sum(r["correct"] for r in rows) / len(rows)
    assert accuracy >= 0.75, (name, accuracy)
    metrics = score_benchmark("jsonl", {r["id"]: r["answer"] for r in rows}, qs)  # the unchanged metrics
    assert abs(metrics["accuracy"] - accuracy) < 1e-9
    kind = cfg.agents[0].kind
    glance = settings_for(kind, cfg.seed_system).glance_frames
    for r, e in zip(rows, eps):
        assert r["frames_used"] >= glance and r["aggregation"] == f"single ({kind})"
        assert e.frame_counts["policy"] <= r["frames_used"] <= e.frame_counts["policy"] + e.frame_counts["tools"]
        assert list(r["agents"]) == [cfg.agents[0].name] and r["agents"][cfg.agents[0].name]["parse_ok"]


def test_rule_answers_state_their_evidence_and_the_chain_to_the_chosen_option(world, rule_runs):
    """A rule policy's answer turn says what the frames showed and, for a choice, ends its reasoning with the drills'
    chain: the frames it read quoted, the chosen option's words, its letter (what an SFT student copies its answer
    from)."""
    import re

    for name in ("weaver_synth", "zoomer_synth", "sage_synth"):
        _, eps = rule_runs[name]
        mcq = [e for e in eps if e.question.task == "mcq" and e.error is None]
        assert mcq, name
        stated = 0
        for e in mcq:
            last = e.generations[-1].completion
            letter = e.final_answer
            option = e.question.options[ord(letter) - 65]
            stated += bool(re.search(rf"Read:( \d+ ->)? \d+\.\ds>\[.*\] -> {re.escape(option)} -> {letter}\b", last))
            assert re.search(r"I read \d+ frames|frames show it|could see", last), (name, last)
        assert stated == len(mcq), (name, stated, len(mcq))


def test_each_kind_behaves_as_its_paper_says(world, rule_runs):
    """Weaver calls its tools by cue, VideoZoomer's zooms stay within 16 frames and 4 calls, SAGE answers at once
    when the glance shows the answer, the no-tool baseline sees exactly its 128 frames in one turn."""
    from m1.team.engines_registry import make_team

    qs = world[2]
    for q, e in zip(qs, rule_runs["weaver_synth"][1]):
        tools = [t.tool for t in e.memory["weaver"].turns]
        family = q.meta["family"]
        if family == "timestamp":
            assert tools == ["trim"] and len(e.memory["weaver"].turns[0].timestamps) == 10  # 10 s at 1 fps
        elif family == "counting":
            assert tools == ["temporal_count"]
        elif family == "grounding":
            assert tools == ["temporal_grounding"]
        assert e.frame_counts["policy"] >= 128 and e.generations[-1].phase == "answer"
        assert all(g.phase == "act" for g in e.generations[:-1])
    zoomed = 0
    for e in make_team(load_team("zoomer_synth", ["seed_system.glance_frames=16"])).run(qs):
        turns = e.memory["zoomer"].turns
        assert len(turns) <= 4 and all(t.tool == "video_zoom" and len(t.timestamps) <= 16 for t in turns)
        assert e.frames_used <= 16 + 16 * len(turns)
        zoomed += bool(turns)
    assert zoomed >= len(qs) // 3  # a sparse glance makes it zoom
    sage = rule_runs["sage_synth"][1]
    at_once = [e for e in sage if not e.memory["sage"].turns]
    assert len(at_once) >= len(qs) * 0.7
    assert all(len(e.generations) == 1 and e.frames_used == 128 for e in at_once)
    for e in rule_runs["no_tools_synth"][1]:
        assert len(e.generations) == 1 and e.frame_counts == {"policy": 128, "tools": 0, "turns": 1, "tool_calls": 0}
        back = Episode.model_validate(json.loads(e.model_dump_json()))
        assert back == e


def test_zooming_beats_a_sparse_glance(world):
    """With an 8-frame glance, zooming where the question points is what answers timestamp and order questions."""
    from m1.data.metrics import is_correct
    from m1.team.engines_registry import make_team

    _, _, qs = world
    qs = [q for q in qs if q.meta["family"] in ("timestamp", "order")]
    sparse = ["seed_system.glance_frames=8"]
    zoom = make_team(load_team("zoomer_synth", sparse)).run(qs)
    direct = make_team(load_team("no_tools_synth", sparse)).run(qs)
    right = lambda eps: sum(is_correct(q, e.final_answer) for q, e in zip(qs, eps))  # noqa: E731
    assert right(zoom) > right(direct), (right(zoom), right(direct), len(qs))


def test_a_seed_kind_takes_per_episode_temperatures(world):
    """`run(temperatures=)` as the Team contract has it: an episode's own temperature for the agent wins over the
    agent's, each temperature gets its own policy call per turn; an agent the team lacks, or a list of the wrong
    length, is an error before anything runs."""
    from m1.team.engines_registry import make_team

    team = make_team(load_team("zoomer_synth"))
    key, agent = team.cfg.agents[0].model, team.order[0]
    policy, calls = team.hub.chat(key), []

    class Recording:
        name, accepts_images = policy.name, policy.accepts_images

        def generate(self, requests, params):
            calls.append((params.temperature, len(requests)))
            return policy.generate(requests, params)

    team.hub.register(key, Recording(), interface="chat")
    qs = world[2][:3]
    eps = team.run(qs, temperatures=[{agent: 0.7}, {}, {}])
    assert all(e.error is None for e in eps)
    assert calls[:2] == [(0.7, 1), (0.0, 2)]  # turn 0: the overridden episode alone, then the two at the agent's own
    assert {t for t, _ in calls} == {0.7, 0.0}
    calls.clear()
    with pytest.raises(ValueError, match="no agents \\['ghost'\\]"):
        team.run(qs[:1], temperatures=[{"ghost": 0.0}])
    with pytest.raises(ValueError, match="1 entries for 3 questions"):
        team.run(qs, temperatures=[{}])
    assert calls == []


def test_m1_infer_runs_a_seed_kind_with_traces(world, tmp_path):
    from typer.testing import CliRunner

    from m1.cli import app

    d, path, qs = world
    out, traces = tmp_path / "r.jsonl", tmp_path / "traces"
    res = CliRunner().invoke(app, ["infer", str(d), "--questions", str(path), "--team", "zoomer_synth", "--out",
                                   str(out), "--trace-dir", str(traces), "--limit", "4"])
    assert res.exit_code == 0, res.output
    rows = [json.loads(x) for x in out.read_text().splitlines()]
    assert len(rows) == 4 and all("correct" in r and r["frames_used"] >= 64 for r in rows)
    page = (traces / f"{rows[0]['id']}.html").read_text()
    assert "single (zoomer)" in page
    ep = Episode.model_validate_json((traces / f"{rows[0]['id']}.json").read_text())
    img = [p for p in ep.generations[0].prompt[1]["content"] if p["type"] == "image"]
    assert len(img) == 64 and {"time", "frame"} <= set(img[0])  # frames traced by time and index, not pixels


# ----------------------------------------------------------------------------- tiny random models
def test_tiny_random_policies_run_without_crashing(world, tmp_path, m1_cache):
    """A tiny Qwen2.5-VL policy (frames as images) and a tiny text Qwen3 policy (frames as placeholders): answers
    are noise, format failures are recorded, nothing crashes, every question gets a results line."""
    import yaml

    d, _, qs = world
    team = {"name": "tiny_seed", "models": {
        "vl": {"interface": "vision", "backend": "hf", "device": "cpu",
               "tiny": {"arch": "qwen2_5_vl", "hidden_size": 64, "layers": 2, "seed": 5}},
        "txt": {"interface": "chat", "backend": "hf", "device": "cpu",
                "tiny": {"arch": "qwen3", "hidden_size": 32, "layers": 1, "heads": 2, "kv_heads": 1, "seed": 2}},
        "vision": {"interface": "vision", "backend": "synth"}},
        "agents": [{"name": "p", "model": "vl", "kind": "weaver"}], "tools": {"browser": "vision"},
        "seed_system": {"glance_frames": 4, "max_turns": 2, "reply_tokens": 12}, "limits": {"batch_episodes": 4}}
    for kind, model in (("weaver", "vl"), ("zoomer", "txt"), ("sage", "vl")):
        team["agents"] = [{"name": "p", "model": model, "kind": kind}]
        path = tmp_path / f"{kind}.yaml"
        path.write_text(yaml.safe_dump(team))
        summary, rows = _run(load_team(str(path)), qs[:4], tmp_path / f"{kind}.jsonl")
        assert len(rows) == 4 and not summary.errors, summary.describe()
        for r in rows:
            assert r["error"] is None and r["frames_used"] >= 4 and "correct" in r
    from m1.team.engines_registry import make_team

    cfg = load_team(str(tmp_path / "sage.yaml"))
    t = make_team(cfg)
    eps = t.run(qs[:2])
    gens = [g for e in eps for g in e.generations]
    assert gens and all(g.completion_ids is not None and g.prompt_ids for g in gens)
    assert t.hub.vision("vl").calls >= 1


def test_text_only_models_see_frame_placeholders():
    from m1.models.base import text_only

    msgs = [{"role": "user", "content": [{"type": "text", "text": "<frame 0 at 1.0s>"},
                                         {"type": "image", "time": 1.0, "frame": 4}, {"type": "text", "text": "Q"}]}]
    assert text_only(msgs) == [{"role": "user", "content": "<frame 0 at 1.0s>[frame at 1.0s]Q"}]
    msgs[0]["content"][1]["caption"] = "a small red circle at the top left"
    assert text_only(msgs)[0]["content"] == "<frame 0 at 1.0s>[a small red circle at the top left]Q"


def test_a_captioner_describes_every_frame_a_text_policy_is_shown(world, rule_runs):
    """seed_system.captioner: each image part of every policy prompt carries the synth vision model's description of
    that frame's own pixels, which a text policy reads after the frame's time label (objects, colours, sizes, places; an empty frame says so); answers do not change, and a
    text student reading the teacher's recorded prompt reads exactly those descriptions."""
    from m1.kinds.prompts import CAPTION_PROMPT
    from m1.models.base import SamplingParams, VisionRequest, text_only
    from m1.synth.vision import SynthVisionModel
    from m1.team.engines_registry import make_team
    from m1.video import VideoPool

    cfg = load_team("weaver_synth", RULE_TEAMS["weaver_synth"] + ["seed_system.captioner=vision"])
    qs = world[2][:6]
    eps = make_team(cfg).run(qs)
    plain = {e.id: e.final_answer for e in rule_runs["weaver_synth"][1]}
    assert [e.final_answer for e in eps] == [plain[q.id] for q in qs]  # descriptions are for text policies
    pool, vision, seen = VideoPool(), SynthVisionModel(), 0
    for e in eps:
        video = pool.open(e.question.video)
        for g in e.generations:
            parts = [p for m in g.prompt if isinstance(m["content"], list) for p in m["content"]
                     if p.get("type") == "image"]
            assert parts and all(p.get("caption") for p in parts)
            for p in parts[:3]:
                want = vision.describe([VisionRequest(video.frames([p["frame"]]), [p["time"]], CAPTION_PROMPT)],
                                       SamplingParams(max_new_tokens=48, temperature=0.0))[0].text
                read = "".join(m["content"] for m in text_only(g.prompt))
                assert p["caption"] == want and f"at {p['time']:.1f}s>[{want}]" in read
                seen += want != "only the background"
    assert seen > 0  # some frames show objects ("a large cyan square at the bottom left")
    with pytest.raises(ValueError, match="seed_system.captioner: no model named 'nope'"):
        load_team("weaver_synth", ["seed_system.captioner=nope"])
    with pytest.raises(ValueError, match="seed_system.captioner: model 'policy' is a chat model, vision needed"):
        load_team("weaver_synth", ["seed_system.captioner=policy"])


def test_hf_vision_policy_takes_interleaved_frames(m1_cache):
    from m1.config import ModelSpec
    from m1.models.base import ChatRequest, SamplingParams
    from m1.models.hf import HFVisionModel

    m = HFVisionModel(ModelSpec(interface="vision", device="cpu", tiny={"arch": "qwen2_5_vl", "seed": 5}), "vl")
    frames = [np.full((64, 64, 3), c, np.uint8) for c in (0, 128)]
    msgs = [{"role": "system", "content": "s"}, {"role": "user", "content": [
        {"type": "image", "time": 0.0, "frame": 0}, {"type": "image", "time": 1.0, "frame": 4},
        {"type": "text", "text": "What?"}]}]
    out = m.generate([ChatRequest(msgs, images=frames), ChatRequest(msgs[:1] + [{"role": "user", "content": "hi"}])],
                     SamplingParams(max_new_tokens=4))
    assert len(out) == 2 and all(o.completion_ids for o in out) and out[0].meta == {"images": 2}
    from m1.models.base import ModelError

    with pytest.raises(ModelError, match="2 image parts but 1 images"):
        m.generate([ChatRequest(msgs, images=frames[:1])], SamplingParams(max_new_tokens=2))
