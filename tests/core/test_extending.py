"""Extending M1 without editing it (issue #67's "done when"): tests/fixtures/extension.py registers a select tool,
a team kind and a credit rule from outside m1/; `m1 infer` then runs a team of the new kind whose plans use the
new tool, and a training step credits with the new rule. The registries are restored afterwards."""
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
    from m1.team.kinds import make_team
    from m1.config import TeamConfig

    folder, questions, _ = make_synth_world(tmp_path / "world", videos=1, seed=3, duration=30,
                                           questions_per_video=1)
    team_file = tmp_path / "relay.yaml"
    synth = {"kind": "chat", "backend": "synth"}  # M1-Synth's rule policies: real answers on a synth video
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
    from m1.registry import CPP, WEAVER
    from m1.team.kinds import KindSpec, register_kind

    team = relay_team(extension)
    with pytest.raises(ValueError, match=r"unknown agent kind 'relais' \(known: \[.*'relay'.*\]\)"):
        TeamConfig.model_validate({**team, "agents": [{**a, "kind": "relais"} for a in team["agents"]]})
    with pytest.raises(ValueError, match=r"a team's agents share one kind, got \['relay', 'cpp'\]"):
        TeamConfig.model_validate({**team, "agents": [team["agents"][0], {**team["agents"][1], "kind": CPP}]})
    with pytest.raises(ValueError, match="already registered with another engine"):
        register_kind(KindSpec(extension.RELAY, object))
    with pytest.raises(ValueError, match="is a seed kind"):
        register_kind(KindSpec(WEAVER, extension.RelayTeam))
