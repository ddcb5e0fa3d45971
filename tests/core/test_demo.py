"""`m1 demo` on the shipped trained mini team (assets/mini_team via configs/team/mini_trained.yaml)."""
from pathlib import Path

from m1.config import load_team

REPO = Path(__file__).resolve().parents[2]


def test_mini_trained_points_at_shipped_weights():
    cfg = load_team("mini_trained")
    mini = load_team("mini")
    assert [a.name for a in cfg.agents] == [a.name for a in mini.agents]
    for agent in cfg.agents:
        folder = Path(cfg.models[agent.model].path)
        assert folder == (REPO / "assets" / "mini_team" / agent.name).resolve()
        assert (folder / "config.json").is_file() and (folder / "model.safetensors").is_file()
        assert (folder / "tokenizer.json").is_file()


def test_demo_runs_the_trained_team_and_reports_accuracy(tmp_path, m1_cache):
    from m1.cli import DEMO_TEAM
    from m1.demo import run_demo

    assert DEMO_TEAM == "mini_trained"
    lines: list[str] = []
    out = run_demo(tmp_path / "demo", DEMO_TEAM, videos=1, duration=40.0, questions_per_video=4, echo=lines.append)
    text = "\n".join(lines)
    # the shipped team and the world's shipped CLIP answer deterministically: these answers are the demo's own
    assert out == {"correct": 4, "total": 4, "per_family": {"timestamp": [1, 1], "order": [1, 1],
                                                             "attribute": [1, 1], "grounding": [1, 1]}}
    assert "(team mini_trained)" in text and "votes: qwen3_big=" in text
    results = (tmp_path / "demo" / "results.jsonl").read_text().splitlines()
    import json

    assert [json.loads(r)["answer"] for r in results] == ["B", "A", "D", "[21.8 - 26.8]"]
    assert len(results) == 4
    # trained agents answer in the strict format, random weights never do (0% in docs/mini_team.md): the shipped
    # students (SFT from the mini base, then MARL) parse in 16 of 16 replies here
    import json

    ok = [a["parse_ok"] for r in map(json.loads, results) for a in r["agents"].values()]
    assert len(ok) == 16 and sum(ok) / len(ok) > 0.9, ok
    # each agent's first plan and whether it was strict, as the report's plan tables read them
    first = json.loads(results[0])["agents"]["qwen3_big"]
    from m1.agents.parsers import ALL_TOOLS

    assert first["plan"] and set(first["plan"]) <= set(ALL_TOOLS) and isinstance(first["plan_ok"], bool)
