"""The mini team pipeline (scripts/mini_team.py) with tiny budgets: data, teacher SFT data, SFT, MARL, table.

These check behaviour (the SFT loss falls, trained agents write plans in the strict format far more often than
untrained ones, MARL runs from the SFT weights, the table is produced), not the research claim of the full run.
"""
import argparse
import importlib.util
import json
import shutil
import sys
from collections import Counter
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def mt():
    spec = importlib.util.spec_from_file_location("mini_team", REPO / "scripts" / "mini_team.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["mini_team"] = mod  # dataclasses look their module up while the class is built
    spec.loader.exec_module(mod)
    return mod


BUDGET = dict(seeds=(0,), train_videos=1, eval_videos=1, duration=60.0, questions_per_video=8, progress=False,
              sft_max_steps=None,  # the configs' epochs, not the full run's 1200 steps
              tiny_clip=True)  # a random tiny CLIP: the configs' trained one costs minutes on first use


@pytest.mark.slow
def test_synth_tokenizer_makes_prompts_short(m1_cache):
    from m1.agents.prompts import plan_messages
    from m1.config import TinySpec
    from m1.models.tiny import build_tokenizer, ensure_tiny, spec_hash
    from m1.schema import Question
    from transformers import AutoTokenizer

    spec = TinySpec(arch="qwen2", hidden_size=32, layers=1, heads=2, kv_heads=1, corpus="synth")
    assert spec_hash(spec) != spec_hash(spec.model_copy(update={"corpus": "default"}))
    tok = AutoTokenizer.from_pretrained(ensure_tiny(spec))
    q = Question(id="x", video="v.mp4", text="What colour is the shape that appears at 01:20?",
                 options=["red", "blue", "green", "white"], task="mcq")
    text = tok.apply_chat_template(plan_messages(q, ["Global Sampling", "Time Stamp Retrieval", "Rough Browser"]),
                                   tokenize=False, add_generation_prompt=True)
    n_synth, n_default = len(tok(text)["input_ids"]), len(build_tokenizer()(text)["input_ids"])
    assert n_synth * 3 < n_default, (n_synth, n_default)
    assert tok.decode(tok(text)["input_ids"]) == text


def test_synth_model_cache_follows_the_tokenizer_version(monkeypatch):
    """A tiny model folder holds its tokenizer, so a new synth tokenizer must not reuse an old folder."""
    from m1.config import TinySpec
    from m1.models import tiny

    spec = TinySpec(arch="qwen2", hidden_size=32, layers=1, heads=2, kv_heads=1, corpus="synth")
    plain = spec.model_copy(update={"corpus": "default"})
    before = tiny.spec_hash(spec), tiny.spec_hash(plain)
    monkeypatch.setattr(tiny, "SYNTH_CORPUS_VERSION", tiny.SYNTH_CORPUS_VERSION + 1)
    assert tiny.spec_hash(spec) != before[0]
    assert tiny.spec_hash(plain) == before[1]


@pytest.mark.slow
def test_teacher_data_in_worker_processes_equals_one_process(tmp_path, m1_cache, mt, monkeypatch):
    """Shards of whole videos built in two spawned workers give the single process's examples, in its order."""
    monkeypatch.syspath_prepend(str(REPO / "scripts"))  # spawned workers import the script as `mini_team`
    from m1.marl.config import load_sft_config
    from m1.video import VideoPool

    b = replace(mt.Budget(**BUDGET), train_videos=2, questions_per_video=3)
    train_qs = mt.make_world(tmp_path / "data", b.train_videos, b.train_seed, b)
    shards = mt.video_shards(train_qs, 2)
    assert [len({q.video for q in s}) for s in shards] == [1, 1] and sum(shards, []) == train_qs
    assert mt.video_shards(train_qs, 5) == shards  # never more shards than videos
    sft_cfg = load_sft_config("mini")
    clip_cache = tmp_path / "clip"
    one, one_stats = mt.build_examples(sft_cfg, train_qs, tmp_path / "one", clip_cache, VideoPool(), tiny_clip=True)
    two, two_stats = mt.build_examples(sft_cfg, train_qs, tmp_path / "two", clip_cache, None, tiny_clip=True, jobs=2)
    assert len(one) > 0 and two == one
    assert two_stats == one_stats and two_stats["kept"] == len(two)


@pytest.mark.slow
def test_pipeline_pieces_with_tiny_budgets(tmp_path, m1_cache, mt, monkeypatch):
    from m1.marl.config import load_sft_config
    from m1.video import VideoPool

    b = replace(mt.Budget(**BUDGET), sft_max_steps=80, marl_steps=1, marl_questions_per_step=1,
                overrides_sft=["batch_size=16", "learner.micro_batch_size=16"],
                overrides_marl=["rollout.num_generations=2"])
    pool, clip_cache = VideoPool(), tmp_path / "clip"
    train_qs, held_qs = mt.make_sets(tmp_path / "data", b)
    assert train_qs and held_qs and {q.id for q in train_qs}.isdisjoint({q.id for q in held_qs})

    # teacher data: the paper's keep rule, every phase, seated under the students' names
    sft_cfg = load_sft_config("mini")
    examples, stats = mt.build_examples(sft_cfg, train_qs, tmp_path, clip_cache, pool, tiny_clip=True)
    assert stats["kept"] == len(examples) > 0
    assert {e.agent for e in examples} <= {"qwen3_big", "qwen3_small", "qwen2_big", "qwen2_small"}
    assert {"plan", "answer"} <= {e.phase for e in examples}
    assert (tmp_path / "sft_examples.jsonl").is_file()
    # the file is reused for the same data settings and rebuilt for others (a stale cache must not be trained on)
    with monkeypatch.context() as m:
        m.setattr(mt, "sft_teacher_config", lambda *a, **k: pytest.fail("rebuilt"))
        assert mt.build_examples(sft_cfg, train_qs, tmp_path, clip_cache, pool, tiny_clip=True) == (examples, stats)
        m.setattr(mt, "sft_teacher_config", lambda *a, **k: (_ for _ in ()).throw(RuntimeError("rebuild")))
        other = sft_cfg.model_copy(update={"data": sft_cfg.data.model_copy(update={"rotate_options": False})})
        with pytest.raises(RuntimeError, match="rebuild"):
            mt.build_examples(other, train_qs, tmp_path, clip_cache, pool, tiny_clip=True)

    # SFT: the loss falls and plans parse far more often than with random weights
    untrained = mt.evaluate(mt.mini_config(0, clip_cache=clip_cache, tiny_clip=True), held_qs, pool)
    weights, rows = mt.run_sft(0, examples, tmp_path / "sft", b, clip_cache)
    losses = [r["loss"] for r in rows]
    assert len(losses) == 80 and sum(losses[-5:]) / 5 < 0.5 * sum(losses[:5]) / 5, losses
    assert set(weights) == {"qwen3_big", "qwen3_small", "qwen2_big", "qwen2_small"}
    sft = mt.evaluate_cached(tmp_path / "sft" / "eval.json", mt.mini_config(0, weights, clip_cache, tiny_clip=True),
                             held_qs, pool)
    assert untrained["parse_ok"]["plan"] < 0.05  # random weights: no plan in the strict format
    assert sft["parse_ok"]["plan"] > untrained["parse_ok"]["plan"] + 0.25, (untrained["parse_ok"], sft["parse_ok"])
    assert sft["n"] == untrained["n"] == len(held_qs)
    traces = [json.loads(line) for line in (tmp_path / "sft" / "eval.traces.jsonl").read_text().splitlines()]
    assert [t["id"] for t in traces] == [q.id for q in held_qs]
    assert sum(t["correct"] for t in traces) == round(sft["accuracy"] * sft["n"])
    assert all(set(t["agents"]) <= set(weights) and all(p[0] in ("plan", "communicate", "answer", "summary")
               for a in t["agents"].values() for p in a["parsed"]) for t in traces)

    # MARL starts from the SFT weights and writes new full-model folders
    marl_w, marl_rows = mt.run_marl(0, weights, train_qs, tmp_path / "marl", b, clip_cache, pool)
    assert len(marl_rows) == 1 and marl_rows[0]["episodes/failed"] == 0
    assert -1.0 <= marl_rows[0]["greedy/team_res"] <= 1.0  # the greedy baseline's run, kept as a curve by run_seed
    assert all(p.is_dir() and p != weights[a] for a, p in marl_w.items())

    # the same calls again (a killed run started over): finished stages are reused, nothing is trained or evaluated
    def written(ws):
        return {a: (p / "model.safetensors").stat().st_mtime_ns for a, p in ws.items()}

    before = written(weights), written(marl_w)
    monkeypatch.setattr(mt, "evaluate", lambda *a, **k: pytest.fail("a finished evaluation ran again"))
    assert mt.run_sft(0, examples, tmp_path / "sft", b, clip_cache) == (weights, rows)
    assert mt.evaluate_cached(tmp_path / "sft" / "eval.json", mt.mini_config(0, weights, clip_cache, tiny_clip=True),
                              held_qs, pool) == sft
    assert mt.run_marl(0, weights, train_qs, tmp_path / "marl", b, clip_cache, pool) == (marl_w, marl_rows)
    assert (written(weights), written(marl_w)) == before

    # averaging only post-processes a finished stage: no training again, and the averaged folders are returned
    avg_b = replace(b, overrides_marl=b.overrides_marl + ["average.checkpoints=1"])
    avg_w, avg_rows = mt.run_marl(0, weights, train_qs, tmp_path / "marl", avg_b, clip_cache, pool)
    assert avg_rows == marl_rows and written(marl_w) == before[1]
    assert all(p == tmp_path / "marl" / "average" / "agents" / a / "model" for a, p in avg_w.items())
    from m1.marl.learner import read_safetensors

    for a, p in avg_w.items():  # the mean of one checkpoint is that checkpoint
        got, want = read_safetensors(p, "model"), read_safetensors(marl_w[a], "model")
        assert set(got) == set(want) and all(got[k].equal(want[k]) for k in want)
    assert mt.run_marl(0, weights, train_qs, tmp_path / "marl", b, clip_cache, pool)[0] == marl_w  # off again
    with pytest.raises(FileNotFoundError, match="include_start needs the starting weights"):
        mt.run_marl(0, weights, train_qs, tmp_path / "marl",
                    replace(avg_b, overrides_marl=avg_b.overrides_marl + ["average.include_start=true"]),
                    clip_cache, pool)

    # MARL with LoRA (the paper's setting): adapters on top of the SFT weights are evaluated and exported merged
    monkeypatch.undo()  # evaluations run again from here
    with pytest.raises(ValueError, match="must be 'full'"):
        mt.run_sft(0, examples, tmp_path / "sft_lora", replace(b, overrides_sft=["learner.finetune=lora"]), clip_cache)
    assert not (tmp_path / "sft_lora").exists()
    lora_b = replace(b, overrides_marl=b.overrides_marl + ["learner.finetune=lora", "learner.lr=1e-2"])
    lora_w, _ = mt.run_marl(0, weights, train_qs, tmp_path / "marl_lora", lora_b, clip_cache, pool)
    assert all(p.name == "adapter" and mt.is_adapter(p) for p in lora_w.values())
    team = mt.trained_config(0, weights, lora_w, clip_cache, tiny_clip=True)
    specs = {a.name: team.models[a.model] for a in team.agents}
    assert all(specs[a].path == str(weights[a]) and specs[a].adapter == str(lora_w[a]) for a in lora_w)
    assert mt.evaluate(team, held_qs[:2], pool)["n"] == 2
    monkeypatch.setattr(mt, "final_weights", lambda run_dir, agents, averaged=False:
                        lora_w if run_dir.name == "marl" else weights)  # export reads <out>/seed0/{sft,marl}
    mt.export_weights(tmp_path, 0, tmp_path / "export", averaged=False)
    from m1.models.hf import HFChatModel

    for a in ("qwen3_big", "qwen2_small"):
        exported = read_safetensors(tmp_path / "export" / a, "model")
        merged = HFChatModel(specs[a], a).model.state_dict()
        sft_w = read_safetensors(weights[a], "model")
        assert all(exported[k].equal(merged[k]) for k in exported)
        assert any(not exported[k].equal(sft_w[k]) for k in exported)  # MARL moved the merged weights
    monkeypatch.undo()

    # the table
    results = {"untrained": [untrained], "sft": [sft]}
    table = mt.render_table(results, {"seeds": [0]})
    assert "| mini team, untrained |" in table and "| mini team, SFT |" in table and "| family |" in table
    assert "No claim about the seed spread" in mt.verdict(results)


def test_stage_folder_keeps_its_own_run_and_clears_another(tmp_path, mt):
    run = tmp_path / "sft"
    mt.stage_folder(run, {"lr": 1e-3})
    (run / "checkpoints").mkdir()
    mt.stage_folder(run, {"lr": 1e-3})  # same settings: the trainer will resume from what is there
    assert (run / "checkpoints").is_dir()
    mt.stage_folder(run, {"lr": 3e-4})  # other settings: a stale checkpoint must not be resumed
    assert not (run / "checkpoints").exists()
    assert json.loads((run / "settings.json").read_text()) == {"lr": 3e-4}


def test_stage_folder_of_a_copied_run_keeps_its_finished_stages(tmp_path, mt):
    def settings(root):
        return {"out_dir": f"{root}/seed0/sft", "clip": f"{root}/clip_cache", "lr": 1e-3}

    first, copy = tmp_path / "runs" / "a", tmp_path / "runs" / "a2"  # a2 shares a prefix with a
    mt.stage_folder(first / "seed0" / "sft", settings(first), root=first)
    (first / "seed0" / "sft" / "checkpoints").mkdir()
    assert str(first) not in (first / "seed0" / "sft" / "settings.json").read_text()
    shutil.copytree(first, copy)
    mt.stage_folder(copy / "seed0" / "sft", settings(copy), root=copy)
    assert (copy / "seed0" / "sft" / "checkpoints").is_dir()
    mt.stage_folder(copy / "seed0" / "sft", {**settings(copy), "lr": 3e-4}, root=copy)
    assert not (copy / "seed0" / "sft" / "checkpoints").exists()
    # a marker written with absolute paths (before they were made relative) still counts for its own folder
    legacy = tmp_path / "legacy"
    (legacy / "seed0" / "sft" / "checkpoints").mkdir(parents=True)
    (legacy / "seed0" / "sft" / "settings.json").write_text(json.dumps(settings(legacy), sort_keys=True))
    mt.stage_folder(legacy / "seed0" / "sft", settings(legacy), root=legacy)
    assert (legacy / "seed0" / "sft" / "checkpoints").is_dir()
    assert "<run>/seed0/sft" in (legacy / "seed0" / "sft" / "settings.json").read_text()


def test_evaluations_of_a_copied_run_are_reused(tmp_path, mt, monkeypatch):
    """A `cp -a` copy's evaluations (their keys hold the clip cache's and weights' paths) count as done."""
    calls = []
    monkeypatch.setattr(mt, "evaluate", lambda cfg, qs, *a, **k: calls.append(cfg) or {"accuracy": len(calls)})
    qs = [SimpleNamespace(id="q0"), SimpleNamespace(id="q1")]
    first, copy = tmp_path / "runs" / "a", tmp_path / "runs" / "a2"

    def ev(root, tiny_seed=0, at=None):
        return mt.evaluate_cached(root / "seed0" / "eval_untrained.json",
                                  mt.mini_config(tiny_seed, None, root / "clip_cache", tiny_clip=True), qs, None,
                                  root=at if at is not None else root)

    assert ev(first) == {"accuracy": 1}
    assert str(first) in json.dumps(calls[0].model_dump(mode="json"))  # the key does hold the run's path
    shutil.copytree(first, copy)
    assert ev(copy) == {"accuracy": 1} and len(calls) == 1
    assert ev(copy, tiny_seed=1) == {"accuracy": 2}  # another team is evaluated again
    # a result stored with absolute paths (before keys were relative) still counts for its own folder
    legacy = tmp_path / "legacy"
    ev(legacy, at=Path("/elsewhere"))
    assert ev(legacy) == {"accuracy": 3} and len(calls) == 3


def test_table_reports_mean_std_and_the_seed_spread_verdict(mt):
    def res(acc):
        return {"accuracy": acc, "n": 10, "family": {"order": acc}, "family_n": {"order": 10},
                "parse_ok": {"plan": 1.0}}

    results = {"sft": [res(0.40), res(0.42), res(0.44)], "sft+marl": [res(0.50), res(0.52), res(0.54)]}
    table = mt.render_table(results, {"seeds": [0, 1, 2]})
    assert "| mini team, SFT | 42.0 ± 2.0 | 40.0, 42.0, 44.0 | 100% |" in table
    assert "exceeds" in mt.verdict(results)
    assert "+10.0, +10.0, +10.0 points, +10.0 ± 0.0; 3 of 3 seeds improve" in mt.verdict(results)
    results["sft+marl"] = [res(0.40), res(0.48), res(0.44)]
    assert "does NOT exceed" in mt.verdict(results) and "1 of 3 seeds improve" in mt.verdict(results)


def test_answer_changes_count_fixes_and_breaks_from_traces(tmp_path, mt):
    def traces(name, rows):
        path = tmp_path / name
        path.write_text("\n".join(json.dumps({"id": i, "answer": a, "correct": c}) for i, a, c in rows) + "\n")
        return path

    sft = traces("sft.jsonl", [("q1", "A", True), ("q2", "B", False), ("q3", "C", False), ("q4", "D", True)])
    marl = traces("marl.jsonl", [("q1", "A", True), ("q2", "C", True), ("q3", "D", False), ("q4", "B", False)])
    got = mt.answer_changes(sft, marl)
    assert got == {"n": 4, "changed": 3, "fixed": 1, "broken": 1}
    assert mt.answer_changes(sft, tmp_path / "missing.jsonl") is None
    assert mt.changes_text({"seed0/marl_changes": got, "seed1/marl_changes": None, "seed0/sft_loss": [1.0]}) == [
        "What MARL changed, against the same seed's SFT team: seed0: 3 of 4 team answers changed, 1 wrong → right, "
        "1 right → wrong, gain +0.0 ± 35.4 points (paired standard error; sign test p = 1.00).", ""]
    # per question +1 (34), −1 (16), 0 (450): mean 0.036, variance 50/500 − 0.036², standard error sqrt(var / 500)
    gain, se = mt.paired_gain({"n": 500, "changed": 132, "fixed": 34, "broken": 16})
    assert gain == pytest.approx(3.6) and se == pytest.approx(100 * ((0.1 - 0.036 ** 2) / 500) ** 0.5)
    assert mt.paired_gain({"n": 10, "changed": 0, "fixed": 0, "broken": 0}) == (0.0, 0.0)
    # exact binomial tails: 0 of 5 splits at 2/32; 1 of 10 at 2*11/1024; 53 of 117 near even
    assert mt.sign_test_p(0, 5) == pytest.approx(0.0625) and mt.sign_test_p(9, 1) == pytest.approx(22 / 1024)
    assert mt.sign_test_p(0, 0) == 1.0 and 0.3 < mt.sign_test_p(53, 64) < 0.4
    with pytest.raises(ValueError, match="different questions"):
        mt.answer_changes(sft, traces("other.jsonl", [("q9", "A", True)]))


def test_held_out_world_must_not_repeat_a_training_or_marl_video(tmp_path, mt):
    """The worlds sit in different folders, so the check compares video bytes: the same world seed is refused, for
    SFT's training world and for a separate MARL world alike."""
    b = mt.Budget(**BUDGET)
    train_qs, held_qs = mt.make_sets(tmp_path / "ok", b)
    assert {q.video for q in train_qs}.isdisjoint({q.video for q in held_qs})
    with pytest.raises(ValueError, match=f"same bytes as training video.*seed {b.train_seed}"):
        mt.make_sets(tmp_path / "same", replace(b, eval_seed=b.train_seed))
    assert mt.marl_questions(tmp_path / "ok", replace(b, marl_seed=None), train_qs, held_qs) is train_qs
    fresh = mt.marl_questions(tmp_path / "ok", b, train_qs, held_qs)  # the default: a world of its own
    assert b.marl_seed not in (None, b.train_seed, b.eval_seed)
    from m1.tools.clip_index import file_sha256

    def video_bytes(qs):
        return {file_sha256(v) for v in {q.video for q in qs}}

    assert len(fresh) == len(train_qs) and video_bytes(fresh).isdisjoint(video_bytes(train_qs))
    assert {q.text for q in fresh} != {q.text for q in train_qs}
    with pytest.raises(ValueError, match=f"same bytes as MARL video.*seed {b.eval_seed}"):
        mt.marl_questions(tmp_path / "ok", replace(b, marl_seed=b.eval_seed), train_qs, held_qs)
    assert mt.marl_world_arg("train") == "train" and mt.marl_world_arg("7") == 7
    with pytest.raises(argparse.ArgumentTypeError, match="'seven'"):
        mt.marl_world_arg("seven")


def test_reading_counts_notes_that_name_the_truth(tmp_path, m1_cache, mt):
    """The teacher's browsers end their reports with `##Answer: X`: traces record those letters per agent, and
    `reading` counts how often they held the truth and how often the agent then answered it."""
    from m1.video import VideoPool

    b = mt.Budget(**BUDGET)
    _, held_qs = mt.make_sets(tmp_path / "data", b)
    res = mt.evaluate(mt.teacher_config(0, tmp_path / "clip", tiny_clip=True), held_qs, VideoPool(),
                      traces=tmp_path / "teacher.traces.jsonl")
    traces = [json.loads(line) for line in (tmp_path / "teacher.traces.jsonl").read_text().splitlines()]
    mcq = {q.id for q in held_qs if q.options}
    agents = [(t, a) for t in traces for a in t["agents"].values()]
    assert all((a["notes_letters"] is None) == (t["id"] not in mcq) for t, a in agents)
    noted = [(t, a) for t, a in agents if a["notes_letters"]]
    assert noted and all(set(a["notes_letters"]) <= set("ABCD") for _, a in noted)
    got = mt.reading(tmp_path / "teacher.traces.jsonl")
    majority = sum(Counter(a["notes_letters"]).most_common(1)[0][0] == t["truth"] for t, a in noted)
    assert got == {"answers": sum(t["id"] in mcq for t, _ in agents),
                   "evidence": sum(t["truth"] in a["notes_letters"] for t, a in noted),
                   "read": sum(t["truth"] in a["notes_letters"] and a["correct"] for t, a in noted),
                   "majority": majority}
    assert got["read"] > 0.5 * got["evidence"] > 0 and got["evidence"] >= majority and res["n"] == len(held_qs)
    assert mt.reading_text({"seed0/sft_reading": {"answers": 10, "evidence": 4, "read": 3, "majority": 2},
                            "seed0/marl_reading": None, "seed1/marl_reading": {"answers": 8, "evidence": 8,
                                                                               "read": 2, "majority": 6}}) == [
        "Reading the notes (MCQ; notes are the tool reports an agent sees when it answers): seed0: SFT the truth "
        "in the notes of 4 of 10 agent answers, 75% of those answered right (the letter the notes name most, first "
        "on ties: right for 20% of all) — seed1: MARL the truth in the notes of 8 of 8 agent answers, 25% of those "
        "answered right (the letter the notes name most, first on ties: right for 75% of all).", ""]
    assert mt.reading(tmp_path / "missing.jsonl") is None
    # the teacher's agents write the teacher's key info (wrong plans come from error draws, which keep the key)
    copied = mt.key_info_copied(tmp_path / "teacher.traces.jsonl")
    n_open = sum(q.meta.get("family") == "open" for q in held_qs)
    assert set(copied) == set(traces[0]["agents"])
    assert all(c == {"questions": len(held_qs) - n_open, "copied": len(held_qs) - n_open} for c in copied.values())
    assert mt.key_info_text({"seed0/sft_key_info": {"a": {"questions": 5, "copied": 2}}, "seed0/marl_key_info": None,
                             "seed1/marl_key_info": {"a": {"questions": 5, "copied": 4}}}) == [
        "Key info as the teacher writes it (the question's object, objects or time; open questions excluded), plans "
        "per agent: seed0: SFT a 2/5 — seed1: MARL a 4/5.", ""]
    lines = (tmp_path / "teacher.traces.jsonl").read_text().splitlines()
    first = json.loads(lines[0])
    first["agents"][next(iter(first["agents"]))]["key_info"] = "something else"
    (tmp_path / "one_wrong.jsonl").write_text("\n".join([json.dumps(first)] + lines[1:]) + "\n")
    fewer = mt.key_info_copied(tmp_path / "one_wrong.jsonl")
    assert sum(c["copied"] for c in fewer.values()) == sum(c["copied"] for c in copied.values()) - (
        first["family"] != "open")


def test_full_run_writes_doc_and_results(tmp_path, m1_cache, mt):
    """The whole `run` with only the cheap rows (no training): files and timing are written."""
    b = mt.Budget(**BUDGET)
    doc = tmp_path / "doc.md"
    res = mt.run(tmp_path / "out", b, doc, rows=("untrained", "teacher"))
    text = doc.read_text()
    assert "| teacher team (rule-based) |" in text and "min CPU" in text and "Held-out: " in text
    mt.write_doc(doc, res["table"], {**res["meta"], "budget": {**res["meta"]["budget"], "eval_seed": mt.DEV_SEED}},
                 res["results"])
    assert "Dev (settings are chosen here; not held-out): " in doc.read_text()
    assert "Calls in this folder so far: 1," in text
    saved = json.loads((tmp_path / "out" / "results.json").read_text())
    assert saved["meta"]["n_heldout"] == res["results"]["teacher"][0]["n"] > 0
    assert res["results"]["teacher"][0]["accuracy"] > res["results"]["untrained"][0]["accuracy"]

    # the dev world evaluated in the same folder: its own files, the held-out ones untouched
    held_out = {p: p.read_bytes() for p in (tmp_path / "out").glob("**/*.json*") if p.name != "calls.jsonl"}
    dev = mt.run(tmp_path / "out", mt.Budget(**{**BUDGET, "eval_seed": mt.DEV_SEED}), None, rows=("teacher",))
    assert {p: p.read_bytes() for p in held_out} == held_out
    dev_saved = json.loads((tmp_path / "out" / f"results_world{mt.DEV_SEED}.json").read_text())
    assert dev_saved["results"]["teacher"][0]["accuracy"] == dev["results"]["teacher"][0]["accuracy"]
    assert (tmp_path / "out" / "seed0" / f"eval_world{mt.DEV_SEED}_teacher.traces.jsonl").is_file()
    assert dev_saved["meta"]["n_heldout"] > 0 and dev_saved["results"]["teacher"][0]["family"] != {}
    # every call's cost is logged in the folder, and the totals add up over calls
    calls = [json.loads(line) for line in (tmp_path / "out" / "calls.jsonl").read_text().splitlines()]
    assert [c["world"] for c in calls] == ["held-out", f"_world{mt.DEV_SEED}"]
    assert dev["meta"]["folder_calls"]["calls"] == 2
    assert dev["meta"]["folder_calls"]["wall_seconds"] == pytest.approx(sum(c["wall_seconds"] for c in calls))


@pytest.mark.slow
def test_seeds_in_worker_processes_match_one_process(tmp_path, m1_cache, mt, monkeypatch):
    """--jobs 2: the same per-seed results as running the seeds one after another, workers' CPU time counted."""
    monkeypatch.syspath_prepend(str(REPO / "scripts"))  # spawned workers import the script as `mini_team`
    b = mt.Budget(**{**BUDGET, "seeds": (0, 1)})
    rows = ("untrained", "teacher")
    one = mt.run(tmp_path / "one", b, None, rows=rows, jobs=1)
    two = mt.run(tmp_path / "two", b, None, rows=rows, jobs=2)
    for row in rows:
        assert [r["accuracy"] for r in two["results"][row]] == [r["accuracy"] for r in one["results"][row]]
        assert [r["family"] for r in two["results"][row]] == [r["family"] for r in one["results"][row]]
    assert two["meta"]["jobs"] == 2 and two["meta"]["cpu_seconds"] > 0.5 * one["meta"]["cpu_seconds"]
