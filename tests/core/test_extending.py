"""Extending M1 without editing it: tests/fixtures/extension.py registers a select tool, a team kind and a credit
rule from outside m1/; `m1 infer` then runs a team of the new kind whose plans use the new tool, and a training
step credits with the new rule. The registries are restored afterwards."""
import json

import pytest
import yaml
from typer.testing import CliRunner

from tests.conftest import make_synth_world
from tests.core.test_registry import registries  # noqa: F401 (the fixture)
from tests.marl.test_trainer import AGENTS, make_trainer, team_dict, train_cfg


@pytest.fixture
def extension(registries):  # noqa: F811
    from tests.fixtures import extension

    extension.register()
    return extension


def relay_team(ext, **models) -> dict:
    """The trainer tests' two-agent team, its agents of the relay kind, planning with Middle Sampling only (the one
    select tool enabled, so that every plan, even a fallback one, starts with it)."""
    team = team_dict()
    team["models"] = {**team["models"], **models}
    team["agents"] = [{**a, "kind": ext.RELAY} for a in team["agents"]]
    team["tools"] = {**team["tools"], "enabled": [ext.MIDDLE.name, "Rough Browser"]}
    return team


def test_infer_runs_a_team_of_a_new_kind_with_a_new_tool(extension, tmp_path, m1_cache):
    from m1.cli import app
    from m1.team.engines_registry import make_team
    from m1.config import TeamConfig

    folder, questions, _ = make_synth_world(tmp_path / "world", videos=1, seed=3, duration=30,
                                           questions_per_video=1)
    team_file = tmp_path / "relay.yaml"
    synth = {"interface": "chat", "backend": "synth"}  # M1-Synth's rule policies: real answers on a synth video
    team_file.write_text(yaml.safe_dump({**relay_team(extension, qa=synth, qb=synth), "name": "relay-test"}))
    assert type(make_team(TeamConfig.model_validate(relay_team(extension)))) is extension.RelayTeam

    out, traces = tmp_path / "results.jsonl", tmp_path / "traces"
    res = CliRunner().invoke(app, ["infer", str(folder), "--questions", str(questions), "--team", str(team_file),
                                   "--out", str(out), "--trace-dir", str(traces)])
    assert res.exit_code == 0, res.output
    [row] = [json.loads(line) for line in out.read_text().splitlines()]
    assert row.get("error") is None and row["answer"], row
    [trace] = traces.glob("*.json")
    episode = json.loads(trace.read_text())
    used = {t["tool"] for rec in episode["memory"].values() for t in rec["turns"]}
    assert extension.MIDDLE.name in used, used
    assert extension.CALLS["team"] >= 1 and extension.CALLS["tool"] >= 1


def _installed_plugin(root, name: str, body: str):
    """A package installed the way pip leaves one (its module and a dist-info folder with an entry point in the
    `m1.plugins` group) under `root`, which the test puts on sys.path."""
    (root / name).mkdir(parents=True)
    (root / name / "__init__.py").write_text(body)
    info = root / f"{name}-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(f"[m1.plugins]\nrelay = {name}\n")


def test_an_installed_plugin_is_usable_from_the_command_line(registries, tmp_path, monkeypatch, m1_cache):  # noqa: F811
    """A package with an `m1.plugins` entry point is imported by every command before it runs: a team of the kind and
    tool it registers runs through `m1 infer` with nothing imported by hand. A plugin that fails to import is one
    error line naming it and its package."""
    import importlib

    from m1.cli import app
    from m1.team.engines_registry import TEAM_KINDS
    from tests.fixtures import extension

    site = tmp_path / "site"
    _installed_plugin(site, "m1_relay_plugin", "from tests.fixtures.extension import register\n\nregister()\n")
    monkeypatch.syspath_prepend(str(site))
    importlib.invalidate_caches()
    folder, questions, _ = make_synth_world(tmp_path / "world", videos=1, seed=3, duration=30,
                                           questions_per_video=1)
    synth = {"interface": "chat", "backend": "synth"}
    team_file = tmp_path / "relay.yaml"
    team_file.write_text(yaml.safe_dump({**relay_team(extension, qa=synth, qb=synth), "name": "relay-plugin"}))
    assert extension.RELAY not in TEAM_KINDS  # nothing registered it in this process: the plugin will
    out = tmp_path / "results.jsonl"
    res = CliRunner().invoke(app, ["infer", str(folder), "--questions", str(questions), "--team", str(team_file),
                                   "--out", str(out)])
    assert res.exit_code == 0, res.output
    [row] = [json.loads(line) for line in out.read_text().splitlines()]
    assert row.get("error") is None and row["answer"], row
    assert extension.CALLS["team"] >= 1 and extension.CALLS["tool"] >= 1
    broken = tmp_path / "broken"
    _installed_plugin(broken, "m1_broken_plugin", "raise ImportError('needs a library that is missing')\n")
    monkeypatch.syspath_prepend(str(broken))
    importlib.invalidate_caches()
    res = CliRunner().invoke(app, ["version"])
    assert res.exit_code == 2 and "Traceback" not in res.output
    assert "error: plugin 'relay' (m1_broken_plugin, from m1_broken_plugin) does not load: ImportError: needs a " \
           "library that is missing" in res.output, res.output


@pytest.mark.slow
def test_a_training_step_credits_with_a_new_rule(extension, tmp_path, video, m1_cache):
    # four rollouts per question: with two, the tiny policies' rewards on this team tie and no advantage is left
    cfg = train_cfg(tmp_path / "run", team=relay_team(extension), rollout={"credit": "last_word", "num_generations": 4})
    tr = make_trainer(cfg, video)
    before = {a: tr.learners.parameters(a) for a in AGENTS}
    rows = tr.train()
    assert [r["step"] for r in rows] == [1]
    assert extension.CALLS["credit"] >= 1 and extension.CALLS["team"] >= 1 and extension.CALLS["tool"] >= 1
    after = {a: tr.learners.parameters(a) for a in AGENTS}
    moved = {a: sum(not (after[a][n] == before[a][n]).all() for n in after[a]) for a in AGENTS}
    assert moved[AGENTS[-1]] > 0 and rows[0][f"{AGENTS[-1]}/adv_abs_mean"] > 0, moved  # the credited agent learned
    assert rows[0][f"{AGENTS[0]}/adv_abs_mean"] == 0  # its teammate had no advantage (weight decay still moves it)


def test_agent_kinds_are_checked_against_the_registry(extension):
    from m1.config import TeamConfig
    from m1.kinds.weaver import WEAVER
    from m1.registry import CPP
    from m1.team.engines_registry import KindSpec, register_kind

    team = relay_team(extension)
    with pytest.raises(ValueError, match=r"unknown agent kind 'relais' \(known: \[.*'relay'.*\]\)"):
        TeamConfig.model_validate({**team, "agents": [{**a, "kind": "relais"} for a in team["agents"]]})
    with pytest.raises(ValueError, match=r"a team's agents share one kind, got \['relay', 'cpp'\]"):
        TeamConfig.model_validate({**team, "agents": [team["agents"][0], {**team["agents"][1], "kind": CPP}]})
    with pytest.raises(ValueError, match="team kind 'relay' is already registered with other settings"):
        register_kind(KindSpec(extension.RELAY, object))
    with pytest.raises(ValueError, match="is a seed kind"):
        register_kind(KindSpec(WEAVER, extension.RelayTeam))


# ------------------------------------------------------------------------------------------------ a fifth seed kind
@pytest.fixture
def skimmer(registries):  # noqa: F811
    from tests.fixtures import seed_kind

    seed_kind.register()
    return seed_kind


def skim_team(ext, **over) -> dict:
    synth = {"interface": "chat", "backend": "synth"}  # M1-Synth's backend: it runs the kind's own rule policy
    return {"name": "skim-test", "models": {"policy": synth, "vision": {"interface": "vision", "backend": "synth"}},
            "agents": [{"name": "skim", "model": "policy", "kind": ext.SKIMMER}], "tools": {"browser": "vision"},
            **over}


def test_infer_runs_a_fifth_seed_kind_registered_as_one_spec(skimmer, tmp_path):
    """tests/fixtures/seed_kind.py is the whole kind: `m1 infer` runs its glance, its rule policy's trim (Weaver's
    tool, reused) and its answer in its own syntax, and the trace and results line hold them."""
    from m1.cli import app
    from m1.synth.corpus import seed_kind_loops

    loops = seed_kind_loops()
    folder, questions, _ = make_synth_world(tmp_path / "world", videos=1, seed=3, duration=30,
                                            questions_per_video=1)
    team_file = tmp_path / "skim.yaml"
    team_file.write_text(yaml.safe_dump(skim_team(skimmer)))
    out, traces = tmp_path / "results.jsonl", tmp_path / "traces"
    res = CliRunner().invoke(app, ["infer", str(folder), "--questions", str(questions), "--team", str(team_file),
                                   "--out", str(out), "--trace-dir", str(traces)])
    assert res.exit_code == 0, res.output
    [row] = [json.loads(line) for line in out.read_text().splitlines()]
    assert row.get("error") is None and row["aggregation"] == f"single ({skimmer.SKIMMER})", row
    [trace] = traces.glob("*.json")
    episode = json.loads(trace.read_text())
    first, last = (g["completion"] for g in (episode["generations"][0], episode["generations"][-1]))
    assert first == 'I look at the first half closely.<call>{"start": 0.0, "end": 15.0}</call>'
    assert last.endswith(f"<final>{row['answer']}</final>") and row["answer"], last
    [turn] = episode["memory"]["skim"]["turns"]
    assert turn["tool"] == skimmer.TRIM and turn["span"] == [0.0, 15.0] and turn["error"] is None
    assert len(turn["timestamps"]) == 15 and row["frames_used"] > skimmer.SPEC.glance_frames  # 1 fps over 15 s
    assert all(g["parse_ok"] for g in episode["generations"])
    assert skimmer.CALLS["rules"] == 2 and skimmer.CALLS["parse"] == 2 and skimmer.CALLS["tool"] == 1
    assert seed_kind_loops() == loops  # no corpus_loop: the tokenizer corpus is left as it was


def test_a_fifth_seed_kind_is_checked_rewarded_and_trained_as_its_spec_says(skimmer):
    from m1.config import TeamConfig
    from m1.marl.reward.rewards import RewardConfig, seed_reward
    from m1.marl.team_training import SEED_PHASES, team_kind
    from m1.schema import AgentRecord, Episode, Question, Topology
    from m1.team.engines_registry import kind_of, make_team
    from m1.team.single import SingleAgentTeam

    cfg = TeamConfig.model_validate(skim_team(skimmer))
    assert type(make_team(cfg)) is SingleAgentTeam and kind_of(cfg).name == skimmer.SKIMMER
    assert (team_kind(cfg).name, team_kind(cfg).phases) == (skimmer.SKIMMER, SEED_PHASES)
    assert RewardConfig(kind=skimmer.SKIMMER).kind == skimmer.SKIMMER
    with pytest.raises(ValueError, match=f"'video_zoom' is not a {skimmer.SKIMMER} tool"):
        TeamConfig.model_validate(skim_team(skimmer, seed_system={"tools": ["video_zoom"]}))
    q = Question(id="q", video="v.mp4", text="What colour?", options=["red", "blue"], answer="B")
    ep = Episode(id="q", question=q, topology=Topology(agents=["skim"], active=["skim"], edges=[]),
                 memory={"skim": AgentRecord(answer="B")}, final_answer="B", aggregation="single")
    r = seed_reward(ep, skimmer.SKIMMER)
    assert (r.correct, r.step, r.total) == (1.0, 0.25, 1.25) and skimmer.CALLS["reward"] == 1
