"""Trackers (`log.backends`) and the record of what each step trained on (`log.samples_every`).

The end-to-end check: a two-step run logging to TensorBoard and mlflow (file store) with samples every
step writes an mlflow run and samples/step-000001/ with trace pages; killed after step 1 (an exception in step 2)
and rerun, it continues the same mlflow run. wandb runs offline and is read back from its transaction log; it is an
optional extra, so its test skips where the package is not installed. mlflow is in the dev extra (mlflow-skinny).
"""
import json
import struct
from pathlib import Path

import pytest

from tests.conftest import varied_reward
from m1.config_files import ConfigError
from m1.marl.config import LogConfig, TrainConfig
from m1.schema import Question

AGENTS = ["alpha", "beta"]


def tiny_cfg(out, steps=2, **log):
    from tests.marl.test_trainer import team_dict

    return TrainConfig.model_validate({
        "name": "tracked", "team": team_dict(), "rollout": {"num_generations": 2, "questions_per_step": 1},
        "grpo": {"beta": 0.05}, "judge": {"method": "rubric"},
        "learner": {"finetune": "full", "lr": 1e-2, "micro_batch_size": 4, "max_completion_tokens": 16},
        "steps": steps, "out_dir": str(out), "checkpoint": {"every": 1, "keep_last": 2},
        "log": {"progress": False, **log}})


def trainer(cfg, video):
    from m1.marl.parts import make_trainer

    qs = [Question(id=f"q{i}", video=video, text=f"What colour is the square in scene {i}?",
                   options=["white", "red"], task="mcq", answer="A") for i in range(3)]
    return make_trainer(cfg, questions=qs, reward_fn=varied_reward)


def killed_after_step_1(tr):
    """Run `tr` and die in step 2, after step 1 was written and checkpointed (what a killed process leaves)."""
    real = tr.train_step

    def step():
        if tr.step == 1:
            raise RuntimeError("killed")
        return real()

    tr.train_step = step
    with pytest.raises(RuntimeError, match="killed"):
        tr.train()
    tr.close()


# ------------------------------------------------------------------------------------------------ config
def test_old_tensorboard_key_reads_with_a_deprecation_and_backends_default_to_tensorboard():
    assert LogConfig().backends == ["tensorboard"]
    with pytest.warns(FutureWarning, match="removed in M1 0.2.0.*log.backends"):
        assert LogConfig.model_validate({"tensorboard": False}).backends == []
    with pytest.warns(FutureWarning, match="log.tensorboard is deprecated"):
        on = LogConfig.model_validate({"tensorboard": True, "backends": ["mlflow"]})
    assert on.backends == ["tensorboard", "mlflow"]
    with pytest.raises(ValueError, match="named more than once"):
        LogConfig.model_validate({"backends": ["mlflow", "mlflow"]})
    with pytest.raises(ValueError, match="backends"):
        LogConfig.model_validate({"backends": ["swanlab"]})
    from m1.marl.config import load_train_config

    cfg = load_train_config("mini", ["steps=2", "log.backends=[tensorboard,mlflow]", "log.samples_every=1"])
    assert cfg.log.backends == ["tensorboard", "mlflow"] and cfg.log.samples_every == 1
    assert TrainConfig.model_validate(cfg.model_dump(mode="json")).log == cfg.log  # a dumped config reads back


def test_a_tracker_not_installed_is_one_error_naming_the_extra_before_any_model_loads(tmp_path, monkeypatch):
    import importlib.util

    import m1.marl.actor.groups as groups
    from m1.marl.parts import make_trainer

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a))
    monkeypatch.setattr(groups, "build_learners", lambda *a, **k: pytest.fail("a model loaded"))
    with pytest.raises(ConfigError) as err:
        make_trainer(tiny_cfg(tmp_path, backends=["tensorboard", "wandb"]), questions=[],
                reward_fn=varied_reward)
    msg = str(err.value)
    assert "log.backends" in msg and "'wandb'" in msg and "pip install 'm1[wandb]'" in msg and "mlflow" not in msg


def test_params_mask_secrets_and_keep_key_variable_names():
    from m1.marl.trackers import flat_params

    p = flat_params({"judge": {"model": {"api_key": "sk-123", "api_key_env": "OPENAI_API_KEY"}}, "seed": 3})
    assert p == {"judge.model.api_key": "***", "judge.model.api_key_env": "OPENAI_API_KEY", "seed": "3"}


# ------------------------------------------------------------------------------------------------ mlflow (done when)
@pytest.mark.slow
def test_mlflow_run_samples_and_trace_pages_and_a_killed_run_continues_the_same_mlflow_run(tmp_path, video,
                                                                                           m1_cache):
    pytest.importorskip("mlflow", reason="mlflow is in the dev extra: pip install -e '.[dev]'")
    from mlflow.tracking import MlflowClient

    out = tmp_path / "run"
    cfg = tiny_cfg(out, backends=["tensorboard", "mlflow"], samples_every=1)
    killed_after_step_1(trainer(cfg, video))
    state = json.loads((out / "checkpoints" / "step-000001" / "trainer_state.json").read_text())
    run_id = state["trackers"]["mlflow"]
    client = MlflowClient(tracking_uri=(out / "mlruns").resolve().as_uri())
    assert client.get_run(run_id).info.status == "FAILED"

    back = trainer(cfg, video)  # the rerun resumes from step 1 and logs to the same run
    assert back.step == 1 and back.tracker_ids == {"mlflow": run_id}
    back.train()
    back.close()
    exp = client.get_experiment_by_name("tracked")
    runs = client.search_runs([exp.experiment_id])
    assert [r.info.run_id for r in runs] == [run_id]
    run = client.get_run(run_id)
    assert run.info.status == "FINISHED"
    assert run.data.params["rollout.num_generations"] == "2" and run.data.params["log.samples_every"] == "1"
    assert run.data.params["plan"].startswith("none")  # no GPUs: no placement plan
    assert [m.step for m in client.get_metric_history(run_id, "loss")] == [1, 2]
    assert [m.step for m in client.get_metric_history(run_id, "alpha.reward")] == [1, 2]
    tables = [a.path for a in client.list_artifacts(run_id, "samples")]
    assert tables == ["samples/step-000001.json", "samples/step-000002.json"]
    table = json.loads((Path(client.download_artifacts(run_id, "samples/step-000001.json", str(tmp_path)))).read_text())
    assert table["columns"][:4] == ["question_id", "rollout", "agent", "phase"] and table["data"]
    assert any((out / "tensorboard").glob("events.out.tfevents.*"))

    # what step 1 trained on: every generation of both agents with its prompt, completion, reward parts, advantage
    step1 = out / "samples" / "step-000001"
    rows = [json.loads(x) for x in (step1 / "samples.jsonl").read_text().splitlines()]
    assert {r["agent"] for r in rows} == set(AGENTS) and {r["rollout"] for r in rows} == {0, 1}
    assert {"plan", "answer"} <= {r["phase"] for r in rows}
    for r in rows:
        assert r["step"] == 1 and r["prompt"][-1]["content"] and isinstance(r["completion"], str)
        assert r["reward_parts"] == {"total": r["reward"]} and isinstance(r["advantage"], float)
    metrics = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [1, 2] and metrics[0]["time/samples"] > 0
    # the trace pages: the page `m1 infer` writes, reward and advantage beside each generation, and an index
    q = rows[0]["question_id"]  # the step's one question (a seeded shuffle picks it)
    pages = sorted(p.name for p in step1.glob("*.html"))
    assert pages == ["index.html", f"{q}.r0.html", f"{q}.r1.html"]
    page = (step1 / f"{q}.r0.html").read_text()
    shown = [r for r in rows if r["episode"] == f"{q}.r0"]
    assert page.count("class='credit advantage") == len(shown)
    assert f"advantage {shown[0]['advantage']:+.3f}" in page and "Where the team looked" in page
    assert f"{q}.r1.html" in (step1 / "index.html").read_text()
    assert (out / "samples" / "step-000002" / "samples.jsonl").is_file()


@pytest.mark.slow
def test_samples_every_n_steps_and_off_by_default(tmp_path, video, m1_cache):
    tr = trainer(tiny_cfg(tmp_path / "a", steps=2, backends=[], samples_every=2), video)
    tr.train()
    tr.close()
    assert [p.name for p in (tmp_path / "a" / "samples").iterdir()] == ["step-000002"]
    tr = trainer(tiny_cfg(tmp_path / "b", steps=1, backends=[]), video)
    tr.train()
    tr.close()
    assert not (tmp_path / "b" / "samples").exists() and not (tmp_path / "b" / "tensorboard").exists()


# ------------------------------------------------------------------------------------------------ wandb (offline)
def wandb_records(path: Path) -> list:
    """The records of a wandb transaction log (.wandb): a 7-byte header, then LevelDB-log framed protobufs."""
    from wandb.proto import wandb_internal_pb2 as pb

    data, block, out, chunk = path.read_bytes(), 32768, [], b""
    assert data[:4] == b":W&B", path
    pos = 7
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:  # a block's tail too short for a header is padding
            pos += left
            continue
        length, kind = struct.unpack("<HB", data[pos + 4:pos + 7])
        chunk += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # FULL, LAST
            rec = pb.Record()
            rec.ParseFromString(chunk)
            out.append(rec)
            chunk = b""
        elif kind == 0:
            break
    return out


def test_wandb_offline_run_is_read_back_and_a_killed_run_continues_it(tmp_path, video, m1_cache, monkeypatch):
    pytest.importorskip("wandb", reason="wandb is an optional extra: pip install -e '.[wandb]'")
    monkeypatch.setenv("WANDB_SILENT", "true")
    out = tmp_path / "run"
    cfg = tiny_cfg(out, backends=["wandb"], samples_every=1)
    killed_after_step_1(trainer(cfg, video))
    run_id = json.loads((out / "checkpoints" / "step-000001" / "trainer_state.json").read_text())["trackers"]["wandb"]
    back = trainer(cfg, video)
    back.train()
    back.close()
    logs = sorted((out / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(logs) == 2 and all(p.name == f"run-{run_id}.wandb" for p in logs)  # one run, written twice
    steps, params, tables = [], {}, 0
    for p in logs:
        for rec in wandb_records(p):
            kind = rec.WhichOneof("record_type")
            if kind == "history":
                items = {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in rec.history.item}
                if "loss" in items:
                    steps.append(items["_step"])
                tables += items.get("samples/_type") == "table-file"  # a table is logged as a file
            elif kind in ("config", "run"):  # the parameters come with the run record, later changes as config
                update = rec.config.update if kind == "config" else rec.run.config.update
                params.update({i.key: json.loads(i.value_json) for i in update})
    assert steps == [1, 2] and tables == 2
    assert params["rollout.num_generations"] == "2" and params["name"] == "tracked"
