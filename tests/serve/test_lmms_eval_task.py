"""The lmms-eval task of integrations/lmms_eval/ without lmms-eval: the prompt it sends, the scoring (M1's own rule,
so it agrees with `m1 eval`), the failed-request marker, and the YAML naming functions that exist. The last test runs
the real check (integrations/lmms_eval/run.py) when .venv-lmms exists; marker `lmms`, which `make test` leaves out."""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from m1.data.metrics import is_correct
from m1.schema import Question

ROOT = Path(__file__).resolve().parents[2]
TASK_DIR = ROOT / "integrations" / "lmms_eval"
LMMS = ROOT / ".venv-lmms" / "bin" / "lmms-eval"


def _load(name: str, file: str):
    spec = importlib.util.spec_from_file_location(name, TASK_DIR / file)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


utils = _load("m1_lmms_utils", "utils.py")


@pytest.fixture
def mcq(tmp_path):
    video = tmp_path / "v.mp4"
    video.write_bytes(b"")  # doc_to_visual checks the path exists; nothing decodes it here
    return {"id": "q1", "video": str(video), "question": "What colour is the star at 00:12?",
            "options": ["red", "green", "blue", "yellow"], "task": "mcq", "answer": "C"}


@pytest.fixture
def open_q(mcq):
    return {**mcq, "id": "q2", "question": "Which object flashes near the end?", "options": [], "task": "open",
            "answer": "cyan cross"}


def _function_loader():
    """A YAML loader that reads `!function utils.x` as the string 'utils.x' (lmms-eval imports it instead)."""
    class Loader(yaml.SafeLoader):
        pass

    Loader.add_constructor("!function", lambda loader, node: ("!function", loader.construct_scalar(node)))
    return Loader


def test_doc_to_text_lists_lettered_options_and_one_instruction(mcq, open_q):
    text = utils.doc_to_text(mcq, {"pre_prompt": "", "post_prompt": ""})
    assert text.splitlines() == ["What colour is the star at 00:12?", "A. red", "B. green", "C. blue", "D. yellow",
                                 utils.MCQ_INSTRUCTION]
    assert utils.doc_to_text(open_q) == "Which object flashes near the end?"  # no instruction: the server keeps it
    assert utils.doc_to_text(mcq, {"pre_prompt": "<", "post_prompt": ">"}).startswith("<What colour")
    assert utils.doc_to_visual(mcq) == [mcq["video"]]


def test_the_server_reads_back_the_question_and_options_it_was_sent(mcq, open_q):
    from m1.serve import split_options

    assert split_options(utils.doc_to_text(mcq)) == (mcq["question"], mcq["options"])
    assert split_options(utils.doc_to_text(open_q)) == (open_q["question"], [])


@pytest.mark.parametrize("reply,right", [
    ("C", True), ("(C)", True), ("C. blue", True), ("The answer is C", True), ("blue", True),
    ("B", False), ("", False), ("I cannot tell", False), ("E", False), ("[12.0 - 14.0]", False),
])
def test_process_results_reads_the_option_letter_as_m1_eval_does(mcq, reply, right):
    scores = utils.process_results(mcq, [reply])
    assert scores == {"accuracy": float(right), "failed_requests": 0.0}
    q = Question(id="q1", video=mcq["video"], text=mcq["question"], options=mcq["options"], task="mcq", answer="C")
    assert bool(scores["accuracy"]) == is_correct(q, reply)  # the rule of `m1 eval -b jsonl`


@pytest.mark.parametrize("reply,right", [("cyan cross", True), ("Cyan cross.", True), ("a cyan cross", False),
                                         ("red cross", False), ("", False)])
def test_process_results_open_answers_by_normalised_text(open_q, reply, right):
    assert utils.process_results(open_q, [reply])["accuracy"] == float(right)


def test_failed_request_is_counted_wrong_and_flagged(mcq):
    reply = "[LMMS_EVAL_REQUEST_FAILED after 5 retries] Connection error. C"
    assert utils.is_failed_request(reply) and not utils.is_failed_request("C")
    assert utils.process_results(mcq, [reply]) == {"accuracy": 0.0, "failed_requests": 1.0}
    assert utils.count([1.0, 0.0, 1.0]) == 2.0


def test_records_it_cannot_use_are_refused_naming_the_field(mcq):
    with pytest.raises(utils.RecordError, match="'answer'"):
        utils.process_results({k: v for k, v in mcq.items() if k != "answer"}, ["C"])
    with pytest.raises(utils.RecordError, match="numeric"):
        utils.doc_to_text({**mcq, "task": "numeric", "options": []})
    with pytest.raises(utils.RecordError, match="at least 2 options"):
        utils.doc_to_text({**mcq, "options": ["red"]})
    with pytest.raises(utils.RecordError, match="not an existing absolute path"):
        utils.doc_to_visual({**mcq, "video": "v.mp4"})


def test_task_yaml_names_functions_that_exist_and_the_run_yaml_includes_it(tmp_path, mcq):
    base = yaml.load((TASK_DIR / "m1_synth_base.yaml").read_text(), Loader=_function_loader())
    refs = [base[k] for k in ("doc_to_visual", "doc_to_text", "process_results")]
    refs += [m["aggregation"] for m in base["metric_list"] if isinstance(m["aggregation"], tuple)]
    for tag, ref in refs:
        module, name = ref.split(".")
        assert tag == "!function" and module == "utils" and callable(getattr(utils, name)), ref
    assert {m["metric"] for m in base["metric_list"]} == set(utils.process_results(mcq, ["C"]))
    assert base["dataset_path"] == "json" and base["output_type"] == "generate_until"

    run = _load("m1_lmms_run", "run.py")
    q = Question(id="q1", video=mcq["video"], text=mcq["question"], options=mcq["options"], task="mcq", answer="C")
    m1_file, task_file, tasks = run.write_inputs(tmp_path, [q])
    task = yaml.safe_load((tasks / "m1_synth.yaml").read_text())
    assert task == {"task": "m1_synth", "include": str(TASK_DIR / "m1_synth_base.yaml"),
                    "dataset_kwargs": {"data_files": {"test": str(task_file)}}}
    record = json.loads(task_file.read_text())
    assert record == mcq and utils.doc_to_text(record)  # the record the task's functions read
    assert Question.model_validate_json(m1_file.read_text()) == q


@pytest.mark.lmms
@pytest.mark.slow
@pytest.mark.timeout(3600)
@pytest.mark.skipif(not os.access(LMMS, os.X_OK), reason="no .venv-lmms: `make lmms-eval` creates it and runs the "
                                                         "check (lmms-eval through m1 serve against m1 eval)")
def test_lmms_eval_through_m1_serve_agrees_with_m1_eval(tmp_path):
    done = subprocess.run([sys.executable, str(TASK_DIR / "run.py"), "--lmms-eval", str(LMMS), "--out",
                           str(tmp_path), "--questions", "12"], capture_output=True, text=True, cwd=ROOT)
    assert done.returncode == 0, done.stdout + done.stderr
    report = json.loads((tmp_path / "check.json").read_text())
    assert report["lmms_eval_accuracy"] == report["m1_eval_accuracy"] and report["failed_requests"] == 0
    assert report["answers_equal"] == report["questions"] == 12
