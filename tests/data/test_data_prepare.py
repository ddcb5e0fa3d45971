"""`m1 data prepare`: a dataset -> question files split over whole videos with a seed, and teacher SFT examples."""
import json

import pytest
from typer.testing import CliRunner

from m1.cli import app
from m1.data.prepare import PrepareError, parse_split, split_by_video
from m1.schema import Question

runner = CliRunner()


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    from m1.synth.make import make_dataset

    folder = tmp_path_factory.mktemp("world")
    make_dataset(folder, videos=6, seed=3, duration=30, questions_per_video=3, progress=False)
    return folder


def _rows(path):
    return [json.loads(x) for x in path.read_text().splitlines()]


def test_split_is_by_whole_video_seeded_and_follows_question_fractions(world, tmp_path):
    src = tmp_path / "in.jsonl"
    lines = (world / "questions.jsonl").read_text().splitlines()
    src.write_text("\n".join(lines) + "\n" + '{"id": "bad", "video": "videos/none.mp4", "text": "?"}\n')
    out = tmp_path / "out"
    res = runner.invoke(app, ["data", "prepare", "--annotations", str(src), "--videos", str(world), "--out", str(out),
                              "--split", "sft=0.5,marl=0.5", "--seed", "1"])
    assert res.exit_code == 0, res.output
    sft, marl = _rows(out / "sft.jsonl"), _rows(out / "marl.jsonl")
    assert sorted(r["id"] for r in sft + marl) == sorted(json.loads(x)["id"] for x in lines)
    assert {r["video"] for r in sft}.isdisjoint({r["video"] for r in marl})
    assert abs(len(sft) - len(marl)) <= 3  # 3 questions per video: within one video of half
    record = json.loads((out / "prepare.json").read_text())
    assert record["skipped"] == 1 and record["files"]["sft"]["questions"] == len(sft)
    assert "bad" in (out / "skipped.txt").read_text() and "skipped 1 records" in res.output
    # the files read back as M1 questions with the videos folder, answers and families kept
    from m1.data.questions import read_questions

    qs, issues = read_questions(out / "sft.jsonl", world)
    assert not issues and all(q.answer is not None and q.meta.get("family") for q in qs)
    assert all(q.video.startswith(str(world)) for q in qs)
    # the same seed gives the same bytes; another seed deals the videos differently
    again = tmp_path / "again"
    runner.invoke(app, ["data", "prepare", "--annotations", str(src), "--videos", str(world), "--out", str(again),
                        "--split", "sft=0.5,marl=0.5", "--seed", "1"])
    assert (again / "sft.jsonl").read_bytes() == (out / "sft.jsonl").read_bytes()
    other = {s: split_by_video(qs_all(src, world), {"sft": 0.5, "marl": 0.5}, s)["sft"] for s in range(5)}
    assert len({tuple(sorted(q.id for q in v)) for v in other.values()}) > 1


def qs_all(src, world):
    from m1.data.loaders import load_jsonl

    return load_jsonl(src, world)[0]


def test_split_fractions_in_questions_not_videos():
    qs = [Question(id=f"{v}-{i}", video=f"v{v}.mp4", text="?") for v in range(10) for i in range(1 + v % 3)]
    parts = split_by_video(qs, {"a": 0.6, "b": 0.2, "c": 0.2}, seed=0)
    n = len(qs)
    assert sum(map(len, parts.values())) == n
    assert abs(len(parts["a"]) - 0.6 * n) <= 3 and all(parts.values())


@pytest.mark.parametrize("text, match", [("sft=0.5,marl=0.4", "sum to 0.9"), ("sft", "name=fraction"),
                                         ("sft=x,marl=1", "not a number"), ("a b=1", "plain name"),
                                         ("a=0.5,a=0.5", "given twice"), ("a=0,b=1", r"must be in \(0, 1\]")])
def test_bad_split_is_named(text, match):
    with pytest.raises(PrepareError, match=match):
        parse_split(text)


def test_errors_are_one_line(tmp_path):
    res = runner.invoke(app, ["data", "prepare", "--annotations", str(tmp_path / "none.jsonl"), "--videos",
                              str(tmp_path), "--out", str(tmp_path / "o")])
    assert res.exit_code == 2 and "error:" in res.output and "none.jsonl" in res.output
    empty = tmp_path / "empty.jsonl"
    empty.write_text('{"id": "x"}\n')
    res = runner.invoke(app, ["data", "prepare", "--annotations", str(empty), "--videos", str(tmp_path),
                              "--out", str(tmp_path / "o"), "--split", "marl=1", "--sft-config", "mini"])
    assert res.exit_code == 2 and "no usable questions (1 records skipped" in res.output


def test_teacher_examples_on_the_sft_split(world, tmp_path, m1_cache):
    """The SFT config's teacher (the rule-based synth teacher here; GPT-4o agents for the paper's configs) answers
    the sft split; kept generations and their keep-rule counts are written and recorded."""
    out = tmp_path / "out"
    res = runner.invoke(app, ["data", "prepare", "--annotations", str(world / "questions.jsonl"), "--videos",
                              str(world), "--out", str(out), "--split", "sft=0.34,marl=0.66", "--sft-config", "mini",
                              "--set", "data.workers=1", "--set", "data.rollouts_per_question=1",
                              "--set", "log.progress=false"])
    assert res.exit_code == 0, res.output
    rows = _rows(out / "sft_examples.jsonl")
    sft_ids = {r["id"] for r in _rows(out / "sft.jsonl")}
    assert rows and {r["question_id"] for r in rows} <= sft_ids
    assert {r["agent"] for r in rows} <= {"qwen3_big", "qwen3_small", "qwen2_big", "qwen2_small"}
    record = json.loads((out / "prepare.json").read_text())["sft_examples"]
    assert record["examples"] == len(rows) and record["stats"]["kept"] >= len(rows)
    assert record["stats"]["episodes"] == len(sft_ids)
    stats = json.loads((out / "sft_examples.jsonl.stats.json").read_text())
    assert stats["data"]["questions"] == str(out / "sft.jsonl")


def test_experiment_data_stage_splits_a_dataset_once(world, tmp_path, m1_cache):
    import yaml

    from m1.experiment.config import load_experiment
    from m1.experiment.runner import run_experiment
    from m1.experiment.stages import read_stage

    split = tmp_path / "split"
    spec = {"name": "d", "out_dir": str(tmp_path / "exp"), "seeds": [0],
            "data": {"datasets": [{"annotations": str(world / "questions.jsonl"), "videos": str(world),
                                   "out": str(split), "split": "marl=0.5,dev=0.5", "seed": 2}]},
            "eval": {"team": "tiny", "questions": str(split / "dev.jsonl"), "video_dir": str(world),
                     "overrides": ["limits.max_turns=1"]},
            "arms": {"base": None}}
    (tmp_path / "d.yaml").write_text(yaml.safe_dump(spec))
    exp = load_experiment(tmp_path / "d.yaml")
    printed = []
    run_experiment(exp, progress=printed.append)
    dev = _rows(split / "dev.jsonl")
    assert read_stage(tmp_path / "exp" / "base" / "seed0" / "eval")["answered"] == len(dev) > 0
    assert read_stage(tmp_path / "exp" / "data")["datasets"][0]["questions"] == 18
    printed = []
    run_experiment(exp, progress=printed.append)
    assert any("was split before (18 questions)" in p for p in printed)
