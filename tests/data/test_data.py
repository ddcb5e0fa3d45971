"""Benchmark loaders (fixtures written from the published formats, plus real Charades-STA and Video-Holmes
excerpts in tests/fixtures/benchmarks/real) and metrics on hand-computed cases."""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from m1.data.loaders import load_benchmark  # noqa: E402
from m1.data.metrics import (  # noqa: E402
    accuracy, charades_metrics, extract_choice, format_table, iou, mra, parse_number, parse_span,
    score_benchmark, vsibench_metrics,
)
from m1.data.records import LoadIssue  # noqa: E402
from m1.schema import Question  # noqa: E402

FIX = Path(__file__).parents[1] / "fixtures" / "benchmarks"
REAL = FIX / "real"  # excerpts of the published annotation files, with their sources in each README


def touch(root: Path, *names: str) -> Path:
    """Empty placeholder videos: the loaders only check that the file exists."""
    for name in names:
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(b"")
    return root


def by_id(questions: list[Question]) -> dict[str, Question]:
    return {q.id: q for q in questions}


def issue_ids(issues: list[LoadIssue]) -> dict[str, str]:
    return {i.record_id: i.reason for i in issues}


# ------------------------------------------------------------------------------------ loaders


def test_longvideobench_fixture(tmp_path):
    videos = touch(tmp_path, "86CxyhFV9MI.mp4", "videos/Zx9Qp0aBcDe.mp4")
    qs, issues = load_benchmark("longvideobench", FIX / "longvideobench" / "lvb_val.json", videos)
    q = by_id(qs)
    assert sorted(q) == ["86CxyhFV9MI_0", "86CxyhFV9MI_1", "Zx9Qp0aBcDe_0"]
    assert q["86CxyhFV9MI_0"].answer == "B"  # correct_choice 1 is 0-based
    assert q["86CxyhFV9MI_1"].answer == "E" and len(q["86CxyhFV9MI_1"].options) == 5
    assert q["86CxyhFV9MI_0"].options == ["A ladle", "A knife", "A towel", "A cup"]
    assert q["Zx9Qp0aBcDe_0"].video == str(videos / "videos" / "Zx9Qp0aBcDe.mp4")
    meta = q["86CxyhFV9MI_1"].meta
    assert (meta["duration_group"], meta["question_category"], meta["level"]) == (600, "E2O", "L2-Relation")
    assert meta["benchmark"] == "longvideobench"
    bad = issue_ids(issues)
    assert set(bad) == {"Zx9Qp0aBcDe_1", "MissingVid01_0"}
    assert "correct_choice" in bad["Zx9Qp0aBcDe_1"] and "7" in bad["Zx9Qp0aBcDe_1"]
    assert "video file not found" in bad["MissingVid01_0"]
    assert all(i.file.endswith("lvb_val.json") for i in issues)


def test_videomme_flat_rows_and_official_template(tmp_path):
    videos = touch(tmp_path, "fFjv93ACGo8.mp4", "k0Wg3p1RXrY.mkv", "data/Q7mH2sPlAyX.MP4")
    qs, issues = load_benchmark("videomme", FIX / "videomme", videos)
    q = by_id(qs)
    assert sorted(q) == ["001-1", "001-2", "301-1", "602-1", "602-2"]
    assert q["001-1"].options == ["Apples.", "Candles.", "Berries.", "The three kinds are of the same number."]
    assert q["001-1"].answer == "C" and q["001-1"].meta["duration"] == "short"
    assert q["301-1"].video.endswith("k0Wg3p1RXrY.mkv")
    # the official template has trailing commas and nests questions under the video
    assert q["602-1"].meta["duration"] == "long" and q["602-1"].meta["task_type"] == "Object Reasoning"
    assert q["602-1"].video == str(videos / "data" / "Q7mH2sPlAyX.MP4")
    bad = issue_ids(issues)
    assert set(bad) == {"301-2", "601-1"}
    assert "'E'" in bad["301-2"] and "line 4" in bad["301-2"]
    assert "NoSuchVid00" in bad["601-1"]


def test_mlvu_official_and_lmms_rows(tmp_path):
    videos = touch(tmp_path, "plotQA/movie101_66.mp4", "plotQA/movie101_67.mp4", "count/count_203.mp4",
                   "subPlot/subPlot_new_all_126.mp4", "AWA-6.mp4")
    qs, issues = load_benchmark("mlvu", FIX / "mlvu" / "json", videos)
    q = by_id(qs)
    assert sorted(q) == ["1_plotQA_0", "1_plotQA_1", "4_count_0", "8_sub_scene_0"]
    assert q["1_plotQA_0"].answer == "A"  # official answer text "Yellow" -> its letter
    assert q["1_plotQA_1"].answer == "C" and q["4_count_0"].answer == "C"
    assert q["4_count_0"].meta["task_type"] == "count"
    open_q = q["8_sub_scene_0"]
    assert open_q.task == "open" and open_q.options == [] and open_q.answer.startswith("The woman pushes")
    assert open_q.meta["scoring_points"] == ["pushes the door open", "greets the shopkeeper"]
    bad = issue_ids(issues)
    assert set(bad) == {"1_plotQA_2", "1_plotQA_3"}
    assert "A frisbee" in bad["1_plotQA_2"] and "movie101_99" in bad["1_plotQA_3"]

    lmms, lmms_issues = load_benchmark("mlvu", FIX / "mlvu" / "mlvu_dev_lmms.jsonl", videos)
    assert lmms_issues == []
    (tr,) = lmms
    assert (tr.id, tr.answer, tr.meta["task_type"]) == ("TR_0", "B", "topic_reasoning")
    assert tr.text == "What is the main topic of the video?"  # option lines moved out of the text
    assert tr.options == ["Cooking", "Wildlife", "Sports", "Music"]


def test_charades_fixture(tmp_path):
    videos = touch(tmp_path, "3MSZA.mp4", "AMT7R.mp4", "FPJ9D.mp4")
    qs, issues = load_benchmark("charades_sta", FIX / "charades_sta" / "charades_sta_test.txt", videos)
    q = by_id(qs)
    assert sorted(q) == ["3MSZA_1", "3MSZA_2", "AMT7R_3", "FPJ9D_5"]
    first = q["3MSZA_1"]
    assert (first.task, first.answer, first.text) == ("grounding", "[24.3 - 30.4]", "person turn a light on")
    assert first.options == [] and first.meta["duration"] == pytest.approx(31.46)
    assert q["FPJ9D_5"].answer == "[25.8 - 34]"  # kept as annotated, past the 31.25 s video end
    assert q["FPJ9D_5"].meta["end_past_video"] is True and first.meta["end_past_video"] is False
    bad = issue_ids(issues)
    assert set(bad) == {"line 4", "FPJ9D_6", "ZZZZZ_7"}
    assert "start 10.0 and end 10.0" in bad["FPJ9D_6"] and "video file not found" in bad["ZZZZZ_7"]


def test_charades_real_test_split(tmp_path):
    root = REAL / "charades_sta"
    lines = (root / "charades_sta_test.txt").read_text().splitlines()
    vids = sorted({line.split()[0] for line in lines})
    videos = touch(tmp_path, *(f"{v}.mp4" for v in vids))
    qs, issues = load_benchmark("charades_sta", root, videos)
    assert issues == [] and len(qs) == 3720 and len({q.video for q in qs}) == 1334
    assert (qs[0].id, qs[0].answer, qs[0].text) == ("3MSZA_1", "[24.3 - 30.4]", "person turn a light on")
    assert all(q.meta["start"] < q.meta["end"] for q in qs)
    first200 = qs[:200]
    assert all(q.meta["duration"] is not None for q in first200)  # the CSV subset covers these
    assert len({q.meta["video_id"] for q in first200}) == 79
    assert sum(q.meta["end_past_video"] for q in first200) == 26  # the quirk the README counts
    # the CSV is CRLF with quoted commas; a wrong parse would shift the length column
    lengths = {q.meta["video_id"]: q.meta["duration"] for q in first200}
    assert (lengths["3MSZA"], lengths["FPJ9D"]) == (30.96, 33.42)
    assert by_id(qs)["FPJ9D_" + str(next(i for i, l in enumerate(lines, 1) if l.startswith("FPJ9D 25.8 34.0")))
                     ].meta["end_past_video"] is True


def test_vsibench_fixture(tmp_path):
    videos = touch(tmp_path, "scannet/scene0011_00.mp4", "arkitscenes/41069025.mp4")
    qs, issues = load_benchmark("vsibench", FIX / "vsibench" / "vsibench_test.jsonl", videos)
    q = by_id(qs)
    assert sorted(q) == ["1", "2", "3", "7"]
    assert (q["1"].task, q["1"].answer, q["1"].options) == ("numeric", "4", [])
    assert (q["2"].task, q["2"].answer, q["2"].options) == ("mcq", "B", ["left", "right"])
    assert q["3"].meta == {"benchmark": "vsibench", "dataset": "arkitscenes", "scene_name": "41069025",
                           "question_type": "room_size_estimation", "category": "NA"}
    bad = issue_ids(issues)
    assert set(bad) == {"4", "5", "6"}
    assert "not a number" in bad["4"] and "video file not found" in bad["5"] and "0" in bad["6"]


def test_video_holmes_fixture_and_real_examples(tmp_path):
    videos = touch(tmp_path, "RSmjqss0XKQ.mp4", "dGS48Kcax5k.mp4")
    qs, issues = load_benchmark("video_holmes", FIX / "video_holmes", videos)
    assert [q.id for q in qs] == ["RSmjqss0XKQ_1", "RSmjqss0XKQ_2"]
    assert qs[1].options[1] == "Anger at the broken machine" and qs[1].meta["question_type"] == "IMC"
    assert set(issue_ids(issues)) == {"RSmjqss0XKQ_3", "NoSuchFilm01_1"}

    real = REAL / "video_holmes"
    qs, issues = load_benchmark("video_holmes", real, videos)
    assert issues == [] and len(qs) == 16
    assert all(len(q.options) == 6 and q.answer in "ABCDEF" for q in qs)
    assert {q.meta["question_type"] for q in qs} <= {"SR", "IMC", "TCI", "TA", "MHR", "PAR", "CTI"}


def test_jsonl_reports_lines(tmp_path):
    videos = touch(tmp_path, "clips/a.mp4", "clips/b.mp4")
    qs, issues = load_benchmark("jsonl", FIX / "jsonl" / "questions.jsonl", videos)
    assert [q.id for q in qs] == ["q1", "q2", "q3", "q8"]
    assert qs[0].video == str(videos / "clips" / "a.mp4") and qs[0].meta["task_type"] == "order"
    assert qs[3].answer is None  # unlabelled questions load
    reasons = [(i.record_id, i.reason.split(":")[0]) for i in issues]
    assert reasons == [("line 4", "line 4"), ("q5", "line 5"), ("q6", "line 6"), ("q7", "line 7"), ("q1", "line 8")]
    text = {i.record_id: i.reason for i in issues}
    assert "invalid JSON" in text["line 4"] and "colour" in text["q5"]
    assert "duplicate id" in text["q1"] and "'C'" in text["q7"]


def test_load_benchmark_errors(tmp_path):
    with pytest.raises(ValueError, match="unknown benchmark 'egoschema'"):
        load_benchmark("egoschema", tmp_path, tmp_path)
    with pytest.raises(FileNotFoundError, match="nope.json"):
        load_benchmark("longvideobench", tmp_path / "nope.json", tmp_path)
    broken = tmp_path / "lvb_val.json"
    broken.write_text("[{")
    with pytest.raises(ValueError, match="lvb_val.json: not valid JSON"):
        load_benchmark("longvideobench", broken, tmp_path)
    # without the video check every record loads, pointing at where the video should be
    qs, issues = load_benchmark("vsibench", FIX / "vsibench" / "vsibench_test.jsonl", tmp_path / "none",
                                check_videos=False)
    assert len(qs) == 5 and len(issues) == 2
    assert qs[-1].video == str(tmp_path / "none" / "scannet" / "scene0011_00.mp4")


# ------------------------------------------------------------------------------------ metrics


def test_iou_edge_cases():
    assert iou((0, 1), (2, 3)) == 0.0  # disjoint
    assert iou((0, 2), (2, 4)) == 0.0  # touching
    assert iou((0, 10), (2, 4)) == pytest.approx(0.2)  # containment
    assert iou((2, 4), (0, 10)) == pytest.approx(0.2)
    assert iou((1.5, 7.25), (1.5, 7.25)) == 1.0
    assert iou((0, 4), (2, 6)) == pytest.approx(2 / 6)
    assert iou((3, 3), (3, 3)) == 1.0  # equal points: documented choice
    assert iou((3, 3), (0, 10)) == 0.0  # a point inside a span has no length to overlap
    assert iou((3, 3), (5, 5)) == 0.0
    with pytest.raises(ValueError, match="start <= end"):
        iou((5, 2), (0, 10))


def test_parse_span():
    assert parse_span("##Timestamp: [24.3 - 30.4]") == (24.3, 30.4)
    assert parse_span("The event happens in 1:05 - 1:20.") == (65.0, 80.0)
    assert parse_span("from 12 seconds to 5 seconds") == (5.0, 12.0)  # reversed ends swapped
    assert parse_span("see [3, 7.5] and 10 - 20") == (3.0, 7.5)  # bracketed span wins
    assert parse_span([2, 4]) == (2.0, 4.0)
    assert parse_span("I cannot tell") is None and parse_span(None) is None


def q_ground(i: int, span: str = "[0.0 - 10.0]") -> Question:
    return Question(id=f"g{i}", video="v.mp4", text="x", task="grounding", answer=span)


def test_charades_metrics_hand_computed():
    qs = [q_ground(i) for i in range(5)]
    preds = {"g0": "[0 - 10]", "g1": "It happens in 0 - 5 seconds", "g2": "[0.0 - 3.0]", "g3": "no idea"}
    m = charades_metrics(preds, qs)  # IoUs 1.0, 0.5, 0.3, 0 (unparsed), 0 (missing)
    assert m["mIoU"] == pytest.approx(1.8 / 5)
    assert (m["R@0.3"], m["R@0.5"], m["R@0.7"]) == (3 / 5, 2 / 5, 1 / 5)  # >= is inclusive
    assert (m["n"], m["unparsed"]) == (5, 2)
    assert score_benchmark("charades_sta", preds, qs) == m
    with pytest.raises(ValueError, match="no labelled grounding"):
        charades_metrics(preds, [])


def test_mra_hand_computed():
    assert mra(10, 10) == 1.0
    assert mra(9.6, 10) == 1.0  # 4 % off passes every threshold
    assert mra(8.8, 10) == pytest.approx(0.8)  # 12 %: passes 1-t for t = .50 ... .85
    assert mra(10.6, 10) == pytest.approx(0.9)  # 6 %: fails only t = .95
    assert mra(15, 10) == pytest.approx(0.1)  # exactly 50 %: counted by the <= of the scoring code
    assert mra(0, 10) == 0.0 and mra(30, 10) == 0.0 and mra(None, 10) == 0.0
    with pytest.raises(ValueError, match="non-zero ground truth"):
        mra(1, 0)


def test_extract_choice_and_parse_number():
    opts = ["red circle", "blue square", "green triangle", "yellow star"]
    assert extract_choice("C. Jade", opts) == "C"
    assert extract_choice("The answer is (B).", opts) == "B"
    assert extract_choice("I think A", opts) == "A"
    assert extract_choice("Answer: C. Jade.", opts) == "C"  # the A of "Answer" is not a choice
    assert extract_choice("After careful thought, D", opts) == "D"
    assert extract_choice(" b ", opts) == "B"
    assert extract_choice("Blue square", opts) == "B"
    assert extract_choice("E", opts) == "" and extract_choice("not sure", opts) == ""
    assert extract_choice(None, opts) == ""
    assert parse_number("about 2.5 meters") == 2.5
    assert parse_number("twenty-one chairs") == 21.0
    assert parse_number("three hundred and five") == 305.0
    assert parse_number("1,200 square meters") == 1200.0
    assert parse_number("none") is None


def q_mcq(qid: str, answer: str | None, **meta) -> Question:
    return Question(id=qid, video="v.mp4", text="?", options=["w", "x", "y", "z"], answer=answer, meta=meta)


def test_accuracy_grouped():
    qs = [q_mcq("a", "A", duration="short"), q_mcq("b", "B", duration="short"),
          q_mcq("c", "C", duration="long"), q_mcq("d", "D", duration="long"),
          q_mcq("hidden", None, duration="long")]
    preds = {"a": "A", "b": "(C) y", "c": "The answer is C", "d": "no idea"}
    acc = accuracy(preds, qs, group_by=("duration",))
    assert (acc["correct"], acc["answered"], acc["total"], acc["unlabeled"]) == (2, 3, 4, 1)
    assert acc["accuracy"] == 0.5 and acc["accuracy_answered"] == pytest.approx(2 / 3)
    assert acc["by_duration"] == {"long": {"accuracy": 0.5, "correct": 1, "total": 2},
                                  "short": {"accuracy": 0.5, "correct": 1, "total": 2}}
    vm = score_benchmark("videomme", preds, [q.model_copy(update={"meta": {**q.meta, "domain": "K"}}) for q in qs])
    assert (vm["acc_short"], vm["acc_long"]) == (0.5, 0.5) and "acc_medium" not in vm
    with pytest.raises(ValueError, match="no labelled"):
        accuracy(preds, [q_mcq("hidden", None)])


def test_vsibench_metrics_hand_computed():
    def q(qid, qtype, answer, options=()):
        return Question(id=qid, video="v.mp4", text="?", options=list(options), answer=answer,
                        task="mcq" if options else "numeric", meta={"question_type": qtype})
    qs = [q("1", "object_counting", "4"), q("2", "room_size_estimation", "20"),
          q("3", "object_rel_direction_easy", "A", ["left", "right"]),
          q("4", "object_rel_direction_hard", "B", ["left", "right", "back"]),
          q("5", "obj_appearance_order", "C", ["p", "q", "r", "s"])]
    preds = {"1": "4", "2": "18.5 square meters", "3": "A", "4": "C", "5": "C."}
    m = vsibench_metrics(preds, qs)
    assert m["object_counting"] == 1.0 and m["room_size_estimation"] == pytest.approx(0.9)
    assert m["object_rel_direction"] == 0.5  # easy 1.0 and hard 0.0, equal weight
    assert m["overall"] == pytest.approx((1.0 + 0.9 + 0.5 + 1.0) / 4)
    assert m["by_question_type"]["room_size_estimation"] == {"score": pytest.approx(0.9), "metric": "MRA", "n": 1}
    assert score_benchmark("vsibench", preds, qs) == m


def test_score_fixtures_and_table():
    mlvu, _ = load_benchmark("mlvu", FIX / "mlvu" / "json", FIX, check_videos=False)
    preds = {"1_plotQA_0": "A", "1_plotQA_1": "B", "1_plotQA_3": "(C) The son", "4_count_0": "C",
             "8_sub_scene_0": "a woman walks in"}
    m = score_benchmark("mlvu", preds, mlvu)
    assert m["by_task_type"]["plotQA"]["accuracy"] == pytest.approx(2 / 3)
    assert m["M-avg"] == pytest.approx((2 / 3 + 1.0) / 2) and m["accuracy"] == 0.75
    assert m["open_unscored"] == 1

    lvb, _ = load_benchmark("longvideobench", FIX / "longvideobench" / "lvb_val.json", FIX, check_videos=False)
    m = score_benchmark("longvideobench", {"86CxyhFV9MI_0": "B", "MissingVid01_0": "A"}, lvb)
    assert m["accuracy"] == 0.5
    assert list(m["by_duration_group"]) == ["15", "600", "3600"]  # numeric order
    table = format_table(m, title="LongVideoBench")
    assert "| accuracy | 50.00 |" in table and "| total | 4 |" in table
    assert "| duration_group | accuracy | correct | total |" in table
    assert "| 3600 | 100.00 | 1 | 1 |" in table

    jl, _ = load_benchmark("jsonl", FIX / "jsonl" / "questions.jsonl", FIX, check_videos=False)
    g = score_benchmark("jsonl", {"q1": "B", "q2": "[2.0 - 5.5]", "q3": "3", "q6": "B"}, jl)
    assert g["accuracy"] == 0.5 and g["mIoU"] == 1.0 and g["MRA"] == 1.0
    assert g["by_task_type"]["order"]["accuracy"] == 1.0
    json.dumps(g)  # score dicts are JSON-serialisable
    with pytest.raises(ValueError, match="unknown benchmark"):
        score_benchmark("mmr_v", {}, jl)


def test_vsibench_parquet_rows(tmp_path):
    """The HF release is a parquet table; options come back as lists, or None for numeric rows."""
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    rows = [json.loads(line) for line in (FIX / "vsibench" / "vsibench_test.jsonl").read_text().splitlines()]
    path = tmp_path / "test-00000-of-00001.parquet"
    pq.write_table(pa.Table.from_pylist(rows), path)
    videos = touch(tmp_path / "videos", "scannet/scene0011_00.mp4", "arkitscenes/41069025.mp4")
    qs, issues = load_benchmark("vsibench", path, videos)
    assert [(q.id, q.task, q.answer) for q in qs] == [("1", "numeric", "4"), ("2", "mcq", "B"),
                                                       ("3", "numeric", "21.5"), ("7", "mcq", "C")]
    assert qs[3].options[0] == "chair, table, sofa" and len(issues) == 3


def test_jsonl_line_that_is_not_utf8_is_skipped_by_line(tmp_path):
    recs = [{"id": f"q{i}", "video": "v.mp4", "text": "Which?", "options": ["a", "b"], "answer": "A"}
            for i in range(3)]
    path = tmp_path / "bench.jsonl"
    path.write_bytes(b"".join((json.dumps(r).replace("Which", "Wh\xe9ich") if i == 1 else json.dumps(r))
                              .encode("latin-1") + b"\n" for i, r in enumerate(recs)))
    qs, issues = load_benchmark("jsonl", path, tmp_path, check_videos=False)
    assert [q.id for q in qs] == ["q0", "q2"]
    col = json.dumps(recs[1]).index("Which") + 3  # the byte after "Wh", counted from 1
    assert [str(i) for i in issues] == [f"{path}: line 2: line 2: not UTF-8 text (byte 0xe9 at column {col})"]
    with pytest.raises(ValueError, match=f"{tmp_path}: is a folder"):
        load_benchmark("jsonl", tmp_path, tmp_path)
