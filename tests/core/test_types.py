"""The interfaces of m1/contracts.py hold: mypy checks the files pyproject.toml's [tool.mypy] lists (the contracts and
the modules that name them), so a team, learner group, rollout engine or team kind that drifts from its Protocol
fails here, under `make test`."""
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_the_contracts_type_check(tmp_path, monkeypatch):
    api = pytest.importorskip("mypy.api", reason="mypy is not installed (pip install -e '.[dev]')")
    monkeypatch.chdir(ROOT)  # [tool.mypy] files are relative to the repository root
    t0 = time.perf_counter()
    out, err, status = api.run(["--config-file", str(ROOT / "pyproject.toml"), "--cache-dir", str(tmp_path / "cache")])
    print(f"mypy: {time.perf_counter() - t0:.1f}s")
    assert status == 0, f"mypy found errors:\n{out}{err}"


class EchoTeam:
    """A Team by its members alone (no m1 base class): answers each question with its option count as a letter."""

    def __init__(self, cfg):
        self.cfg, self.pool = cfg, None
        self.over_budget_rows = self.server_error_rows = False
        self.forgotten: list[str] = []

    def run(self, questions, topologies=None, rng=None, on_episode=None, temperatures=None):
        from m1.schema import AgentRecord, Episode, Topology

        out = []
        for q in questions:
            answer = "ABCD"[len(q.options) - 1]
            ep = Episode(id=q.id, question=q, topology=Topology(agents=["echo"], active=["echo"], edges=[]),
                         memory={"echo": AgentRecord(answer=answer)}, final_answer=answer, aggregation="echo")
            out.append(ep)
            if on_episode:
                on_episode(ep)
        return out

    def reseed(self, seed):
        pass

    def forget_video(self, path):
        self.forgotten.append(path)


def test_a_team_written_to_the_protocol_answers_on_the_infer_path(tmp_path):
    """run_questions (what `m1 infer` runs) takes any Team: its answers are the rows, its traces are written, and it is
    switched to answering (over-budget and server errors become rows)."""
    import json

    from m1.config import load_team
    from m1.contracts import Team
    from m1.run import run_questions
    from m1.schema import Question

    cfg = load_team("tiny")
    team: Team = EchoTeam(cfg)
    qs = [Question(id=f"q{n}", video=str(tmp_path / "v.mp4"), text="Which?", options=["x", "y", "z"][:n])
          for n in (2, 3)]
    out = tmp_path / "results.jsonl"
    summary = run_questions(cfg, qs, out, trace_dir=tmp_path / "traces", team=team, progress=False)
    rows = {r["id"]: r for r in map(json.loads, out.read_text().splitlines())}
    assert {i: r["answer"] for i, r in rows.items()} == {"q2": "B", "q3": "C"}
    assert summary.answered == 2 and not summary.errors
    assert sorted(p.name for p in (tmp_path / "traces").glob("q*.json")) == ["q2.json", "q3.json"]
    assert team.over_budget_rows and team.server_error_rows
