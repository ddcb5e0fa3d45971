"""Experiments that survive restarts and machines: each finished stage's committed record and each eval's
compact rows under rows_dir, the report from those rows alone, a rerun without out_dir that skips what they record
(and retrains only what a stage still to run needs), the load warning, and one SFT shared by several MARL seeds."""
import hashlib
import json
import shutil

import pytest
import yaml

from m1.experiment.config import ExperimentError, load_experiment
from m1.team.engines_registry import TEAM_KINDS, KindSpec
from m1.schema import AgentAnswer, AgentRecord, Episode, Generation, Question, Topology
from tests.experiment.test_experiment import _count, _write, tiny_experiment
from tests.core.test_run_safety import ScriptedTeam

PLANS = [["Global Sampling", "Rough Browser"], ["Video Retrieval", "Fine Browser"], ["Image Retrieval", "Space Tool"]]


class PlanningTeam:
    """Two agents whose plans, formats and answers follow a hash of (question, sampling seed, max_turns): rows that
    differ between arms and seeds, with plans and traced generations, and no model."""

    pool = None  # decodes no video (m1/contracts.py Team)

    def __init__(self, cfg=None):
        self.key = f"{cfg.sampling.seed}/{cfg.limits.max_turns}"

    def run(self, questions, on_episode=None):
        for q in questions:
            h = int(hashlib.sha256(f"{q.id}/{self.key}".encode()).hexdigest(), 16)
            answers = {a: "AB"[(h >> i) % 2] for i, a in enumerate(("x", "y"))}
            memory = {a: AgentRecord(plan=PLANS[(h >> (4 + i)) % 3], answer=answers[a]) for i, a in enumerate("xy")}
            gens = [Generation(agent=a, phase=phase, prompt=[], completion="", parse_ok=bool((h >> (8 + i)) % 4))
                    for i, (a, phase) in enumerate([("x", "plan"), ("y", "plan"), ("x", "answer"), ("y", "answer")])]
            on_episode(Episode(id=q.id, question=q, topology=Topology(agents=["x", "y"], active=["x", "y"], edges=[]),
                               memory=memory, generations=gens, final_answer=answers["x"], aggregation="vote",
                               answers=[AgentAnswer(agent=a, answer=v) for a, v in answers.items()],
                               timings={"batch_wall": 0.01, "batch_size": 1.0}))


def _count_stages(monkeypatch, calls: list[str]) -> None:
    """Count each SFT, MARL and eval run an experiment makes into `calls`."""
    for module, name in (("m1.marl.sft", "sft_main"), ("m1.marl.launch", "train_main"), ("m1.run", "run_questions")):
        _count(monkeypatch, module, name, calls)


def _eval_only(tmp_path, n=30, seeds=(0, 1)):
    """tiny_experiment's eval alone: two arms x `seeds`, `n` questions in three families, traced."""
    spec = yaml.safe_load(tiny_experiment(tmp_path).read_text())
    del spec["sft"], spec["marl"]
    fams = ["colour", "count", "scene"]
    qs = [{"id": f"s1001-synth_{i // 10:03d}-q{i % 10:02d}", "video": "v.mp4", "text": f"Which one, {i}?",
           "options": ["white", "red"], "task": "mcq", "answer": "AB"[i % 2], "meta": {"family": fams[i % 3]}}
          for i in range(n)]
    (tmp_path / "questions.jsonl").write_text("".join(json.dumps(q) + "\n" for q in qs))
    spec.update(seeds=list(seeds), arms={"base": None, "other": {"eval": ["limits.max_turns=3"]}})
    spec["eval"]["traces"] = True
    return _write(tmp_path / "eval_only.yaml", spec)


def test_eval_rows_are_committed_and_the_report_reads_them_alone(tmp_path, monkeypatch):
    """Each finished eval writes <rows_dir>/<arm>/seed<k>/eval.jsonl (one compact row per graded question, in the
    questions' order) and eval.json (wall time, overrides, load, identity; nothing of this machine's paths); the
    report made from them alone, out_dir and questions deleted, is the report made from the run folders; rows of
    another config are left out with a note."""
    from m1.experiment.report import write_report
    from m1.experiment.runner import run_experiment

    path = _eval_only(tmp_path)
    exp = load_experiment(path)
    monkeypatch.setitem(TEAM_KINDS, "cpp", KindSpec("cpp", PlanningTeam))
    run_experiment(exp, progress=lambda _: None)
    root = tmp_path / "experiment_rows" / "tiny"
    assert exp.rows_root == root
    ids = [json.loads(x)["id"] for x in (tmp_path / "questions.jsonl").read_text().splitlines()]
    for arm in ("base", "other"):
        for seed in (0, 1):
            record = json.loads((root / arm / f"seed{seed}" / "eval.json").read_text())
            assert record["identity"] and record["rows"] == "eval.jsonl" and record["wall_s"] > 0
            assert (record["arm"], record["seed"], record["answered"], record["graded"]) == (arm, seed, 30, 30)
            assert f"sampling.seed={seed}" in record["overrides"] and record["agents"] == ["x", "y"]
            assert set(record["load"]) == {"before", "after", "cores", "given"} and record["load"]["given"] == 1
            assert record["formats"]["plan"][1] == 60 and record["families"] == ["colour", "count", "scene"]
            assert not {"resolved", "seat", "results"} & set(record)
            rows = [json.loads(x) for x in (root / arm / f"seed{seed}" / "eval.jsonl").read_text().splitlines()]
            assert [r["id"] for r in rows] == ids
            assert all(set(r) == {"id", "family", "answer", "correct", "agents"} for r in rows)
            assert all(len(r["agents"]) == 2 and r["agents"][0][0] in ("GS+RB", "VR+FB", "IR+ST") for r in rows)
    before = write_report(exp)
    files = {name: (tmp_path / "exp" / name).read_text() for name in ("report.md", "report.csv", "plans.csv")}
    assert "## Replies in the strict format" in before["text"]

    shutil.rmtree(tmp_path / "exp")
    (tmp_path / "questions.jsonl").unlink()  # the rows carry families and each agent's right or wrong
    after = write_report(exp)
    assert after["text"] == before["text"] and after["formats"] == before["formats"]
    assert {name: (tmp_path / "exp" / name).read_text() for name in files} == files

    # stored gzipped (as long rows are committed): the same report
    from m1.experiment.rows import store_record

    monkeypatch.setattr("m1.experiment.rows.GZIP_LINES", 10)
    for record in sorted(root.rglob("eval.json")):
        assert store_record(record) == record.with_suffix(".jsonl.gz") and not record.with_suffix(".jsonl").exists()
        assert json.loads(record.read_text())["rows"] == "eval.jsonl.gz"
    gzipped = write_report(exp)
    assert gzipped["text"] == before["text"]
    assert {name: (tmp_path / "exp" / name).read_text() for name in files} == files

    # another config for one arm: its rows are not this config's results
    changed = load_experiment(path, ["arms.other.eval=[limits.max_turns=1]"])
    rep = write_report(changed)
    assert "| other | n/a |" in rep["text"]
    assert f"arm other seed 0: {root / 'other' / 'seed0' / 'eval.json'} was recorded with another config" in rep["text"]


def test_rows_of_500_questions_of_four_agents_are_small(tmp_path):
    """A 500-question eval of a four-agent team: its rows well under 100 KB as JSONL, stored gzipped (past
    GZIP_LINES), the same bytes when written again, and read back whole."""
    import gzip

    from m1.experiment.rows import read_results
    from m1.experiment.records import write_record
    from m1.experiment.stages import StageRun

    exp = load_experiment(_eval_only(tmp_path, n=3, seeds=(0,)))
    qs = [Question(id=f"s1001-synth_{i // 10:03d}-q{i % 10:02d}", video="v.mp4", text="?", task="grounding",
                   answer="[25.5 - 37.0]", meta={"family": "grounding"}) for i in range(500)]
    agents = ["qwen3_big", "qwen3_small", "qwen2_big", "qwen2_small"]
    folder = tmp_path / "eval"
    folder.mkdir()
    (folder / "results.jsonl").write_text("".join(json.dumps(
        {"id": q.id, "answer": "[25.0 - 36.5]", "correct": True, "reason": "a long reason " * 20,
         "agents": {a: {"answer": "[20.0 - 30.0]", "reason": "why " * 30, "parse_ok": True,
                        "plan": PLANS[i % 3], "plan_ok": True} for i, a in enumerate(agents)}}) + "\n" for q in qs))
    done = {"experiment": "tiny", "arm": "base", "seed": 0, "stage": "eval", "wall_s": 1.0, "identity": "x",
            "overrides": [], "results": {"results": str(folder / "results.jsonl")}, "answered": 500,
            "errors": [f"q{i}: boom" for i in range(30)]}
    record = write_record(exp, StageRun("base", 0, "eval", folder), done, qs)
    rows = record.with_suffix(".jsonl.gz")
    assert json.loads(record.read_text())["rows"] == rows.name and not record.with_suffix(".jsonl").exists()
    plain = gzip.decompress(rows.read_bytes())
    assert len(plain.splitlines()) == 500 and len(plain) < 80_000, len(plain)
    assert rows.stat().st_size < len(plain) / 4 and read_results(record.with_suffix(".jsonl"))[0]["id"] == qs[0].id
    first = rows.read_bytes()
    write_record(exp, StageRun("base", 0, "eval", folder), done, qs)
    assert rows.read_bytes() == first
    assert len(json.loads(record.read_text())["errors"]) == 11  # the first ten, then how many more


@pytest.mark.slow
def test_a_rerun_without_out_dir_skips_recorded_stages_and_retrains_what_a_new_eval_needs(tmp_path, m1_cache,
                                                                                         monkeypatch):
    """After out_dir is lost (another machine), a rerun repeats nothing the records hold; an eval whose config
    changed runs again (said so), and the training stages it needs are trained again (naming the stage that needs
    them), while the other arm stays recorded."""
    from m1.experiment.runner import run_experiment
    from m1.experiment.stages import read_stage

    path = tiny_experiment(tmp_path)
    exp = load_experiment(path)
    first = run_experiment(exp, progress=lambda _: None)
    root = tmp_path / "experiment_rows" / "tiny"
    for arm in ("full", "lora"):
        assert sorted(p.name for p in (root / arm / "seed0").iterdir()) == [
            "eval.json", "eval.jsonl", "marl.json", "sft.json"]
        sft = json.loads((root / arm / "seed0" / "sft.json").read_text())
        assert sft["timing"]["steps"] == 1 and sft["timing"]["time/step"] > 0 and "seat" not in sft
    shutil.rmtree(tmp_path / "exp")

    calls: list[str] = []
    printed: list[str] = []
    with monkeypatch.context() as m:
        _count_stages(m, calls)
        again = run_experiment(exp, progress=printed.append)
    assert calls == []
    assert sum("recorded before" in p for p in printed) == 6
    assert [(r["arm"], r["stage"], r["identity"]) for r in again] == [
        (r["arm"], r["stage"], r["identity"]) for r in first]
    assert not (tmp_path / "exp" / "full").exists()

    changed = load_experiment(path, ["arms.lora.eval=[limits.max_turns=1]"])
    calls, printed = [], []
    with monkeypatch.context() as m:
        _count_stages(m, calls)
        run_experiment(changed, progress=printed.append)
    assert calls == ["sft_main", "train_main", "run_questions"]
    text = "\n".join(printed)
    assert f"lora seed0 eval: {root / 'lora' / 'seed0' / 'eval.json'} was recorded with another config" in text
    assert ("lora seed0 marl: recorded in " + str(root / "lora" / "seed0" / "marl.json") + ", but its weights are not "
            "on this machine and lora seed0 eval needs them: training it again") in text
    assert "lora seed0 sft: recorded in" in text and "lora seed0 marl needs them" in text
    assert sum("recorded before" in p for p in printed) == 3  # full's three stages
    lora_eval = json.loads((root / "lora" / "seed0" / "eval.json").read_text())
    assert "limits.max_turns=1" in lora_eval["overrides"]
    assert lora_eval["identity"] == read_stage(tmp_path / "exp" / "lora" / "seed0" / "eval")["identity"]


def test_load_warning_when_something_else_uses_the_cores(tmp_path, monkeypatch):
    """Above the cores the run was given (jobs x threads_per_seed, at most the machine's) plus half a core: a warning
    at start and before each stage, the load in the stage record; no load average: no warning, no failure."""
    import os

    from m1.experiment.runner import run_experiment, warn_load
    from m1.experiment.stages import read_stage

    said: list[str] = []
    monkeypatch.setattr(os, "cpu_count", lambda: 8)
    monkeypatch.setattr(os, "getloadavg", lambda: (2.4, 2.0, 1.0))
    assert warn_load(2, 1, said.append)["load"] == [2.4, 2.0, 1.0] and said == []
    monkeypatch.setattr(os, "getloadavg", lambda: (2.6, 2.0, 1.0))
    warn_load(2, 1, said.append)
    assert said == ["warning: load average 2.60 on 8 cores, this run was given 2 (2 job(s) x 1 thread(s)): something "
                    "else is using the cores; timings will be inflated"]
    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    said = []
    warn_load(4, 1, said.append)  # four jobs on two cores: the machine's two are all it can have
    assert len(said) == 1

    def no_load():
        raise OSError("no load average here")

    monkeypatch.setattr(os, "getloadavg", no_load)
    said = []
    assert warn_load(1, 1, said.append) is None and said == []

    exp = load_experiment(_eval_only(tmp_path, n=4, seeds=(0,)))
    monkeypatch.setattr(os, "getloadavg", lambda: (5.0, 4.0, 3.0))
    monkeypatch.setitem(TEAM_KINDS, "cpp", KindSpec("cpp", ScriptedTeam))
    printed: list[str] = []
    run_experiment(exp, progress=printed.append)
    assert sum("timings will be inflated" in p for p in printed) == 3  # at start, before each arm's eval
    load = read_stage(tmp_path / "exp" / "base" / "seed0" / "eval")["load"]
    assert load == {"before": [5.0, 4.0, 3.0], "after": [5.0, 4.0, 3.0], "cores": 2, "given": 1}


@pytest.mark.slow
def test_sft_shared_by_the_marl_seeds_of_its_group(tmp_path, m1_cache):
    """sft_share 3: seeds 0-2 train one SFT (seed 0's), every MARL seed seats its weights and keeps its own seed,
    an SFT-only arm is answered once (its rows reused for seeds 1, 2), and the report says so; two worker processes
    run seed 0 first, then the seeds that start from its SFT."""
    from m1.config_files import ConfigError
    from m1.experiment.report import write_report
    from m1.experiment.runner import run_experiment
    from m1.experiment.stages import read_stage

    spec = yaml.safe_load(tiny_experiment(tmp_path).read_text())
    spec.update(seeds=[0, 1, 2], sft_share=3, arms={"full": None, "sft_only": {"stages": ["sft", "eval"]}},
                baseline="sft_only")
    exp = load_experiment(_write(tmp_path / "shared.yaml", spec))
    assert [exp.stage_seed("full", s, st) for s in (0, 1, 2) for st in ("sft", "marl", "eval")] == [
        0, 0, 0, 0, 1, 1, 0, 2, 2]
    assert exp.stage_seed("sft_only", 2, "eval") == 0
    printed: list[str] = []
    records = run_experiment(exp, progress=printed.append, jobs=2)
    out = tmp_path / "exp"
    assert sorted(p.name for p in (out / "full").iterdir()) == ["seed0", "seed1", "seed2"]
    assert sorted(p.name for p in (out / "full" / "seed1").iterdir()) == ["eval", "marl"]
    assert sorted(p.name for p in (out / "sft_only").iterdir()) == ["seed0"]
    sft0 = read_stage(out / "full" / "seed0" / "sft")
    seated = f"models.qa.path={sft0['results']['checkpoint']}/agents/alpha/model"
    for seed in (0, 1, 2):
        marl = read_stage(out / "full" / f"seed{seed}" / "marl")
        assert seated in marl["resolved"]["team_overrides"] and marl["resolved"]["seed"] == seed
    assert [(r["arm"], r["seed"], r["stage"]) for r in records if r["stage"] != "marl"] == [
        ("full", 0, "sft"), ("full", 0, "eval"), ("full", 0, "sft"), ("full", 1, "eval"), ("full", 0, "sft"),
        ("full", 2, "eval"), ("full", 0, "sft"), ("sft_only", 0, "eval"), ("full", 0, "sft"), ("sft_only", 0, "eval"),
        ("full", 0, "sft"), ("sft_only", 0, "eval")]
    rep = write_report(exp)
    rows = {(r["arm"], r["family"]): r for r in rep["rows"]}
    assert rows[("sft_only", "all")]["seeds"] == [0] and rows[("full", "all")]["seeds"] == [0, 1, 2]
    assert rows[("full", "all")]["diff_seeds"] == [0, 1, 2]  # each MARL seed against the SFT it started from
    assert ("SFT shared by seeds 0-2 (sft_share 3): every MARL seed starts from its group's SFT weights, with its own "
            "rollouts and data order; arms that train only SFT (sft_only) are answered once per group") in rep["text"]
    with pytest.raises(ConfigError, match=r"seed 4 starts from the SFT of seed 3, which must be listed before it"):
        load_experiment(tmp_path / "shared.yaml", ["seeds=[0,1,2,4]"])


def test_the_recipe_files_share_their_training_records(monkeypatch):
    """mini_recipe_dev.yaml trains the stages mini_recipe.yaml answers the held-out questions with: one rows_dir, the
    same training records under the same identities, each file its own eval rows."""
    from pathlib import Path

    from m1.experiment.records import stage_identity

    monkeypatch.delenv("M1_EXPERIMENT_ROWS")
    final, dev = load_experiment("mini_recipe"), load_experiment("mini_recipe_dev")
    assert final.rows_root == dev.rows_root == Path("docs/experiments/mini_recipe")
    for stage in ("sft", "marl"):
        assert final.record_path("sft_marl", 1, stage) == dev.record_path("sft_marl", 1, stage)
        identities = {stage_identity(e, "sft_marl", 1, stage) for e in (final, dev)}
        assert len(identities) == 1
    assert (final.record_path("sft", 0, "eval").name, dev.record_path("sft", 0, "eval").name) == (
        "eval.json", "eval_dev.json")
    assert stage_identity(final, "sft", 0, "eval") != stage_identity(dev, "sft", 0, "eval")


def test_an_identity_does_not_depend_on_where_the_repository_lies(monkeypatch):
    """mini_from_base seats `../../assets/mini_base`, which the team loader makes absolute: the identity reads it
    relative to the repository's root, so a clone elsewhere (CI, another machine) finds the committed records its own."""
    from m1.config_files import CONFIG_DIR
    from m1.experiment.records import identity_text, stage_identity

    monkeypatch.delenv("M1_EXPERIMENT_ROWS", raising=False)
    exp = load_experiment("mini_base_recipe")
    here = identity_text(exp, "sft", 0, "sft")
    assert '"assets/mini_base"' in here and str(CONFIG_DIR.resolve().parent) not in here
    elsewhere = identity_text(exp, "sft", 0, "sft", root="/elsewhere/m1")
    assert '"/elsewhere/m1/assets/mini_base"' in elsewhere and elsewhere.replace("/elsewhere/m1/", "") == here
    # the committed record of this stage carries the identity this clone computes
    record = json.loads(exp.record_path("sft", 0, "sft").read_text())
    assert record["identity"] == stage_identity(exp, "sft", 0, "sft")


def test_a_seed_waits_for_its_own_groups_sft_alone(monkeypatch):
    """With jobs > 1, seed 1 starts as soon as seed 0 (its group's SFT) is done, not once every group's SFT is."""
    from m1.experiment.runner import seed_order

    monkeypatch.delenv("M1_EXPERIMENT_ROWS", raising=False)
    exp = load_experiment("mini_base_recipe")
    assert (exp.seeds, exp.sft_share) == ([0, 1, 2, 3, 4, 5], 2)
    assert seed_order(exp) == ([0, 2, 4], {0: [1], 2: [3], 4: [5]})
    assert seed_order(load_experiment("mini_base_recipe", ["seeds=[0,1,4,5]"])) == ([0, 4], {0: [1], 4: [5]})


def test_two_arms_answered_once_per_group_are_paired_once_per_group(monkeypatch):
    """mini_base_recipe's committed records: sft_plain and sft (both SFT only, sft_share 2) differ on three SFT runs,
    not six; each MARL seed still pairs with the SFT it started from."""
    from m1.experiment.stats import report_stats

    monkeypatch.delenv("M1_EXPERIMENT_ROWS", raising=False)
    rows = {(r["arm"], r["family"]): r for r in report_stats(load_experiment("mini_base_recipe")).rows}
    plain = rows[("sft_plain", "all")]
    assert plain["seeds"] == plain["diff_seeds"] == [0, 2, 4] and len(plain["diff"]) == 3
    assert plain["diff_low"] < plain["diff_mean"] < plain["diff_high"]
    assert rows[("sft_marl", "all")]["diff_seeds"] == [0, 1, 2, 3, 4, 5]


@pytest.mark.slow
def test_stages_trained_on_examples_since_rebuilt_run_again(tmp_path, m1_cache, monkeypatch):
    """A stage's identity hashes configs, not the SFT examples a code change rewrites under the same config (a synth
    teacher edited). Each stage records the examples it was trained on, or after: when data.examples holds other
    ones, a rerun trains both arms' SFT and what follows it again (said so) rather than skip them as recorded, and
    a stage finished in out_dir on the old examples is refused."""
    from m1.experiment.runner import run_experiment
    from m1.marl.sft import read_examples, write_examples
    from m1.signature import file_sha256

    path = tiny_experiment(tmp_path)
    exp = load_experiment(path)
    run_experiment(exp, progress=lambda _: None)
    root = tmp_path / "experiment_rows" / "tiny"
    sha = file_sha256(tmp_path / "examples.jsonl")
    for stage in ("sft", "marl", "eval"):
        assert json.loads((root / "full" / "seed0" / f"{stage}.json").read_text())["examples"] == sha

    examples = read_examples(tmp_path / "examples.jsonl")
    write_examples(tmp_path / "examples.jsonl", examples[::-1])  # the same config, other examples
    with pytest.raises(ExperimentError, match="trained on other SFT examples"):
        run_experiment(load_experiment(path), progress=lambda _: None)

    shutil.rmtree(tmp_path / "exp")
    calls: list[str] = []
    printed: list[str] = []
    with monkeypatch.context() as m:
        _count_stages(m, calls)
        run_experiment(load_experiment(path), progress=printed.append)
    assert sorted(calls) == ["run_questions"] * 2 + ["sft_main"] * 2 + ["train_main"] * 2
    assert sum("was trained on other SFT examples than data.examples now holds" in p for p in printed) == 6
    assert not any("recorded before" in p for p in printed)
    new = file_sha256(tmp_path / "examples.jsonl")
    assert json.loads((root / "lora" / "seed0" / "eval.json").read_text())["examples"] == new != sha
