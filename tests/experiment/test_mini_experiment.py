"""The mini team's experiment (configs/experiments/mini_team.yaml) with tiny budgets, and the pieces it rests on:
the synth tokenizer of the tiny agents, and the teacher's SFT examples built in worker processes.

These check behaviour (the SFT loss falls, SFT-trained agents write plans in the strict format far more often than
untrained ones, MARL starts from the SFT weights, the report has every row), not the research claim of the full run.
"""
import json
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from m1.cli import app

REPO = Path(__file__).resolve().parents[2]
AGENTS = ["qwen3_big", "qwen3_small", "qwen2_big", "qwen2_small"]
# the random CLIP of configs/team/tiny.yaml: the synth worlds' trained CLIP costs minutes on first use
TINY_CLIP = "models.clip=" + json.dumps({"interface": "clip", "backend": "open_clip", "device": "cpu", "tiny": {
    "arch": "open_clip", "hidden_size": 64, "layers": 2, "image_size": 64, "seed": 6}})


# ------------------------------------------------------------------------------------------------ tokenizer
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


# ------------------------------------------------------------------------------------------------ teacher data
def _teacher_overrides(sft_config: str = "mini") -> str:
    """The SFT config's teacher overrides plus the tiny CLIP."""
    from m1.marl.config import load_sft_config

    return "data.teacher_overrides=" + json.dumps(list(load_sft_config(sft_config).data.teacher_overrides)
                                                  + [TINY_CLIP])


@pytest.mark.slow
def test_teacher_data_in_worker_processes_equals_one_process_and_is_reused(tmp_path, m1_cache, monkeypatch):
    """`data.workers=2`: shards of whole videos built in two spawned workers give the single process's examples and
    stats, in its order. The examples file is then reused for the same data settings and built again for others (a
    stale file must not be trained on)."""
    from m1.marl import sft
    from m1.marl.config import load_sft_config
    from m1.marl.rollout.stream import load_questions
    from m1.synth.make import make_dataset

    world = tmp_path / "world"
    make_dataset(world, videos=2, seed=1, duration=60, questions_per_video=3, progress=False)
    qs = load_questions(str(world / "questions.jsonl"), str(world))
    shards = sft.video_shards(qs, 2)
    assert [len({q.video for q in s}) for s in shards] == [1, 1] and sum(shards, []) == qs
    assert sft.video_shards(qs, 5) == shards  # never more shards than videos

    def cfg(name, workers, *more):
        return load_sft_config("mini", [f"data.questions={world / 'questions.jsonl'}", f"data.video_dir={world}",
                                        f"data.examples={tmp_path / name}", f"data.workers={workers}",
                                        _teacher_overrides(), "log.progress=false", f"out_dir={tmp_path / 'sft'}",
                                        *more])

    one, one_stats = sft.prepare_examples(cfg("one.jsonl", 1), progress=lambda _: None)
    two, two_stats = sft.prepare_examples(cfg("two.jsonl", 2), progress=lambda _: None)
    assert len(one) > 0 and two == one and two_stats == one_stats
    assert one_stats["by_phase"] == {ph: sum(e.phase == ph for e in one) for ph in one_stats["by_phase"]}
    assert one_stats["thinned_communicate"] >= 0 and one_stats["data"]["communicate_per_episode"] == 1
    assert {e.agent for e in one} <= set(AGENTS) and {"plan", "answer"} <= {e.phase for e in one}
    assert sft.read_examples(tmp_path / "two.jsonl") == one

    with monkeypatch.context() as m:  # the same settings: read back, the teacher never runs
        m.setattr(sft, "build_sft_data", lambda *a, **k: pytest.fail("rebuilt with the same settings"))
        again, again_stats = sft.prepare_examples(cfg("one.jsonl", 1), progress=lambda _: None)
        assert again == one and again_stats == one_stats
        m.setattr(sft, "build_sft_data", lambda *a, **k: (_ for _ in ()).throw(RuntimeError("rebuild")))
        said = []
        with pytest.raises(RuntimeError, match="rebuild"):
            sft.prepare_examples(cfg("one.jsonl", 1, "data.rotate_options=false"), progress=said.append)
        assert any("built with other data settings (rotate_options)" in s for s in said)
        assert one_stats["data"]["teacher_code"] == sft.synth_teacher_code()  # the synth teacher's code, hashed
        m.setattr(sft, "synth_teacher_code", lambda: "edited")  # its rules edited: the same settings, other replies
        said.clear()
        with pytest.raises(RuntimeError, match="rebuild"):
            sft.prepare_examples(cfg("one.jsonl", 1), progress=said.append)
        assert any("built with other data settings (teacher_code)" in s for s in said)


# ------------------------------------------------------------------------------------------------ the experiment
def test_plan_of_the_mini_team_experiment(tmp_path, monkeypatch):
    """The four rows as arms: SFT runs once per seed (in `sft`'s folder), `untrained` and `teacher` only answer; seed
    k shifts the untrained weights and the teacher's error draws; --plan runs and writes nothing."""
    from m1.experiment.config import load_experiment
    from m1.experiment.stages import init_seat

    monkeypatch.chdir(tmp_path)  # out_dir and the worlds are relative: nothing may appear there
    res = CliRunner().invoke(app, ["experiment", "run", "mini_team", "--plan"])
    assert res.exit_code == 0, res.output
    assert "arms ['untrained', 'sft', 'sft_marl', 'teacher']; seeds [0, 1, 2]; 21 stage runs" in res.output
    assert "== sft / arm sft_marl: the same as arm sft's, run once ==" in res.output
    assert not (tmp_path / "runs").exists()
    exp = load_experiment("mini_team")
    assert exp.base_arm == "sft" and exp.arm_stages("untrained") == ["eval"]
    assert init_seat(exp, "untrained", 0) == init_seat(exp, "teacher", 0) == []
    assert init_seat(exp, "untrained", 2) == init_seat(exp, "sft", 2) == [
        f"models.{a}.tiny.seed={s + 2000}" for a, s in zip(AGENTS, (11, 12, 13, 14))]
    assert init_seat(exp, "teacher", 1) == [f"models.teacher_{c}.seed={s + 1000}" for c, s in zip("abcd", (1, 2, 3, 4))]


def _mini_experiment(tmp_path, name: str = "mini_team", sft_config: str = "mini") -> Path:
    """configs/experiments/<name>.yaml on tiny budgets: one seed; 1-video worlds of 8 questions; SFT 80 steps of
    16 examples; one MARL step of 2 rollouts of 1 question; the tiny CLIP everywhere."""
    spec = yaml.safe_load((REPO / "configs" / "experiments" / f"{name}.yaml").read_text())
    w = {name: tmp_path / name for name in ("train", "marl_world", "test")}
    clip = ["tools.clip_cache_dir=" + str(tmp_path / "clip_cache"), TINY_CLIP]
    spec.update(out_dir=str(tmp_path / "exp"), seeds=[0])
    spec["data"]["worlds"] = [{"out": str(w[name]), "videos": 1, "seed": seed, "duration": 60,
                               "questions_per_video": 8}
                              for name, seed in (("train", 1), ("marl_world", 5), ("test", 1001))]
    spec["sft"]["overrides"] = [f"data.questions={w['train'] / 'questions.jsonl'}", f"data.video_dir={w['train']}",
                                f"data.examples={tmp_path / 'sft_examples.jsonl'}", "data.workers=1",
                                _teacher_overrides(sft_config), "max_steps=80", "batch_size=16", "learner.micro_batch_size=16",
                                "log.progress=false"]
    spec["marl"]["overrides"] = [f"data.questions={w['marl_world'] / 'questions.jsonl'}",
                                 f"data.video_dir={w['marl_world']}", "steps=1", "rollout.num_generations=2",
                                 "rollout.questions_per_step=1", "log.progress=false",
                                 "team_overrides=" + json.dumps(clip)]  # the SFT seat is added by the experiment
    spec["eval"].update(questions=str(w["test"] / "questions.jsonl"), video_dir=str(w["test"]), overrides=clip)
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    return path


def _traces(folder: Path) -> list[dict]:
    """The episodes an eval stage traced (<stage>/traces/<question>.json)."""
    eps = [json.loads(p.read_text()) for p in sorted((folder / "traces").glob("*.json"))]
    return [e for e in eps if isinstance(e, dict) and "generations" in e]


def _strict_plans(folder: Path) -> float:
    plans = [g["parse_ok"] for e in _traces(folder) for g in e["generations"] if g["phase"] == "plan"]
    assert plans, folder
    return sum(plans) / len(plans)


@pytest.mark.slow
def test_mini_team_experiment_with_tiny_budgets(tmp_path, m1_cache):
    from m1.experiment.config import load_experiment
    from m1.experiment.export import export_agents
    from m1.experiment.report import write_report
    from m1.experiment.runner import run_experiment
    from m1.experiment.stages import read_stage

    exp = load_experiment(_mini_experiment(tmp_path))
    assert exp.eval.traces is True  # plan formats are read from the traces
    assert list(exp.arms) == ["untrained", "sft", "sft_marl", "teacher"] and exp.base_arm == "sft"
    assert exp.owner("sft_marl", "sft") == "sft"
    run_experiment(exp, progress=lambda _: None)
    out = tmp_path / "exp"
    held = [json.loads(x) for x in (tmp_path / "test" / "questions.jsonl").read_text().splitlines()]
    stats = json.loads((tmp_path / "sft_examples.jsonl.stats.json").read_text())
    assert stats["kept"] > 0 and read_stage(out / "data")["sft_examples"][str(tmp_path / "sft_examples.jsonl")]

    # SFT: the loss falls, and plans parse far more often than with the same random weights untrained
    sft_rows = [json.loads(x) for x in (out / "sft" / "seed0" / "sft" / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in sft_rows if "loss" in r]
    assert len(losses) == 80 and sum(losses[-5:]) / 5 < 0.5 * sum(losses[:5]) / 5, losses
    untrained, sft = _strict_plans(out / "untrained" / "seed0" / "eval"), _strict_plans(out / "sft" / "seed0" / "eval")
    assert untrained < 0.05, untrained  # random weights: no plan in the strict format
    assert sft > untrained + 0.25, (untrained, sft)
    assert len(_traces(out / "sft" / "seed0" / "eval")) == len(held)
    base = read_stage(out / "untrained" / "seed0" / "eval")["resolved"]["models"]
    sft_start = read_stage(out / "sft" / "seed0" / "sft")["resolved"]
    assert [base[a]["tiny"]["seed"] for a in AGENTS] == [11, 12, 13, 14] and sft_start["team_overrides"] == []

    # MARL starts from the SFT weights; the sft_marl row answers with MARL's
    sft_ckpt = read_stage(out / "sft" / "seed0" / "sft")["results"]["checkpoint"]
    marl = read_stage(out / "sft_marl" / "seed0" / "marl")
    for a in AGENTS:
        assert f"models.{a}.path={sft_ckpt}/agents/{a}/model" in marl["resolved"]["team_overrides"]
        assert (f"models.{a}.path={marl['results']['checkpoint']}/agents/{a}/model"
                in read_stage(out / "sft_marl" / "seed0" / "eval")["overrides"])
    marl_metrics = out / "sft_marl" / "seed0" / "marl" / "metrics.jsonl"
    marl_rows = [json.loads(x) for x in marl_metrics.read_text().splitlines()]
    assert len(marl_rows) == 1 and marl_rows[0]["episodes/failed"] == 0
    assert read_stage(out / "teacher" / "seed0" / "eval")["config"] == "synth_teacher"

    # the report: all four rows, answer changes against SFT as the results files give them
    rep = write_report(exp)
    results = {arm: {r["id"]: r for r in map(json.loads, (out / arm / "seed0" / "eval" / "results.jsonl")
                                             .read_text().splitlines())} for arm in exp.arms}
    acc = {arm: sum(bool(r["correct"]) for r in rows.values()) / len(rows) for arm, rows in results.items()}
    assert all(len(rows) == len(held) for rows in results.values())
    for arm in exp.arms:
        assert f"| {arm} | {100 * acc[arm]:.1f} ± n/a |" in rep["text"]
    assert acc["teacher"] > acc["untrained"]
    assert [c["arm"] for c in rep["changes"]] == ["untrained", "sft_marl", "teacher"]
    for c in rep["changes"]:
        mine, ref = results[c["arm"]], results["sft"]
        assert c["fixed"] == sum(mine[i]["correct"] and not ref[i]["correct"] for i in ref)
        assert c["broken"] == sum(ref[i]["correct"] and not mine[i]["correct"] for i in ref)
        assert c["changed"] == sum(mine[i]["answer"] != ref[i]["answer"] for i in ref)
    assert [p.name for p in rep["plots"]] == ["sft.png", "sft_marl.png"]
    assert list(rep["formats"]) == list(exp.arms)
    assert rep["formats"]["untrained"]["plan"] == pytest.approx(untrained)
    assert rep["formats"]["sft"]["plan"] == pytest.approx(sft) and rep["formats"]["teacher"]["plan"] == 1.0
    assert f"| sft | {100 * sft:.0f} |" in rep["text"]

    # the `make demo` team's weights: sft_marl's agents, written as plain model folders
    res = CliRunner().invoke(app, ["experiment", "export", str(tmp_path / "mini_team.yaml"),
                                   str(tmp_path / "assets"), "--arm", "sft_marl"])
    assert res.exit_code == 0, res.output
    assert sorted(p.name for p in (tmp_path / "assets").iterdir()) == sorted(AGENTS + ["SOURCE.md"])
    with pytest.raises(ValueError, match="arm untrained runs no training stage"):
        export_agents(exp, "untrained", 0, tmp_path / "nothing", progress=lambda _: None)


@pytest.mark.slow
def test_weak_plan_experiment_with_tiny_budgets(tmp_path, m1_cache):
    """configs/experiments/mini_weakplan.yaml, quick: the weak-plan teacher's plans are spread over the valid pairs
    and kept whatever the outcome, both MARL arms start from the one SFT, the plans-only arm trains plans only."""
    from collections import Counter

    from m1.experiment.config import load_experiment
    from m1.experiment.report import write_report
    from m1.experiment.runner import run_experiment
    from m1.experiment.stages import read_stage
    from m1.marl.sft import read_examples

    exp = load_experiment(_mini_experiment(tmp_path, "mini_weakplan", "mini_weakplan"))
    assert list(exp.arms) == ["sft", "untrained", "sft_marl", "sft_marl_plans", "teacher"]
    assert exp.owner("sft_marl_plans", "sft") == exp.owner("sft_marl", "sft") == "sft"
    run_experiment(exp, progress=lambda _: None)
    out = tmp_path / "exp"
    examples = read_examples(tmp_path / "sft_examples.jsonl")
    stats = json.loads((tmp_path / "sft_examples.jsonl.stats.json").read_text())
    plans = [e for e in examples if e.phase == "plan"]
    assert len(plans) == stats["episodes"] * 4  # every agent's plan of every episode, right or wrong
    assert stats["data"]["plan_filter"] == "all"
    pairs = Counter(e.completion.split("##tool use: ")[1] for e in plans)
    assert len(pairs) >= 10, pairs  # 8 questions x 4 rollouts x 4 agents over 16 pairs
    plans_only = read_stage(out / "sft_marl_plans" / "seed0" / "marl")["resolved"]["rollout"]["train_phases"]
    assert plans_only == ["plan"]
    assert read_stage(out / "sft_marl" / "seed0" / "marl")["resolved"]["rollout"]["train_phases"] == [
        "plan", "communicate", "answer", "summary"]
    rows = [json.loads(x) for x in (out / "sft_marl_plans" / "seed0" / "marl" / "metrics.jsonl").read_text()
            .splitlines()]
    assert len(rows) == 1 and rows[0]["episodes/failed"] == 0
    rep = write_report(exp)
    for arm in exp.arms:
        assert f"| {arm} | " in rep["text"]
    assert [c["arm"] for c in rep["changes"]] == ["untrained", "sft_marl", "sft_marl_plans", "teacher"]
    # the greedy team's result per MARL step (the report's training curve), and every plan chosen, per arm
    assert isinstance(rows[0]["greedy/team_res"], float)
    assert [p.name for p in rep["plots"]] == ["sft.png", "sft_marl.png", "sft_marl_plans.png"]
    chosen = (out / "plans.csv").read_text().splitlines()
    assert {line.split(",")[0] for line in chosen[1:]} == set(exp.arms)
    shares = {}
    for line in chosen[1:]:
        arm, fam, _, share = line.split(",")[:4]
        shares[(arm, fam)] = shares.get((arm, fam), 0.0) + float(share)
    assert all(abs(v - 1.0) < 1e-9 for v in shares.values()), shares
