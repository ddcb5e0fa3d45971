"""`m1 experiment`: stages x arms x seeds on tiny models end to end, skipping finished stages after a kill, the
report's numbers against the eval results files, `--plan` on the paper's experiment, and config errors."""
import csv
import json
import math
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from tests.conftest import make_video
from m1.cli import app
from m1.config_files import ConfigError
from m1.experiment.config import load_experiment
from m1.experiment.stats import paired, t_quantile_975
from m1.marl.sft import write_examples
from m1.team.engines_registry import TEAM_KINDS, KindSpec
from tests.marl.test_sft import EXAMPLES
from tests.marl.test_trainer import team_dict

runner = CliRunner()


def _write(path, data):
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def tiny_experiment(tmp_path):
    """Two arms (full; LoRA in SFT and MARL) x one seed; one SFT step, one MARL step, four eval questions."""
    video = make_video(tmp_path / "videos" / "v.mp4", seconds=6, fps=2)
    team = _write(tmp_path / "team.yaml", team_dict())
    write_examples(tmp_path / "examples.jsonl", EXAMPLES)
    families = ["colour", "colour", "count", "scene"]
    qs = [{"id": f"q{i}", "video": "v.mp4", "text": f"What colour is the square in scene {i}?",
           "options": ["white", "red"], "task": "mcq", "answer": "AB"[i % 2], "meta": {"family": fam}}
          for i, fam in enumerate(families)]
    (tmp_path / "questions.jsonl").write_text("".join(json.dumps(q) + "\n" for q in qs))
    log = {"progress": False, "backends": []}
    sft = _write(tmp_path / "sft.yaml", {
        "name": "tiny_sft", "team": str(team), "data": {"examples": str(tmp_path / "examples.jsonl")},
        "learner": {"finetune": "full", "lr": 1e-2, "micro_batch_size": 4, "max_completion_tokens": 16},
        "batch_size": 4, "max_steps": 1, "checkpoint": {"every": 1}, "log": log})
    marl = _write(tmp_path / "marl.yaml", {
        "name": "tiny_marl", "team": str(team),
        "data": {"questions": str(tmp_path / "questions.jsonl"), "video_dir": str(video.parent)},
        "rollout": {"num_generations": 2, "questions_per_step": 2}, "grpo": {"beta": 0.0},
        "judge": {"method": "rubric"}, "steps": 1, "checkpoint": {"every": 1, "keep_last": 1}, "log": log,
        "learner": {"finetune": "full", "lr": 1e-2, "micro_batch_size": 4, "max_completion_tokens": 16}})
    return _write(tmp_path / "exp.yaml", {
        "name": "tiny", "out_dir": str(tmp_path / "exp"), "seeds": [0],
        "sft": {"config": str(sft)}, "marl": {"config": str(marl)},
        "eval": {"team": str(team), "questions": str(tmp_path / "questions.jsonl"), "video_dir": str(video.parent)},
        "arms": {"full": None, "lora": {"sft": ["learner.finetune=lora"], "marl": ["learner.finetune=lora"]}}})


def _count(monkeypatch, module, name, calls, fail_on=None):
    import importlib

    mod = importlib.import_module(module)
    original = getattr(mod, name)

    def wrapped(*args, **kw):
        calls.append(name)
        if fail_on is not None and calls.count(name) == fail_on:
            raise RuntimeError(f"killed in {name}")
        return original(*args, **kw)

    monkeypatch.setattr(mod, name, wrapped)


@pytest.mark.slow
def test_experiment_runs_skips_finished_stages_and_reports(tmp_path, m1_cache, monkeypatch):
    from m1.experiment.report import write_report
    from m1.experiment.runner import run_experiment
    from m1.experiment.stages import read_stage

    exp = load_experiment(tiny_experiment(tmp_path))
    out = tmp_path / "exp"
    # 1. killed in the first MARL stage, after the first arm's SFT finished
    calls: list[str] = []
    with monkeypatch.context() as m:
        _count(m, "m1.marl.sft", "sft_main", calls)
        _count(m, "m1.marl.launch", "train_main", calls, fail_on=1)
        with pytest.raises(RuntimeError, match="killed in train_main"):
            run_experiment(exp, progress=lambda _: None)
    assert calls == ["sft_main", "train_main"]
    assert read_stage(out / "full" / "seed0" / "sft") is not None
    assert read_stage(out / "full" / "seed0" / "marl") is None
    # 2. the rerun repeats no finished stage: SFT of the first arm is skipped
    calls = []
    printed: list[str] = []
    with monkeypatch.context() as m:
        _count(m, "m1.marl.sft", "sft_main", calls)
        _count(m, "m1.marl.launch", "train_main", calls)
        _count(m, "m1.run", "run_questions", calls)
        records = run_experiment(exp, progress=printed.append)
    assert calls == ["train_main", "run_questions", "sft_main", "train_main", "run_questions"]
    assert any("full seed0 sft: done before" in p for p in printed)
    assert [(r["arm"], r["stage"]) for r in records] == [
        ("full", "sft"), ("full", "marl"), ("full", "eval"), ("lora", "sft"), ("lora", "marl"), ("lora", "eval")]
    # 3. a third run has nothing left to do
    calls = []
    with monkeypatch.context() as m:
        _count(m, "m1.marl.sft", "sft_main", calls)
        _count(m, "m1.marl.launch", "train_main", calls)
        _count(m, "m1.run", "run_questions", calls)
        run_experiment(exp, progress=lambda _: None)
    assert calls == []

    # chaining: MARL starts from its arm's SFT weights, eval answers with MARL's
    full_sft = read_stage(out / "full" / "seed0" / "sft")
    full_marl, full_eval = read_stage(out / "full" / "seed0" / "marl"), read_stage(out / "full" / "seed0" / "eval")
    sft_model = f"models.qa.path={full_sft['results']['checkpoint']}/agents/alpha/model"
    assert sft_model in full_marl["resolved"]["team_overrides"]
    assert f"models.qa.path={full_marl['results']['checkpoint']}/agents/alpha/model" in full_eval["overrides"]
    assert full_eval["resolved"]["models"]["qa"]["path"].startswith(str(out / "full" / "seed0" / "marl"))
    assert full_marl["resolved"]["seed"] == 0 and full_marl["resolved"]["out_dir"] == str(out / "full/seed0/marl")
    # LoRA after LoRA: SFT's adapters merged into whole models, MARL's adapter on top of them
    lora_eval = read_stage(out / "lora" / "seed0" / "eval")
    qa = lora_eval["resolved"]["models"]["qa"]
    assert qa["path"] == str(out / "lora" / "seed0" / "sft" / "merged" / "alpha")
    assert qa["adapter"].startswith(str(out / "lora" / "seed0" / "marl")) and qa["adapter"].endswith("alpha/adapter")

    # the report: every number from the eval stages' results files
    rep = write_report(exp)
    fam = {f"q{i}": f for i, f in enumerate(["colour", "colour", "count", "scene"])}
    acc = {}
    for arm in ("full", "lora"):
        rows = [json.loads(x) for x in (out / arm / "seed0" / "eval" / "results.jsonl").read_text().splitlines()]
        assert sorted(r["id"] for r in rows) == ["q0", "q1", "q2", "q3"]
        acc[(arm, "all")] = sum(bool(r["correct"]) for r in rows) / len(rows)
        for f in ("colour", "count", "scene"):
            mine = [bool(r["correct"]) for r in rows if fam[r["id"]] == f]
            acc[(arm, f)] = sum(mine) / len(mine)
    table = list(csv.DictReader((out / "report.csv").open()))
    assert [(r["arm"], r["family"]) for r in table] == [
        (a, f) for a in ("full", "lora") for f in ("all", "colour", "count", "scene")]
    for r in table:
        assert float(r["mean"]) == pytest.approx(acc[(r["arm"], r["family"])])
        assert r["seeds"] == "0" and math.isnan(float(r["sd"]))
        if r["arm"] == "lora":
            diff = acc[("lora", r["family"])] - acc[("full", r["family"])]
            assert float(r["diff_mean"]) == pytest.approx(diff) and float(r["diff"]) == pytest.approx(diff)
            assert math.isnan(float(r["diff_low"]))  # one seed: no interval
    md = (out / "report.md").read_text()
    assert f"| full | {100 * acc[('full', 'all')]:.1f} ± n/a |" in md
    assert "| n/a |" in md  # the interval column with one seed
    assert [p.name for p in rep["plots"]] == ["full.png", "lora.png"]
    assert all(p.stat().st_size > 1000 for p in rep["plots"])


def test_plan_of_the_paper_experiment_runs_nothing(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # out_dir is relative: nothing may appear there
    res = runner.invoke(app, ["experiment", "run", "lora_vs_full", "--plan", "--gpus", "24", "--gpu-mem", "80"])
    assert res.exit_code == 0, res.output
    out = res.output
    assert "stages sft -> marl -> eval; arms ['lora', 'full']; seeds [0, 1, 2]; 18 stage runs" in out
    assert "full seed2 eval" in out and "to run" in out
    for stage, arm, gpus in (("sft", "lora", 8), ("sft", "full", 13), ("marl", "lora", 8), ("marl", "full", 15)):
        assert f"== {stage} / arm {arm} (videochat_m1_lora" in out
        assert f"{gpus} GPUs needed of 24" in out
    assert "time: not estimated (no step time measured yet); 15 GPUs per run x 3 seeds, 200 steps each" in out
    assert out.count("fits: yes") == 4
    assert not (tmp_path / "runs").exists()


def test_experiment_config_errors(tmp_path):
    base = {"name": "x", "out_dir": str(tmp_path / "o"), "eval": {"team": "tiny", "questions": "q.jsonl"},
            "arms": {"a": None}}
    bad = _write(tmp_path / "bad.yaml", {**base, "seed": [0]})
    with pytest.raises(ConfigError, match=r"bad.yaml: unknown key 'seed'"):
        load_experiment(bad)
    arm = _write(tmp_path / "arm.yaml", {**base, "arms": {"a": {"marl": ["steps=1"], "sfx": []}}})
    with pytest.raises(ConfigError, match=r"arm.yaml: unknown key 'arms.a.sfx'"):
        load_experiment(arm)
    absent = _write(tmp_path / "absent.yaml", {**base, "arms": {"a": {"marl": ["steps=1"]}}})
    with pytest.raises(ConfigError, match=r"arms.a.marl: overrides for a stage the experiment does not have"):
        load_experiment(absent)
    res = runner.invoke(app, ["experiment", "run", str(bad)])
    assert res.exit_code == 2 and "unknown key 'seed'" in res.output
    # an arm override naming an unknown key of its stage's config fails before anything runs
    from m1.experiment.runner import run_experiment

    exp = load_experiment(_write(tmp_path / "typo.yaml", {
        **base, "marl": {"config": "mini"}, "arms": {"a": None, "b": {"marl": ["learner.finetun=lora"]}}}))
    with pytest.raises(ConfigError, match=r"arm 'b', stage marl: override 'learner.finetun=lora': unknown key 'learner.finetun'; "
                       r"the override applies to .*mini.yaml"):
        run_experiment(exp, progress=lambda _: None)
    assert not (tmp_path / "o").exists()


def test_report_statistics_from_result_files(tmp_path):
    """Three seeds x two arms of finished eval stages (as the runner writes them): mean, sd, paired differences and
    their t interval in report.csv are those of the files' rows."""
    from m1.experiment.report import write_report
    from m1.experiment.stages import STAGE_FILE

    fams = ["a", "a", "b", "b", "b"]
    (tmp_path / "q.jsonl").write_text("".join(json.dumps(
        {"id": f"q{i}", "video": "v.mp4", "text": "?", "task": "mcq", "options": ["x", "y"], "answer": "A",
         "meta": {"family": f}}) + "\n" for i, f in enumerate(fams)))
    exp = load_experiment(_write(tmp_path / "e.yaml", {
        "name": "stats", "out_dir": str(tmp_path / "out"), "seeds": [0, 1, 2],
        "eval": {"team": "tiny", "questions": str(tmp_path / "q.jsonl")}, "arms": {"base": None, "new": {"eval": ["limits.max_turns=2"]}}}))
    right = {("base", 0): {0, 2}, ("base", 1): {0, 1, 2}, ("base", 2): {3},
             ("new", 0): {0, 1, 2, 3}, ("new", 1): {0, 2, 3, 4}, ("new", 2): {1, 3}}
    for (arm, seed), ok in right.items():
        folder = exp.stage_dir(arm, seed, "eval")
        folder.mkdir(parents=True)
        rows = [{"id": f"q{i}", "answer": "A", "correct": i in ok} for i in range(5)]
        rows.append({"id": "q9", "answer": "A"})  # no ground truth: not graded, not counted
        (folder / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        (folder / STAGE_FILE).write_text(json.dumps({"results": {"results": str(folder / "results.jsonl")}}))
    write_report(exp)
    table = {(r["arm"], r["family"]): r for r in csv.DictReader((tmp_path / "out" / "report.csv").open())}

    def acc(arm, seed, fam):
        ids = [i for i, f in enumerate(fams) if fam in ("all", f)]
        return sum(i in right[(arm, seed)] for i in ids) / len(ids)

    for arm in ("base", "new"):
        for fam in ("all", "a", "b"):
            xs = [acc(arm, s, fam) for s in (0, 1, 2)]
            m = sum(xs) / 3
            sd = math.sqrt(sum((x - m) ** 2 for x in xs) / 2)
            r = table[(arm, fam)]
            assert [float(x) for x in r["accuracy"].split(";")] == pytest.approx(xs)
            assert (float(r["mean"]), float(r["sd"])) == pytest.approx((m, sd))
    for fam in ("all", "a", "b"):
        d = [acc("new", s, fam) - acc("base", s, fam) for s in (0, 1, 2)]
        m = sum(d) / 3
        half = 4.302653 * math.sqrt(sum((x - m) ** 2 for x in d) / 2) / math.sqrt(3)
        r = table[("new", fam)]
        assert (float(r["diff_mean"]), float(r["diff_low"]), float(r["diff_high"])) == pytest.approx(
            (m, m - half, m + half), abs=1e-6)
    # all: base 0.4, 0.6, 0.2 -> 40.0 +- 20.0; new 0.8, 0.8, 0.4 -> paired +0.4, +0.2, +0.2
    md = (tmp_path / "out" / "report.md").read_text()
    assert "| base | 40.0 ± 20.0 |" in md and "| new | all | seed0: +40.0, seed1: +20.0, seed2: +20.0 | +26.7 ± 6.7 |" in md


def test_paired_interval_uses_student_t():
    assert t_quantile_975(1) == pytest.approx(12.706, abs=1e-3)
    assert t_quantile_975(2) == pytest.approx(4.303, abs=1e-3)
    assert t_quantile_975(30) == pytest.approx(2.042, abs=1e-3)
    m, lo, hi = paired([0.1, 0.2, 0.3])
    assert m == pytest.approx(0.2) and hi - m == pytest.approx(4.303 * 0.1 / math.sqrt(3), abs=1e-4)
    assert math.isnan(paired([0.1])[1])


@pytest.mark.slow
def test_shared_and_skipped_stages_data_stage_and_seeds_in_worker_processes(tmp_path, m1_cache):
    """Arms that agree up to a stage run it once (in the first one's folder); an arm runs only its `stages` (a
    reference team via `eval_team`); the data stage renders its worlds and refuses eval videos a training stage
    uses; seed 1 starts from other tiny weights; two seeds in two worker processes give the records of one."""
    from m1.experiment.config import ExperimentError
    from m1.experiment.runner import run_experiment
    from m1.experiment.stages import read_stage, stage_runs

    path = tiny_experiment(tmp_path)
    spec = yaml.safe_load(path.read_text())
    spec["seeds"] = [0, 1]
    spec["data"] = {"worlds": [{"out": str(tmp_path / "world"), "videos": 1, "seed": 3, "duration": 30,
                                "questions_per_video": 2}]}
    spec["arms"] = {"full": None, "lora_marl": {"marl": ["learner.finetune=lora"]},
                    "sft_only": {"stages": ["sft", "eval"]}, "base": {"stages": ["eval"]},
                    "reference": {"stages": ["eval"], "eval_team": spec["eval"]["team"]}}
    # the eval questions on the MARL video: refused by the data stage, before any training
    exp = load_experiment(_write(tmp_path / "same.yaml", spec))
    with pytest.raises(ExperimentError, match=r"eval video .*v.mp4 has the same bytes as training video"):
        run_experiment(exp, progress=lambda _: None)
    assert (tmp_path / "world" / "questions.jsonl").is_file()  # rendered first
    assert not (tmp_path / "exp" / "full").exists()

    held = make_video(tmp_path / "held" / "w.mp4", seconds=4, fps=2)
    qs = [json.loads(x) | {"video": "w.mp4"} for x in (tmp_path / "questions.jsonl").read_text().splitlines()]
    (tmp_path / "held.jsonl").write_text("".join(json.dumps(q) + "\n" for q in qs))
    spec["eval"].update(questions=str(tmp_path / "held.jsonl"), video_dir=str(held.parent))
    exp = load_experiment(_write(tmp_path / "exp.yaml", spec))
    out = tmp_path / "exp"
    assert exp.owner("lora_marl", "sft") == exp.owner("sft_only", "sft") == "full"
    assert exp.owner("lora_marl", "marl") == "lora_marl" and exp.owner("sft_only", "eval") == "sft_only"
    assert exp.owner("base", "eval") == "base" and exp.owner("reference", "eval") == "reference"
    runs = stage_runs(exp)
    assert [(r.arm, r.stage) for r in runs if r.seed == 0] == [
        ("full", "sft"), ("full", "marl"), ("full", "eval"), ("lora_marl", "sft"), ("lora_marl", "marl"),
        ("lora_marl", "eval"), ("sft_only", "sft"), ("sft_only", "eval"), ("base", "eval"), ("reference", "eval")]
    printed: list[str] = []
    records = run_experiment(exp, progress=printed.append, jobs=2)
    assert read_stage(out / "data")["held_out_check"] == "1 eval videos share no bytes with 1 training videos"
    assert "2 seeds in 2 worker processes" in printed[-1] and (out / "logs" / "seed1.log").is_file()
    assert [(r["arm"], r["seed"], r["stage"]) for r in records] == [
        (exp.owner(r.arm, r.stage), r.seed, r.stage) for r in runs]
    # one SFT per seed, in full's folder; nothing written for the shared or skipped stages
    assert sorted(p.name for p in (out / "lora_marl" / "seed0").iterdir()) == ["eval", "marl"]
    assert sorted(p.name for p in (out / "sft_only" / "seed0").iterdir()) == ["eval"]
    assert sorted(p.name for p in (out / "base" / "seed0").iterdir()) == ["eval"]
    sft0, sft1 = read_stage(out / "full" / "seed0" / "sft"), read_stage(out / "full" / "seed1" / "sft")
    assert "models.qa.tiny.seed" not in json.dumps(sft0["overrides"])
    assert sft0["gpus"] == 0 and sft0["gpu_hours"] == 0 and sft0["wall_s"] > 0  # a CPU: wall time, no GPU-hours
    tiny_seed = team_dict()["models"]["qa"]["tiny"]["seed"]
    assert f"models.qa.tiny.seed={tiny_seed + 1000}" in sft1["resolved"]["team_overrides"]
    assert sft1["resolved"]["team_overrides"] != sft0["resolved"]["team_overrides"]
    # seated weights: the shared SFT under both MARL arms and sft_only's eval; base and reference untrained
    sft_model = f"models.qa.path={sft0['results']['checkpoint']}/agents/alpha/model"
    assert sft_model in read_stage(out / "lora_marl" / "seed0" / "marl")["resolved"]["team_overrides"]
    assert sft_model in read_stage(out / "sft_only" / "seed0" / "eval")["overrides"]
    base = read_stage(out / "base" / "seed0" / "eval")
    assert base["resolved"]["models"]["qa"]["tiny"]["seed"] == tiny_seed and base["overrides"][0] == "sampling.seed=0"
    # an arm that trains nothing is evaluated at seed 1 with the weights seed 1's training starts from
    assert read_stage(out / "base" / "seed1" / "eval")["resolved"]["models"]["qa"]["tiny"]["seed"] == tiny_seed + 1000
    assert read_stage(out / "reference" / "seed1" / "eval")["config"] == spec["eval"]["team"]
    # a rerun in one process finds everything done
    printed = []
    run_experiment(exp, progress=printed.append)
    assert sum("done before" in p for p in printed) == len(runs)
    assert any("lora_marl seed1 sft (= arm full's): done before" in p for p in printed)


@pytest.mark.slow
def test_export_writes_the_seated_agents_as_full_models(tmp_path, m1_cache):
    """`m1 experiment export`: every trained agent of an arm as its eval seats it, a plain model folder that loads
    alone and answers with the seated model's greedy tokens; a LoRA arm's adapter merged into its (merged SFT) base;
    no optimizer state; an existing folder replaced whole."""
    from m1.config import ModelSpec, load_team
    from m1.experiment.export import export_agents
    from m1.experiment.runner import run_experiment
    from m1.experiment.stages import read_stage
    from m1.marl.actor.learner_io import read_safetensors
    from m1.models.base import ChatRequest, SamplingParams
    from m1.models.hf import HFChatModel

    path = tiny_experiment(tmp_path)
    exp = load_experiment(path)
    run_experiment(exp, progress=lambda _: None)
    out = tmp_path / "exp"
    # one MARL step on random agents may leave LoRA's B at zero (equal rewards): give each adapter a real delta, so
    # the merge shows in the weights
    from safetensors.torch import load_file, save_file

    for adapter in (out / "lora" / "seed0" / "marl").glob("**/agents/*/adapter/adapter_model.safetensors"):
        tensors = load_file(adapter)
        save_file({k: v + 0.05 if "lora_B" in k else v for k, v in tensors.items()}, adapter)
    (tmp_path / "lora_export" / "alpha").mkdir(parents=True)
    (tmp_path / "lora_export" / "alpha" / "stale.txt").write_text("from an older export")
    res = runner.invoke(app, ["experiment", "export", str(path), str(tmp_path / "lora_export"), "--arm", "lora"])
    assert res.exit_code == 0, res.output
    assert "wrote 2 agents" in res.output
    written = export_agents(exp, "full", 0, tmp_path / "full_export", progress=lambda _: None)
    assert sorted(written) == ["alpha", "beta"]
    req = [ChatRequest([{"role": "user", "content": "Which tool first? Answer with a plan."}])]
    greedy = SamplingParams(max_new_tokens=12, temperature=0.0)
    for arm in ("full", "lora"):
        record = read_stage(out / arm / "seed0" / "eval")
        team = load_team(record["config"], record["overrides"])
        folder = tmp_path / f"{arm}_export"
        assert sorted(p.name for p in folder.iterdir()) == ["SOURCE.md", "alpha", "beta"]
        for agent, key in (("alpha", "qa"), ("beta", "qb")):
            files = sorted(p.name for p in (folder / agent).iterdir())
            assert "model.safetensors" in files and "config.json" in files, files
            assert not any("adapter" in f or "optim" in f or f.endswith(".pt") for f in files), files
            seated = HFChatModel(team.models[key], key)
            alone = HFChatModel(ModelSpec(interface="chat", backend="hf", device="cpu", path=str(folder / agent)), agent)
            want, got = seated.model.state_dict(), read_safetensors(folder / agent, "model")
            assert set(got) <= set(want) and all(got[k].equal(want[k]) for k in got)
            a, b = seated.generate(req, greedy)[0], alone.generate(req, greedy)[0]
            assert a.completion_ids == b.completion_ids and a.text == b.text
            if arm == "lora":  # MARL's adapter moved the merged SFT weights it sat on
                assert team.models[key].adapter is not None
                base = read_safetensors(out / "lora" / "seed0" / "sft" / "merged" / agent, "model")
                assert any(not got[k].equal(base[k]) for k in got if k in base)
    assert "--arm lora --seed 0" in (tmp_path / "lora_export" / "SOURCE.md").read_text()
    assert "(merged)" in (tmp_path / "lora_export" / "SOURCE.md").read_text()
    # errors name the arm or seed and what there is
    res = runner.invoke(app, ["experiment", "export", str(path), str(tmp_path / "x"), "--arm", "nope"])
    assert res.exit_code == 2 and "--arm 'nope': not an arm of experiment tiny (arms: ['full', 'lora'])" in res.output
    res = runner.invoke(app, ["experiment", "export", str(path), str(tmp_path / "x"), "--arm", "full", "--seed", "3"])
    assert res.exit_code == 2 and "--seed 3: not a seed" in res.output


def test_report_counts_answers_changed_against_the_baseline(tmp_path):
    """Per seed, an arm's answers against the baseline arm's (`baseline:`, not the first arm here): changed, fixed
    (wrong -> right), broken (right -> wrong) and the exact sign test, as the results files give them."""
    from m1.experiment.report import write_report
    from m1.experiment.stats import sign_test_p
    from m1.experiment.stages import STAGE_FILE

    n = 12
    (tmp_path / "q.jsonl").write_text("".join(json.dumps(
        {"id": f"q{i}", "video": "v.mp4", "text": "?", "task": "mcq", "options": ["x", "y"], "answer": "A"}) + "\n"
        for i in range(n)))
    exp = load_experiment(_write(tmp_path / "e.yaml", {
        "name": "changes", "out_dir": str(tmp_path / "out"), "seeds": [0, 1], "baseline": "base",
        "eval": {"team": "tiny", "questions": str(tmp_path / "q.jsonl")},
        "arms": {"other": {"eval": ["limits.max_turns=1"]}, "base": None, "new": {"eval": ["limits.max_turns=2"]}}}))
    rng = __import__("random").Random(4)
    answers = {(arm, seed): [rng.choice("AB") for _ in range(n)] for arm in ("other", "base", "new")
               for seed in (0, 1)}
    for (arm, seed), ans in answers.items():
        folder = exp.stage_dir(arm, seed, "eval")
        folder.mkdir(parents=True)
        rows = [{"id": f"q{i}", "answer": a, "correct": a == "A"} for i, a in enumerate(ans)]
        (folder / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        (folder / STAGE_FILE).write_text(json.dumps({"results": {"results": str(folder / "results.jsonl")}}))
    rep = write_report(exp)
    md = rep["text"]
    assert "## Paired difference to base (points)" in md and "## Answers changed against base, per seed" in md
    assert [(c["arm"], c["seed"]) for c in rep["changes"]] == [("other", 0), ("other", 1), ("new", 0), ("new", 1)]
    for c in rep["changes"]:
        mine, base = answers[(c["arm"], c["seed"])], answers[("base", c["seed"])]
        fixed = sum(m == "A" != b for m, b in zip(mine, base))
        broken = sum(b == "A" != m for m, b in zip(mine, base))
        assert (c["n"], c["changed"], c["fixed"], c["broken"]) == (n, sum(m != b for m, b in zip(mine, base)),
                                                                  fixed, broken)
        assert c["p"] == pytest.approx(min(1.0, 2 * sum(math.comb(fixed + broken, i) for i in
                                                        range(min(fixed, broken) + 1)) / 2 ** (fixed + broken)))
        assert f"| {c['arm']} | {c['seed']} | {n} | {c['changed']} | {fixed} | {broken} | {c['p']:.3g} |" in md
    table = {(r["arm"], r["family"]): r for r in csv.DictReader((tmp_path / "out" / "report.csv").open())}
    assert table[("base", "all")]["diff_mean"] == "" and table[("other", "all")]["diff_mean"] != ""
    # exact binomial tails: 0 of 5 at 2/32; 1 of 10 at 2 * 11/1024; none changed: 1
    assert sign_test_p(0, 5) == pytest.approx(0.0625) and sign_test_p(9, 1) == pytest.approx(22 / 1024)
    assert sign_test_p(0, 0) == 1.0 and 0.3 < sign_test_p(53, 64) < 0.4
    with pytest.raises(ConfigError, match=r"baseline: 'nope' is not an arm"):
        load_experiment(_write(tmp_path / "b.yaml", {**yaml.safe_load((tmp_path / "e.yaml").read_text()),
                                                     "baseline": "nope"}))


def test_plan_of_the_paper_ablations_shares_stages(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    res = runner.invoke(app, ["experiment", "run", "ablations", "--plan", "--gpus", "24", "--gpu-mem", "80"])
    assert res.exit_code == 0, res.output
    out = res.output
    for arm in ("no_dropout", "no_r_col", "no_r_format", "sft_only", "best_score", "decide_by_agent"):
        assert f"== sft / arm {arm}: the same as arm full_team's, run once ==" in out
    for arm in ("best_score", "decide_by_agent"):
        assert f"== marl / arm {arm}: the same as arm full_team's, run once ==" in out
    assert "== marl / arm marl_only (videochat_m1_lora) ==" in out and "sft / arm marl_only" not in out
    assert "/ arm base" not in out  # eval only: nothing to place
    # a smaller team needs fewer learner GPUs: 4 driver models + one learner per agent
    for arm, gpus in (("full_team", 8), ("agents3", 7), ("agents2", 6), ("agents1", 5)):
        assert f"== marl / arm {arm} (videochat_m1_lora" in out
        section = out.split(f"== marl / arm {arm} (")[1].split("\n== ")[0]
        assert f"{gpus} GPUs needed of 24" in section
    assert "base seed2 eval" in out and "base seed0 sft" not in out
    assert not (tmp_path / "runs").exists()


def test_report_plan_choices_from_result_rows(tmp_path):
    """Per family the best plan (its agents' own answers right most often, every arm pooled) and, per arm, the share
    of plans that are it, the most chosen plan and the strict-format share, from the results rows' first plans."""
    from m1.experiment.report import write_report
    from m1.experiment.stats import ArmResult, plan_choices
    from m1.experiment.stages import STAGE_FILE

    fams = ["a", "a", "b", "b"]
    (tmp_path / "q.jsonl").write_text("".join(json.dumps(
        {"id": f"q{i}", "video": "v.mp4", "text": "?", "task": "mcq", "options": ["x", "y"], "answer": "A",
         "meta": {"family": f}}) + "\n" for i, f in enumerate(fams)))
    exp = load_experiment(_write(tmp_path / "e.yaml", {
        "name": "plans", "out_dir": str(tmp_path / "out"), "seeds": [0],
        "eval": {"team": "tiny", "questions": str(tmp_path / "q.jsonl")},
        "arms": {"before": None, "after": {"eval": ["limits.max_turns=2"]}}}))
    good, bad = ["Video Retrieval", "Fine Browser"], ["Global Sampling", "Rough Browser"]
    # before: agent x plans badly (answers wrong), agent y well (right); after: both plan well on family a. Agent z's
    # plan is the parser's repair (not in the strict format): it answers right, but its plan is rated by nobody
    odd = ["Image Retrieval", "Space Tool"]
    chosen = {"before": {"x": bad, "y": good, "z": odd}, "after": {"x": good, "y": good, "z": odd}}
    for arm, agents in chosen.items():
        folder = exp.stage_dir(arm, 0, "eval")
        folder.mkdir(parents=True)
        rows = []
        for i, fam in enumerate(fams):
            plans = agents if fam == "a" else {"x": bad, "y": bad, "z": odd}
            ag = {a: {"answer": "B" if p == bad else "A", "parse_ok": True, "plan": p, "plan_ok": a != "z"}
                  for a, p in plans.items()}
            rows.append({"id": f"q{i}", "answer": "A", "correct": True, "agents": ag})
        (folder / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        (folder / STAGE_FILE).write_text(json.dumps({"results": {"results": str(folder / "results.jsonl")}}))
    from m1.experiment.stats import collect

    arms, families = collect(exp)
    got = plan_choices(arms, families, dict(zip([f"q{i}" for i in range(4)], fams)), min_uses=1)
    assert got["best"]["a"] == (tuple(good), 1.0, 6) and got["best"]["b"][0] == tuple(bad)
    assert got["arms"]["before"]["a"]["best_share"] == pytest.approx(1 / 3)
    assert got["arms"]["after"]["a"]["best_share"] == pytest.approx(2 / 3)
    assert got["arms"]["after"]["a"]["top"] == tuple(good) and got["arms"]["after"]["b"]["top_share"] == 2 / 3
    assert got["strict"] == {"before": 8 / 12, "after": 8 / 12}
    assert tuple(odd) not in got["rates"]["a"]
    md = write_report(exp)["text"]
    assert "## Plans chosen" not in md  # 4 uses per plan and family: below the 20 a best plan needs
    assert isinstance(arms[0], ArmResult)
    from m1.experiment.report import render_markdown
    from m1.experiment.stats import ReportStats, summarize

    rows, fams_, notes = summarize(exp)
    md = render_markdown(exp, ReportStats(rows, fams_, notes, plans=got))
    # cells: best plan share; mean success rate of the chosen plans (z's unrated); the most chosen plan
    assert "| a | VR→FB (100.0%, 6) | 33; 50.0; GS→RB 33 | 67; 100.0; VR→FB 67 |" in md
    # over all families: the share of plans that are their own family's best, and their family success rates
    assert "| all | each family's own | 50; 25.0; GS→RB 50 | 67; 50.0; VR→FB 33 |" in md
    assert "| plans in the strict format | | 67% | 67% |" in md
    assert got["arms"]["before"]["a"]["shares"] == {tuple(bad): 1 / 3, tuple(good): 1 / 3, tuple(odd): 1 / 3}
    # a reference arm (a teacher team) chooses plans but does not rate them: here "after" only used the good plan
    ref = plan_choices(arms, families, dict(zip([f"q{i}" for i in range(4)], fams)), min_uses=1,
                       references=frozenset({"after"}))
    assert ref["best"]["a"] == (tuple(good), 1.0, 2) and ref["arms"]["after"]["a"]["value"] == 1.0
    assert ref["rates"]["b"][tuple(bad)] == (0.0, 4)
    from m1.experiment.report import write_plans_csv

    lines = write_plans_csv(tmp_path / "plans.csv", got).read_text().splitlines()
    assert lines[0] == "arm,family,plan,share,plans,success_rate,success_uses"
    assert f"before,a,GS→RB,{1 / 3!r},6,0.0,2" in lines and f"after,a,VR→FB,{2 / 3!r},6,1.0,6" in lines
    assert f"before,a,IR→ST,{1 / 3!r},6,nan,0" in lines


def test_eval_on_benchmarks_reports_one_family_each(tmp_path, m1_cache):
    """`eval.benchmarks` (as `m1 eval` reads them) instead of one questions file: ids get the benchmark's name and
    the report has a row per benchmark; exactly one of `questions` and `benchmarks`."""
    from m1.experiment.report import write_report
    from m1.experiment.runner import run_experiment
    from m1.experiment.stages import read_stage

    video = make_video(tmp_path / "videos" / "v.mp4", seconds=4, fps=2)
    for name, n in (("holmes", 2), ("lvb", 3)):
        (tmp_path / f"{name}.jsonl").write_text("".join(json.dumps(
            {"id": f"q{i}", "video": "v.mp4", "text": "What colour?", "options": ["white", "red"], "task": "mcq",
             "answer": "A"}) + "\n" for i in range(n)))
    bench = [{"name": name, "format": "jsonl", "annotations": str(tmp_path / f"{name}.jsonl"),
              "videos": str(video.parent)} for name in ("holmes", "lvb")]
    spec = {"name": "b", "out_dir": str(tmp_path / "exp"), "seeds": [0], "arms": {"base": None},
            "eval": {"team": "tiny", "benchmarks": bench, "overrides": ["limits.max_turns=1"]}}
    exp = load_experiment(_write(tmp_path / "b.yaml", spec))
    run_experiment(exp, progress=lambda _: None)
    rows = [json.loads(x) for x in (tmp_path / "exp" / "base" / "seed0" / "eval" / "results.jsonl").read_text()
            .splitlines()]
    assert sorted(r["id"] for r in rows) == ["holmes:q0", "holmes:q1", "lvb:q0", "lvb:q1", "lvb:q2"]
    assert read_stage(tmp_path / "exp" / "base" / "seed0" / "eval")["results"]["questions"] == "holmes, lvb"
    table = list(csv.DictReader(open(write_report(exp)["csv"])))
    assert [(r["family"], int(r["graded"])) for r in table] == [("all", 5), ("holmes", 2), ("lvb", 3)]
    for bad in ({"team": "tiny"}, {"team": "tiny", "questions": "q.jsonl", "benchmarks": bench}):
        with pytest.raises(ConfigError, match="give `questions` .* or `benchmarks`"):
            load_experiment(_write(tmp_path / "bad.yaml", {**spec, "eval": bad}))


def test_experiment_lock_and_a_resumed_eval_stage_counts_every_attempt(tmp_path, monkeypatch):
    """One run of an experiment at a time (`<out_dir>/.lock`, the holder named); an eval stage stopped after two of
    four answers and rerun records all four, and the wall time of both attempts."""
    from m1.experiment.runner import run_experiment
    from m1.experiment.stages import read_stage
    from m1.locks import LockError, hold_dir
    from m1.results import ResultsFile
    from tests.core.test_run_safety import ScriptedTeam

    spec = yaml.safe_load(tiny_experiment(tmp_path).read_text())
    del spec["sft"], spec["marl"]
    spec["arms"] = {"base": None}
    exp = load_experiment(_write(tmp_path / "eval_only.yaml", spec))
    # answers A to everything: the records are under test
    monkeypatch.setitem(TEAM_KINDS, "cpp", KindSpec("cpp", ScriptedTeam))
    with hold_dir(tmp_path / "exp", "experiment folder"):
        with pytest.raises(LockError, match=r"experiment folder .*exp is being written by pid \d+ on host .*; wait "
                                            r"for that run to finish \(or stop it\), or give this run another out_dir"):
            run_experiment(exp, progress=lambda _: None)
    real = ResultsFile.append

    def two_then_killed(self, row):
        if len(self.done) == 2:
            raise RuntimeError("killed after two lines")
        real(self, row)

    monkeypatch.setattr(ResultsFile, "append", two_then_killed)
    with pytest.raises(RuntimeError, match="killed after two lines"):
        run_experiment(exp, progress=lambda _: None)
    folder = tmp_path / "exp" / "base" / "seed0" / "eval"
    spent = float((folder / ".wall_s").read_text())
    assert spent > 0 and read_stage(folder) is None and not (tmp_path / "exp" / ".lock").exists()
    monkeypatch.setattr(ResultsFile, "append", real)
    said = []
    [rec] = run_experiment(exp, progress=said.append)
    assert any("2 answered, 2 already done" in s for s in said), said
    assert (rec["answered"], rec["graded"], rec["correct"], rec["errors"]) == (4, 4, 2, [])  # truths A, B, A, B; the team says A
    assert rec["wall_s"] >= spent and not (folder / ".wall_s").exists()
    assert read_stage(folder)["answered"] == 4 and not list(folder.glob(".stage.json*"))


def test_two_eval_folders_share_the_trained_stages_and_seeds_run_on_fixed_threads(tmp_path, monkeypatch):
    """Two experiment files with one out_dir and `eval.folder`s of their own answer their own questions into their
    own folders (a dev split to choose on, the held-out set once); every seed runs on `threads_per_seed` torch
    threads whatever --jobs is, so the thread count (and the float sums with it) never depends on --jobs."""
    import torch

    from m1.experiment import runner as exp_runner
    from m1.experiment.runner import run_experiment
    from m1.experiment.stages import read_stage
    from tests.core.test_run_safety import ScriptedTeam

    spec = yaml.safe_load(tiny_experiment(tmp_path).read_text())
    del spec["sft"], spec["marl"]
    spec["arms"] = {"base": None}
    rows = (tmp_path / "questions.jsonl").read_text().splitlines()
    (tmp_path / "dev.jsonl").write_text("\n".join(rows[:3]) + "\n")
    held_out = load_experiment(_write(tmp_path / "held_out.yaml", spec))
    spec["eval"] = {**spec["eval"], "questions": str(tmp_path / "dev.jsonl"), "folder": "eval_dev"}
    spec["threads_per_seed"] = 2 if torch.get_num_threads() == 1 else 1
    dev = load_experiment(_write(tmp_path / "dev.yaml", spec))
    monkeypatch.setitem(TEAM_KINDS, "cpp", KindSpec("cpp", ScriptedTeam))
    seen, real_chains = [], exp_runner.run_chains

    def chains(exp, progress):
        seen.append(torch.get_num_threads())
        return real_chains(exp, progress)

    monkeypatch.setattr(exp_runner, "run_chains", chains)
    before = torch.get_num_threads()
    [dev_rec] = run_experiment(dev, progress=lambda _: None)
    assert seen == [spec["threads_per_seed"]] and torch.get_num_threads() == before
    [held_rec] = run_experiment(held_out, progress=lambda _: None)
    assert seen[-1] == 1  # the default
    seed_dir = tmp_path / "exp" / "base" / "seed0"
    assert (dev_rec["answered"], held_rec["answered"]) == (3, 4)
    assert read_stage(seed_dir / "eval_dev")["answered"] == 3 and read_stage(seed_dir / "eval")["answered"] == 4
    with pytest.raises(ConfigError, match="folder"):
        load_experiment(tmp_path / "dev.yaml", ["eval.folder=../elsewhere"])


def test_plan_runs_the_model_preflight_of_every_training_stage(tmp_path, monkeypatch, empty_hf_cache):
    """Like `m1 train --plan`, `m1 experiment run --plan` names a model that cannot be built: each arm's stages are
    checked, so an arm whose grounding model no class can build is one `model refused:` line, exit 2."""
    monkeypatch.chdir(tmp_path)
    eagle = ["models.grounding.path=nvidia/Eagle2.5-8B", "models.grounding.trust_remote_code=true"]
    exp = yaml.safe_load(open(Path(__file__).parents[2] / "configs" / "experiments" / "lora_vs_full.yaml"))
    exp["arms"]["eagle"] = {"marl": [f"team_overrides=[{','.join(eagle)}]"]}
    path = _write(tmp_path / "eagle.yaml", exp)
    res = runner.invoke(app, ["experiment", "run", str(path), "--plan", "--gpus", "24", "--gpu-mem", "80"])
    assert res.exit_code == 2, res.output
    refused = [line for line in res.output.splitlines() if line.startswith("model refused:")]
    assert len(refused) == 1 and "model 'grounding' (nvidia/Eagle2.5-8B, browse tool)" in refused[0], res.output
    assert "models checked by class only" in res.output  # the other arms' hub models, not cached here
    # the agents' models of a MARL stage come from the arm's SFT stage: left to the seating, not refused
    assert res.output.count("models this arm's SFT stage makes (checked when seated): qwen25_3b, qwen25_7b, "
                            "qwen3_4b, qwen3_8b") == 3, res.output
    assert "one of its models cannot be built" in res.output
