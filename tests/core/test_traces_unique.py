"""Traces never overwrite each other. Ids that clean to one file name get distinct names; a trace folder
belongs to one results file, and a run of another is refused before it answers anything."""
import json

import pytest

from m1.config import load_team
from m1.data.questions import InputError
from m1.run import TRACE_OWNER, claim_trace_dir, run_questions
from m1.schema import Question
from m1.trace import trace_name


def test_trace_names_are_one_per_id():
    ids = ["clip 1", "clip_1", "clip:1", "a/b", ".hidden", "x" * 300, "q01", "synth_000.mov", "synth_000.mp4"]
    names = [trace_name(i) for i in ids]
    assert len(set(names)) == len(ids)
    assert trace_name("q01") == "q01" and trace_name("clip_1") == "clip_1"  # plain ids keep their plain names
    assert all(not n.startswith(".") and len(n) <= 131 and "/" not in n for n in names)
    assert trace_name("clip 1") == trace_name("clip 1")  # stable: a rerun replaces its own trace


def test_a_trace_folder_belongs_to_one_results_file(tmp_path):
    traces = tmp_path / "traces"
    claim_trace_dir(traces, tmp_path / "a.jsonl")
    claim_trace_dir(traces, tmp_path / "a.jsonl")  # the same run again: its rerun
    with pytest.raises(InputError, match=r"trace folder .*traces holds the traces of the results file .*a\.jsonl; "
                                         r"this run writes .*b\.jsonl: give it its own --trace-dir"):
        claim_trace_dir(traces, tmp_path / "b.jsonl")
    import shutil

    moved = tmp_path / "moved"
    shutil.copytree(traces, moved / "traces")
    claim_trace_dir(moved / "traces", moved / "a.jsonl")  # a run folder moved whole still matches its traces


def test_two_runs_into_one_trace_folder_lose_nothing(tmp_path):
    """Ids `clip 1` and `clip_1` in one run: two traces, both in the index; a second results file into the same
    folder is refused and writes nothing."""
    from tests.core.test_run_safety import ScriptedTeam

    cfg, traces = load_team("tiny"), tmp_path / "traces"
    qs = [Question(id=i, video=str(tmp_path / "v.mp4"), text="Which?", options=["x", "y"])
          for i in ("clip 1", "clip_1", "clip:1")]
    run_questions(cfg, qs, tmp_path / "a.jsonl", trace_dir=traces, team=ScriptedTeam(), progress=False)
    written = {json.loads(p.read_text())["id"] for p in traces.glob("*.json")}
    assert written == {"clip 1", "clip_1", "clip:1"} and len(list(traces.glob("*.html"))) == 4  # + index.html
    index = (traces / "index.html").read_text()
    assert all(f">{i}<" in index for i in ("clip 1", "clip_1", "clip:1"))
    before = sorted((p.name, p.stat().st_mtime_ns) for p in traces.iterdir())
    with pytest.raises(InputError, match="give it its own --trace-dir"):
        run_questions(cfg, qs, tmp_path / "b.jsonl", trace_dir=traces, team=ScriptedTeam(), progress=False)
    assert sorted((p.name, p.stat().st_mtime_ns) for p in traces.iterdir()) == before
    assert not (tmp_path / "b.jsonl").exists() or not (tmp_path / "b.jsonl").read_text()
    assert (traces / TRACE_OWNER).read_text().strip() == "../a.jsonl"
