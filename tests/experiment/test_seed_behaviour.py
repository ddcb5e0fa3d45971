"""How the seed-kind teams answer, as their papers measure it: frames and tool calls per question, the share
answered without a call, each zoom's length and fps. From the results row through the compact eval row to the
report's behaviour section and behaviour.csv, with CPP teams' rows unchanged and older records shown as missing.
Hand-made rows, no model."""
import csv
import json

import yaml

from m1.experiment.config import load_experiment
from m1.experiment.rows import compact_eval
from m1.results import result_row
from m1.schema import AgentAnswer, AgentRecord, Episode, Question, Topology, Turn

Q = Question(id="q0", video="v.mp4", text="?", task="mcq", options=["x", "y"], answer="A", meta={"family": "a"})


def _zoom(step, s, e, fps, error=None):
    return Turn(step=step, tool="video_zoom", key_info=json.dumps({"segment": [s, e], "fps": fps}), output="",
                span=None if error else (s, e), error=error)


def _episode(counts, turns=(), plan=()):
    name = "zoomer" if counts else "x"
    return Episode(id=Q.id, question=Q, topology=Topology(agents=[name], active=[name], edges=[]),
                   memory={name: AgentRecord(plan=list(plan), turns=list(turns), answer="A")},
                   answers=[AgentAnswer(agent=name, answer="A")], final_answer="A", frames_used=40,
                   frame_counts=counts, timings={"batch_wall": 1.0, "batch_size": 1.0})


def test_result_row_records_each_executed_zoom_and_cpp_rows_are_unchanged():
    turns = [_zoom(1, 10.0, 30.0, 1.0), _zoom(2, 5.0, 500.0, 9.0, error="video_zoom: asks for too many frames"),
             _zoom(3, 12.5, 14.0, 4.0)]
    counts = {"policy": 40, "tools": 0, "turns": 4, "tool_calls": 3}
    row = result_row(_episode(counts, turns, plan=["video_zoom"] * 3))
    assert row["frame_counts"] == counts and row["zooms"] == [[20.0, 1.0], [1.5, 4.0]]
    assert "zooms" not in result_row(_episode({**counts, "tool_calls": 0, "turns": 1}))  # answered at a glance
    cpp = result_row(_episode({}))
    assert set(cpp) == {"id", "video", "question", "task", "answer", "answer_ok", "reason", "aggregation", "agents",
                        "frames_used", "seconds", "latency", "error", "truth", "correct"}


def test_compact_rows_carry_frames_calls_and_zooms_only_for_seed_kinds(tmp_path):
    qs = [Question(id=f"q{i}", video="v.mp4", text="?", task="mcq", options=["x", "y"], answer="A",
                   meta={"family": "a"}) for i in range(3)]
    plan = {"x": {"answer": "A", "parse_ok": True, "plan": ["Video Retrieval", "Fine Browser"], "plan_ok": True}}
    rows = [{"id": "q0", "answer": "A", "correct": True, "frames_used": 16, "agents": plan},  # a CPP team's
            {"id": "q1", "answer": "B", "correct": False, "frames_used": 24, "agents": {},
             "frame_counts": {"policy": 24, "tools": 0, "turns": 2, "tool_calls": 1}, "zooms": [[8.0, 2.0]]},
            {"id": "q2", "answer": "A", "correct": True, "frames_used": 16, "agents": {},
             "frame_counts": {"policy": 16, "tools": 0, "turns": 1, "tool_calls": 0}}]
    (tmp_path / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    got = compact_eval({}, tmp_path, qs, "q.jsonl")["rows"]
    assert json.dumps(got[0], separators=(",", ":")) == (
        '{"id":"q0","family":"a","answer":"A","correct":true,"agents":[["VR+FB",1,1]]}')
    assert got[1] == {"id": "q1", "family": "a", "answer": "B", "correct": False, "agents": [], "frames": 24,
                      "calls": 1, "zooms": [[8.0, 2.0]]}
    assert got[2]["frames"] == 16 and got[2]["calls"] == 0 and "zooms" not in got[2]


def _experiment(tmp_path, rows_of):
    """Eval-only experiment of arms x seeds whose results files hold `rows_of[(arm, seed)]`."""
    from m1.experiment.stages import STAGE_FILE

    fams = ["a", "a", "b", "b"]
    (tmp_path / "q.jsonl").write_text("".join(json.dumps(
        {"id": f"q{i}", "video": "v.mp4", "text": "?", "task": "mcq", "options": ["x", "y"], "answer": "A",
         "meta": {"family": f}}) + "\n" for i, f in enumerate(fams)))
    arms = sorted({a for a, _ in rows_of}, key=[a for a, _ in rows_of].index)
    (tmp_path / "e.yaml").write_text(yaml.safe_dump({
        "name": "acts", "out_dir": str(tmp_path / "out"), "seeds": sorted({s for _, s in rows_of}),
        "eval": {"team": "tiny", "questions": str(tmp_path / "q.jsonl")},
        "arms": {a: ({"eval": [f"limits.max_turns={k + 2}"]} if k else None) for k, a in enumerate(arms)}}))
    exp = load_experiment(tmp_path / "e.yaml")
    for (arm, seed), rows in rows_of.items():
        folder = exp.stage_dir(arm, seed, "eval")
        folder.mkdir(parents=True)
        (folder / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        (folder / STAGE_FILE).write_text(json.dumps({"results": {"results": str(folder / "results.jsonl")}}))
    return exp


def _seed_row(i, frames, calls, zooms=()):
    row = {"id": f"q{i}", "answer": "A", "correct": True, "frames_used": frames,
           "frame_counts": {"policy": frames, "tools": 0, "turns": calls + 1, "tool_calls": calls}}
    return {**row, "zooms": [list(z) for z in zooms]} if zooms else row


def test_report_behaviour_section_per_arm_and_seed_with_old_records_missing(tmp_path):
    from m1.experiment.report import write_report

    cpp = [{"id": f"q{i}", "answer": "A", "correct": i % 2 == 0, "frames_used": 16} for i in range(4)]
    zoomer0 = [_seed_row(0, 16, 0), _seed_row(1, 32, 2, [(10.0, 1.0), (2.0, 4.0)]), _seed_row(2, 16, 0),
               _seed_row(3, 24, 1, [(6.0, 2.0)])]
    zoomer1 = [_seed_row(i, 20, 1, [(4.0, 1.0)]) for i in range(4)]
    old = [{"id": f"q{i}", "answer": "A", "correct": True, "frames_used": 16} for i in range(4)]  # before the fields
    exp = _experiment(tmp_path, {("cpp", 0): cpp, ("cpp", 1): cpp, ("zoomer", 0): zoomer0,
                                 ("zoomer", 1): zoomer1, ("zoomer", 2): old, ("cpp", 2): cpp})
    rep = write_report(exp)
    by = {(r["arm"], r["family"], r["seed"]): r for r in rep["behaviour"]}
    assert {a for a, _, _ in by} == {"zoomer"}  # CPP arms have no behaviour rows
    s0 = by[("zoomer", "all", 0)]
    assert (s0["questions"], s0["frames"], s0["calls"], s0["no_tool"]) == (4, 22.0, 0.75, 0.5)
    assert (s0["zoom_s"], s0["zoom_fps"]) == (6.0, 7 / 3)  # over the three zooms, not per question
    assert by[("zoomer", "b", 0)]["calls"] == 0.5 and by[("zoomer", "b", 0)]["zoom_s"] == 6.0
    s2 = by[("zoomer", "all", 2)]  # an old record: missing, not zero
    assert s2["questions"] == 0 and all(s2[k] is None for k in ("frames", "calls", "no_tool", "zoom_s", "zoom_fps"))
    mean = by[("zoomer", "all", "mean")]
    assert (mean["frames"], mean["calls"], mean["no_tool"], mean["zoom_s"]) == (21.0, 0.875, 0.25, 5.0)
    md = rep["text"]
    assert "## Behaviour of the seed-kind teams (all families)" in md
    assert "| zoomer | 0 | 4 | 22.0 | 0.75 | 50.0 | 6.0 | 2.33 |" in md
    assert "| zoomer | 2 | 0 | n/a | n/a | n/a | n/a | n/a |" in md
    assert "| zoomer | mean | 8 | 21.0 | 0.88 | 25.0 | 5.0 | 1.67 |" in md
    table = list(csv.DictReader((tmp_path / "out" / "behaviour.csv").open()))
    assert set(table[0]) == {"arm", "family", "seed", "questions", "frames", "calls", "no_tool", "zoom_s",
                             "zoom_fps"}
    row2 = next(r for r in table if (r["family"], r["seed"]) == ("all", "2"))
    assert row2["frames"] == "" and row2["questions"] == "0"
    assert next(csv.reader((tmp_path / "out" / "report.csv").open()))[0:3] == ["arm", "family", "n_seeds"]


def test_no_behaviour_section_without_seed_kind_rows(tmp_path):
    from m1.experiment.report import write_report

    rows = [{"id": f"q{i}", "answer": "A", "correct": True, "frames_used": 16} for i in range(4)]
    rep = write_report(_experiment(tmp_path, {("base", 0): rows, ("new", 0): rows}))
    assert rep["behaviour"] == [] and "Behaviour" not in rep["text"]
    assert not (tmp_path / "out" / "behaviour.csv").exists()


def test_a_rule_based_zoomer_run_records_its_zooms(tmp_path):
    """The zoomer's own run (rule policy, a small synth world): each row's zooms are its executed video_zoom turns'
    [end - start, fps], and its calls those turns."""
    from tests.conftest import make_synth_world
    from m1.config import load_team
    from m1.team.engines_registry import make_team

    qs = make_synth_world(tmp_path, 1, 7, 60, 6)[2]
    eps = make_team(load_team("zoomer_synth")).run(qs)
    zoomed = 0
    for e in eps:
        row = result_row(e)
        turns = [t for t in e.memory["zoomer"].turns if t.tool == "video_zoom" and t.error is None]
        assert row.get("zooms", []) == [[round(t.span[1] - t.span[0], 3), json.loads(t.key_info)["fps"]]
                                        for t in turns]
        assert row["frame_counts"]["tool_calls"] == len(e.memory["zoomer"].turns)
        zoomed += bool(turns)
    assert zoomed
