"""lmms-eval as a real client of `m1 serve`: the field's harness scores a served team, and must agree with `m1 eval`.

Steps: make a small M1-Synth set (the mcq and open questions: the kinds a chat text carries without M1's own
fields), start `m1 serve` on a free port behind an API key, run `lmms-eval eval --model openai ... pass_video_url=True`
on the task of this folder (its YAML written per run, pointing at this run's JSONL), check its samples for failed
requests, run `m1 eval -b jsonl` on the same questions, print both accuracies side by side and every question whose
answers differ. Exit status 0 only when lmms-eval ran, no request failed, and accuracies and answers are equal.

The server is always stopped with SIGTERM (it finishes what is in flight). lmms-eval exits 0 even when its
evaluation failed, so its status is not trusted alone: its results and samples files must exist and be complete.

    python integrations/lmms_eval/run.py [--lmms-eval .venv-lmms/bin/lmms-eval] [--out runs/lmms-eval]
        [--questions 32] [--team mini_trained] [--seed 42]

`make lmms-eval` creates .venv-lmms (lmms-eval 0.7.3) once and runs this.
"""
from __future__ import annotations

import argparse
import json
import os
import secrets
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path.insert(0, str(HERE))  # utils.py: the task's own record checks and failed-request marker

import utils  # noqa: E402

TASK = "m1_synth"
BASE_YAML = HERE / "m1_synth_base.yaml"
QUESTIONS_PER_VIDEO = 4
DURATION = 40.0


class CheckError(RuntimeError):
    """The check could not be completed or did not agree; the message says which step and file."""


def make_world(folder: Path, n: int, seed: int) -> list:
    """The first n mcq/open questions of an M1-Synth world made in `folder` (kept between runs with the same
    parameters, like `m1 demo`'s data)."""
    from m1.data.questions import read_questions
    from m1.synth.make import make_dataset

    videos = n // 3 + 2  # about 3.5 of every 4 synth questions are mcq or open
    params = {"videos": videos, "seed": seed, "duration": DURATION, "questions_per_video": QUESTIONS_PER_VIDEO}
    stamp = folder / "params.json"
    if not stamp.is_file() or json.loads(stamp.read_text()) != params:
        make_dataset(folder, videos=videos, seed=seed, duration=DURATION, questions_per_video=QUESTIONS_PER_VIDEO,
                     progress=False)
        stamp.write_text(json.dumps(params))
    qs, issues = read_questions(folder / "questions.jsonl", folder)
    if issues:
        raise CheckError(f"{folder / 'questions.jsonl'}: {len(issues)} unreadable lines, first: {issues[0]}")
    usable = [q for q in qs if q.task in utils.TASKS]
    if len(usable) < n:
        raise CheckError(f"{folder}: {len(usable)} mcq/open questions in {videos} videos, {n} asked for; "
                         "ask for fewer with --questions")
    return usable[:n]


def write_inputs(out: Path, questions: list) -> tuple[Path, Path, Path]:
    """The same questions twice: M1's Question JSONL for `m1 eval -b jsonl`, and the task's flat JSONL; then the
    per-run task YAML (in a folder of its own, the --include_path)."""
    m1_file = out / "m1_questions.jsonl"
    m1_file.write_text("".join(json.dumps(q.model_dump(mode="json"), sort_keys=True) + "\n" for q in questions))
    task_file = out / "lmms_questions.jsonl"
    task_file.write_text("".join(json.dumps({
        "id": q.id, "video": str(Path(q.video).resolve()), "question": q.text, "options": q.options,
        "task": q.task, "answer": q.answer}) + "\n" for q in questions))
    tasks = out / "tasks"
    tasks.mkdir(exist_ok=True)
    yaml_path = tasks / f"{TASK}.yaml"
    yaml_path.write_text(f"# written by {Path(__file__).relative_to(ROOT)} for this run\n"
                         f"task: {TASK}\ninclude: {json.dumps(str(BASE_YAML))}\n"
                         f"dataset_kwargs:\n  data_files:\n    test: {json.dumps(str(task_file))}\n")
    return m1_file, task_file, tasks


def wait_ready(proc: subprocess.Popen, url: str, key: str, log: Path, limit_s: float) -> None:
    """Until GET /v1/models answers 200 (the team is loaded), the server dies, or `limit_s` passes."""
    end = time.monotonic() + limit_s
    req = urllib.request.Request(url, headers={"Authorization": f"Bearer {key}"})
    while time.monotonic() < end:
        if proc.poll() is not None:
            raise CheckError(f"m1 serve exited with status {proc.returncode} before it was ready; see {log}")
        try:
            with urllib.request.urlopen(req, timeout=5) as r:
                if r.status == 200:
                    return
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            pass  # not listening yet
        time.sleep(1)
    raise CheckError(f"m1 serve was not ready within {limit_s:.0f} s; see {log}")


def stop(proc: subprocess.Popen, limit_s: float = 120) -> int:
    """SIGTERM, then wait for the server to finish what is in flight; SIGKILL only if it does not stop in time."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(limit_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            raise CheckError(f"m1 serve did not stop within {limit_s:.0f} s of SIGTERM; killed") from None
    return proc.returncode


def read_lmms_output(output_path: Path) -> tuple[dict, list[dict]]:
    """(results of the task, its logged samples) from lmms-eval's output folder (one run in it)."""
    results = sorted(output_path.rglob("*_results.json"))
    samples = sorted(output_path.rglob(f"*_samples_{TASK}.jsonl"))
    if len(results) != 1 or len(samples) != 1:
        raise CheckError(f"{output_path}: expected one *_results.json and one *_samples_{TASK}.jsonl from lmms-eval, "
                         f"found {len(results)} and {len(samples)} (lmms-eval exits 0 when it fails: see its log)")
    res = json.loads(results[0].read_text())
    try:
        task_res = res["results"][TASK]
    except KeyError:
        raise CheckError(f"{results[0]}: no results.{TASK}") from None
    rows = [json.loads(line) for line in samples[0].read_text().splitlines() if line.strip()]
    return task_res, rows


def served_answers(samples: list[dict], questions: list) -> dict[str, str]:
    """{question id: the reply lmms-eval got} from its samples file. A sample names its record by `doc_id` (the
    line of the task's JSONL) and holds the reply as `filtered_resps` (the task has no filter, so it is the reply
    as sent); its `target` must be that question's answer, or the samples are not the ones this run wrote."""
    out = {}
    for s in samples:
        i = s.get("doc_id")
        if not isinstance(i, int) or not 0 <= i < len(questions):
            raise CheckError(f"lmms-eval sample with doc_id {i!r}: not a line of the {len(questions)}-question file")
        q = questions[i]
        if s.get("target") != q.answer:
            raise CheckError(f"lmms-eval sample {i}: target {s.get('target')!r}, but question {q.id!r} has answer "
                             f"{q.answer!r}")
        reply = s.get("filtered_resps")
        while isinstance(reply, list) and len(reply) == 1:
            reply = reply[0]
        if not isinstance(reply, str):
            raise CheckError(f"lmms-eval sample {i} ({q.id!r}): filtered_resps holds {reply!r}, not the reply text")
        out[q.id] = reply
    if len(out) != len(questions):
        raise CheckError(f"lmms-eval logged {len(out)} distinct samples for {len(questions)} questions")
    return out


def run(args) -> int:
    t_all = time.perf_counter()
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    lmms = Path(args.lmms_eval).absolute()  # lmms-eval runs in the output folder
    if not os.access(lmms, os.X_OK):
        raise CheckError(f"--lmms-eval {lmms}: not an executable; `make lmms-eval` creates .venv-lmms with it")
    world = out / "world"
    questions = make_world(world, args.questions, args.seed)
    m1_file, task_file, tasks = write_inputs(out, questions)
    kinds = {k: sum(q.task == k for q in questions) for k in utils.TASKS}
    print(f"{len(questions)} questions ({', '.join(f'{v} {k}' for k, v in kinds.items())}) in {world}")

    from m1.models.vllm_server import free_port

    port, key = free_port(), secrets.token_hex(16)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "M1_LMMS_KEY": key}
    serve_log = out / "serve.log"
    lmms_out = out / "lmms_output"
    if lmms_out.exists():  # one lmms-eval run per output folder, so its files are found unambiguously
        import shutil

        shutil.rmtree(lmms_out)
    with open(serve_log, "w") as log:
        proc = subprocess.Popen([sys.executable, "-m", "m1", "serve", "--team", args.team, "--port", str(port),
                                 "--allowed-media-root", str(world), "--api-key-env", "M1_LMMS_KEY"],
                                stdout=log, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
    try:
        t = time.perf_counter()
        wait_ready(proc, f"http://127.0.0.1:{port}/v1/models", key, serve_log, args.start_timeout)
        print(f"m1 serve --team {args.team} ready on port {port} after {time.perf_counter() - t:.1f} s")
        lmms_env = {**env, "HF_DATASETS_OFFLINE": "1", "HF_HOME": str(out / "hf_home"), "OPENAI_API_KEY": key,
                    "PYTHONUNBUFFERED": "1"}
        cmd = [str(lmms), "eval", "--model", "openai",
               "--model_args", f"model={args.team},base_url=http://127.0.0.1:{port}/v1,pass_video_url=True",
               "--tasks", TASK, "--include_path", str(tasks), "--output_path", str(lmms_out),
               "--batch_size", "1", "--log_samples"]
        t = time.perf_counter()
        with open(out / "lmms_eval.log", "w") as log:
            try:
                rc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, env=lmms_env, cwd=out,
                                    timeout=args.lmms_timeout).returncode
            except subprocess.TimeoutExpired:
                raise CheckError(f"lmms-eval ran past {args.lmms_timeout} s; see {out / 'lmms_eval.log'}") from None
        lmms_s = time.perf_counter() - t
    finally:
        serve_rc = stop(proc)
    if rc != 0:
        raise CheckError(f"lmms-eval exited with status {rc}; see {out / 'lmms_eval.log'}")
    if serve_rc not in (0, 143, -signal.SIGTERM):
        raise CheckError(f"m1 serve exited with status {serve_rc} after SIGTERM (expected 143); see {serve_log}")
    task_res, samples = read_lmms_output(lmms_out)
    served = served_answers(samples, questions)
    failed = [qid for qid, reply in served.items() if utils.is_failed_request(reply)]
    if failed or task_res.get("failed_requests,none") != 0:
        raise CheckError(f"{len(failed)} of {len(samples)} lmms-eval requests failed (LMMS_EVAL_REQUEST_FAILED), "
                         f"first {failed[:1]}; see {serve_log} and {out / 'lmms_eval.log'}")
    lmms_acc = task_res.get("accuracy,none")
    if not isinstance(lmms_acc, (int, float)):
        raise CheckError(f"lmms-eval results for {TASK}: no numeric 'accuracy,none' (keys: {sorted(task_res)})")

    t = time.perf_counter()
    eval_out = out / "m1_eval"
    cmd = [sys.executable, "-m", "m1", "eval", "--benchmark", "jsonl", "--annotations", str(m1_file),
           "--videos", str(world), "--team", args.team, "--out", str(eval_out)]
    preds = eval_out / "predictions.jsonl"
    preds.unlink(missing_ok=True)  # answers of an earlier run would be reused, not recomputed
    done = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True)
    (out / "m1_eval.log").write_text(done.stdout + done.stderr)
    if done.returncode != 0:
        raise CheckError(f"m1 eval exited with status {done.returncode}; see {out / 'm1_eval.log'}")
    eval_s = time.perf_counter() - t
    metrics = json.loads((eval_out / "metrics.json").read_text())
    m1_acc = metrics["accuracy"]
    m1_answers = {}
    for line in preds.read_text().splitlines():
        row = json.loads(line)
        m1_answers[row["id"]] = row["answer"] if row["answer"] is not None else ""

    differ = [(q.id, served.get(q.id), m1_answers.get(q.id)) for q in questions
              if served.get(q.id) != m1_answers.get(q.id)]
    same_acc = round(lmms_acc * len(questions)) == metrics["correct"] and abs(lmms_acc - m1_acc) < 1e-12
    total_s = time.perf_counter() - t_all
    report = {"questions": len(questions), "kinds": kinds, "team": args.team,
              "lmms_eval_accuracy": lmms_acc, "m1_eval_accuracy": m1_acc, "m1_eval_correct": metrics["correct"],
              "answers_equal": len(questions) - len(differ), "failed_requests": len(failed),
              "lmms_eval_s": round(lmms_s, 1), "m1_eval_s": round(eval_s, 1), "total_s": round(total_s, 1),
              "serve_exit_status": serve_rc}
    (out / "check.json").write_text(json.dumps(report, indent=1) + "\n")
    print(f"\n{'':28}{'lmms-eval via m1 serve':>24}{'m1 eval':>12}")
    print(f"{'accuracy':28}{lmms_acc:>24.4f}{m1_acc:>12.4f}")
    print(f"{'correct / questions':28}{round(lmms_acc * len(questions)):>20} / {len(questions)}"
          f"{metrics['correct']:>7} / {len(questions)}")
    print(f"{'wall time':28}{lmms_s:>22.1f} s{eval_s:>10.1f} s")
    print(f"answers equal: {len(questions) - len(differ)}/{len(questions)}; failed requests: 0; "
          f"server exit status after SIGTERM: {serve_rc}; total {total_s:.1f} s; report: {out / 'check.json'}")
    for qid, a, b in differ:
        print(f"  differs: {qid}: served {a!r}, m1 eval {b!r}")
    if not same_acc or differ:
        print("FAIL: lmms-eval's accuracy through m1 serve and m1 eval's disagree", file=sys.stderr)
        return 1
    print("OK: lmms-eval through m1 serve agrees with m1 eval")
    return 0


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--lmms-eval", default=str(ROOT / ".venv-lmms" / "bin" / "lmms-eval"),
                   help="the lmms-eval executable (of its own venv)")
    p.add_argument("--out", default=str(ROOT / "runs" / "lmms-eval"), help="folder for the world, logs and reports")
    p.add_argument("--questions", type=int, default=32, help="how many mcq/open M1-Synth questions")
    p.add_argument("--team", default="mini_trained")
    p.add_argument("--seed", type=int, default=42, help="M1-Synth world seed")
    p.add_argument("--start-timeout", type=float, default=300, help="seconds for m1 serve to load the team")
    p.add_argument("--lmms-timeout", type=float, default=1800, help="seconds for the lmms-eval run")
    args = p.parse_args()
    if args.questions < 1:
        p.error("--questions must be >= 1")
    try:
        sys.exit(run(args))
    except CheckError as exc:
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
