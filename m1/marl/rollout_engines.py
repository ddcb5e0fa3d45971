"""Rollout engines for training: a vLLM server per trained agent, its weights synced before every step.

With `rollout.engine: vllm` the team generates through `EngineChat` clients (m1/models/vllm_client.py) instead of the
learners' own Hugging Face `generate`. The servers are either the user's (`rollout.engine_url`) or launched here:
on GPU clusters as Ray actors in the engine bundles of the placement plan, on a machine without a plan as local
processes. Before each step's rollouts the learners' current weights go to their engines through shared storage:

- LoRA: the learner's rank 0 writes its adapter to `<out_dir>/engine_weights/<agent>/v<step>`, the engine loads it
  at run time under the name `<agent>-v<step>`, requests switch to it, and the previous adapter is unloaded and its
  folder removed (vLLM's runtime LoRA loading);
- full fine-tuning: rank 0 writes the whole model there, its weight files replace those of the engine's own model
  folder and the engine reloads them (vLLM's dev-mode `collective_rpc` reload_weights, checked with a probe against
  the log-probs of the learner's rank 0; the seconds it takes are logged as `<agent>/sync_seconds`). An engine
  launched here therefore serves a copy of the model that M1 owns, `<out_dir>/engines/model-<agent>`; a user's
  engine (`rollout.engine_url`) has the folder it was started from overwritten, so it must be started from a copy.
  Broadcasting the weights into the engine's workers over NCCL, as verl and OpenRLHF do, is not built: this reload
  is the only full-weight path.

Every completion carries the weight version that sampled it, and the trainer refuses a step whose samples came
from another version than the learners hold (`check_versions`).
"""
from __future__ import annotations

import logging
import os
import shutil
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any

from m1.config import ModelSpec
from m1.contracts import RolloutEngine
from m1.marl.config import TrainConfig
from m1.marl.rollout.episodes import RolloutError
from m1.models.hf import HFChatModel, resolve_source
from m1.models.vllm_client import EngineChat, EngineError
from m1.models.vllm_server import CPU_BIND_ENV, EngineHost, EngineServer, cpu_core_shares, free_port, vllm_command

if TYPE_CHECKING:
    from m1.marl.actor.sampler import Sampler

log = logging.getLogger(__name__)

WEIGHTS_DIR = "engine_weights"


def _tokenizer(spec: ModelSpec, key: str):
    """The agent's own tokenizer (the learner's), so prompts are rendered and cut exactly as the learner scores."""
    from transformers import AutoTokenizer

    source, local_only = resolve_source(spec, key)
    tok = AutoTokenizer.from_pretrained(source, local_files_only=local_only,
                                        **({"trust_remote_code": True} if spec.trust_remote_code else {}))
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    return tok


def _fill(argv: list[str], **fields: Any) -> list[str]:
    """An argv template with {model}, {port}, {host}, {lora_rank}, {gpu_memory_utilization} filled in."""
    out = []
    for a in argv:
        for k, v in fields.items():
            a = a.replace("{" + k + "}", str(v))
        out.append(a)
    return out


class StagedVersions:
    """What every RolloutEngine (m1/contracts.py) does the same way, whatever its samplers are: `_staged` maps
    agent -> version -> what was staged for it."""

    _staged: dict[str, dict[int, Any]]

    def newest_staged(self) -> int:
        """The newest version staged for every agent (-1: none)."""
        return min((max(v, default=-1) for v in self._staged.values()), default=-1)

    def check_versions(self, samples: dict[str, list], version: int) -> None:
        """Refuse to train on samples of these agents that other weights than version `version` generated."""
        for agent, rows in samples.items():
            if agent not in self._staged:
                continue
            stale = sorted({s.weight_version for s in rows if s.weight_version != version}, key=str)
            if stale:
                raise RolloutError(f"agent {agent}: samples from weight versions {stale}, expected version "
                                   f"{version}; the engine did not take the synced weights")

    def sync(self: RolloutEngine, version: int) -> dict[str, float]:
        """Put the learners' current weights into the samplers as `version` (stage, activate, prune: a
        synchronous step); seconds per agent."""
        if version == self.version:
            return {}
        staged = self.stage(version)
        active = self.activate(version)
        self.prune(version)
        return {agent: staged[agent] + active[agent] for agent in staged}


class RolloutEngines(StagedVersions):
    """One engine per trained agent: the team's chat models for those agents, and the weight sync."""

    def __init__(self, cfg: TrainConfig, specs: dict[str, tuple[str, ModelSpec]], learners, placement=None):
        self.cfg, self.learners = cfg, learners
        self.out = Path(cfg.out_dir).resolve()
        self.lora = cfg.learner.finetune == "lora"
        self.version: int | None = None  # the version the engines serve
        # agent -> version -> (weights folder, the learner's probe log-probs for a full reload) staged on its engine
        self._staged: dict[str, dict[int, tuple[Path, Any]]] = {}
        self._adapters: dict[str, list[int]] = {}  # agent -> versions whose LoRA adapters were activated, not unloaded
        self._servers: dict[str, Any] = {}  # agent -> a local EngineServer or a Ray EngineHost actor
        self._cpu_binds: dict[str, str] = {}  # agent -> cores of the engine launched here (VLLM_CPU_OMP_THREADS_BIND)
        self._model_dirs: dict[str, Path] = {}  # agent -> the model folder its launched engine serves from
        self.chats: dict[str, EngineChat] = {}
        urls = self._urls(specs, placement)
        learner = cfg.learner
        for agent, (key, spec) in specs.items():
            chat = EngineChat(key, urls[agent], _tokenizer(spec, key), agent=agent, served_model=agent,
                              max_prompt_tokens=learner.max_prompt_tokens,
                              max_completion_tokens=learner.max_completion_tokens,
                              timeout=cfg.rollout.engine_timeout_s, model_dir=self._model_dirs.get(agent))
            names = chat.models()  # the base model's name, as the server calls it (the first it lists)
            if not names:
                raise EngineError(f"agent {agent}: rollout engine {urls[agent]} serves no model")
            chat.serve(names[0], -1)  # version -1 until the first sync: never the version of a step
            self.chats[agent] = chat
            self._staged[agent], self._adapters[agent] = {}, []

    # ------------------------------------------------------------------ servers
    def _urls(self, specs: dict[str, tuple[str, ModelSpec]], placement) -> dict[str, str]:
        given = self.cfg.rollout.engine_url
        if given:
            return {a: given for a in specs} if isinstance(given, str) else dict(given)
        logs = self.out / "engines"
        logs.mkdir(parents=True, exist_ok=True)
        # All engines start at once: a vLLM server spends minutes loading and compiling, and one after another
        # that wait grows with the team. Every launch is awaited before any failure is raised, so close() then
        # stops each engine that did start, and the error names every agent whose engine did not. The folders are
        # resolved first, in this thread: building a tiny model or merging an adapter imports transformers, whose
        # lazy imports are not safe from several threads at once.
        models = {agent: self._seated_path(agent, spec, key, logs) for agent, (key, spec) in specs.items()}
        self._cpu_binds = self._core_shares(list(models), placement)
        urls: dict[str, str] = {}
        failed: dict[str, BaseException] = {}
        try:
            with ThreadPoolExecutor(max_workers=max(1, len(specs)), thread_name_prefix="engine-start") as pool:
                started = {agent: pool.submit(self._launch, agent, model, logs, placement)
                           for agent, model in models.items()}
                for agent, future in started.items():
                    try:
                        urls[agent] = future.result()
                    except BaseException as exc:  # noqa: BLE001 - collected, reported together below
                        failed[agent] = exc
        except BaseException:
            self.close()
            raise
        if failed:
            self.close()
            lines = [str(e) if str(e).startswith(f"agent {a}") else f"agent {a}: {type(e).__name__}: {e}"
                     for a, e in failed.items()]
            raise EngineError(f"{len(failed)} of {len(specs)} rollout engines failed to start (the others were "
                              "stopped): " + "; ".join(lines)) from next(iter(failed.values()))
        return urls

    @staticmethod
    def _core_shares(agents: list[str], placement) -> dict[str, str]:
        """Cores for each engine this process launches itself, so that vLLM-CPU engines side by side compute at
        once rather than all on vLLM's default cores. Left to vLLM for a lone engine, and when the user set
        VLLM_CPU_OMP_THREADS_BIND (it then applies to every engine)."""
        local = [a for a in agents if placement is None or ("engine", a, 0) not in placement.bundles.index]
        if len(local) < 2 or CPU_BIND_ENV in os.environ:
            return {}
        return dict(zip(local, cpu_core_shares(len(local))))

    def _seated_path(self, agent: str, spec: ModelSpec, key: str, logs: Path) -> str:
        """The weights the agent is seated with, as a folder an engine can serve. The learner merges a model's SFT
        `adapter` into its base (HFChatModel), so an engine launched on the bare `path` would sample from other
        weights than the ones trained; such a model is merged here too and written to <logs>/seated-<agent>."""
        if spec.adapter is None:
            return self._model_path(spec, key)

        target, tmp = logs / f"seated-{agent}", logs / f".seated-{agent}.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        chat = HFChatModel(spec.model_copy(update={"device": "cpu"}), key)  # merged on the CPU, GPUs stay free
        chat.model.save_pretrained(tmp)
        chat.tokenizer.save_pretrained(tmp)
        shutil.rmtree(target, ignore_errors=True)
        os.replace(tmp, target)
        return str(target)

    @staticmethod
    def _model_path(spec: ModelSpec, key: str) -> str:
        return resolve_source(spec, key)[0]

    def _argv(self, model: str) -> list[str]:
        lora_rank = self.cfg.learner.lora.r if self.lora else None
        template = self.cfg.rollout.engine_command
        if template is None:
            learner = self.cfg.learner
            return vllm_command(model, "{port}", lora_rank=lora_rank, host="{host}", seed=self.cfg.seed,
                                max_model_len=learner.max_prompt_tokens + learner.max_completion_tokens)
        return _fill(list(template), model=model, lora_rank=lora_rank or 0,
                     gpu_memory_utilization=0.85)

    def _launch(self, agent: str, model: str, logs: Path, placement) -> str:
        if not self.lora:  # full-weight syncs overwrite the engine's folder: never the user's model
            model = str(self._own_copy(agent, model, logs))
        argv = self._argv(model)
        dev_mode = not self.lora  # full weights are reloaded through vLLM's dev-mode collective_rpc
        if placement is not None and ("engine", agent, 0) in placement.bundles.index:
            import ray

            if self.cfg.cluster.engine_gpus > 1:
                raise EngineError(f"agent {agent}: a tensor-parallel engine ({self.cfg.cluster.engine_gpus} GPUs) "
                                  "is not launched by M1; run it yourself and give rollout.engine_url")
            host: Any = ray.remote(EngineHost).options(**placement.options("engine", agent, 0)).remote(agent, str(logs))
            self._servers[agent] = host
            return ray.get(host.start.remote(model, argv=argv, dev_mode=dev_mode))

        port = free_port()
        bind = self._cpu_binds.get(agent)
        server = EngineServer(_fill(argv, port=port, host="127.0.0.1"), logs / f"engine-{agent}.log", port=port,
                              dev_mode=dev_mode, name=f"agent {agent}: rollout engine",
                              env={CPU_BIND_ENV: bind} if bind else None)
        self._servers[agent] = server
        return server.start()

    def _own_copy(self, agent: str, model: str, logs: Path) -> Path:
        """A fresh copy of the model folder for the agent's engine (a hub name: its files in the local hub cache)."""
        source = Path(model)
        if not source.is_dir():
            from huggingface_hub import snapshot_download

            try:
                source = Path(snapshot_download(model, local_files_only=True))
            except Exception as exc:
                raise EngineError(f"agent {agent}: full fine-tuning on a rollout engine needs the model {model!r} as "
                                  f"local files (the engine serves a copy that every sync overwrites): {exc}") from None
        target = logs / f"model-{agent}"
        shutil.rmtree(target, ignore_errors=True)
        shutil.copytree(source, target)
        self._model_dirs[agent] = target
        return target

    def close(self) -> None:
        """Stop the engines launched here (the user's are left running)."""
        for agent, server in list(self._servers.items()):
            try:
                if isinstance(server, EngineServer):
                    server.stop()
                else:
                    import ray

                    ray.get(server.stop.remote())
                    ray.kill(server)
            except Exception as exc:  # stopping is best effort at shutdown; say what was left behind
                log.warning("agent %s: could not stop its rollout engine: %s", agent, exc)
        self._servers.clear()

    # ------------------------------------------------------------------ generation and sync
    def chat_models(self) -> dict[str, EngineChat]:
        return dict(self.chats)

    def stage(self, version: int) -> dict[str, float]:
        """Export the learners' current weights as `version` and get the engines ready to switch to it, without
        switching: LoRA adapters are loaded under a new name while requests on the old one go on; full weights are
        written to disk with the learner's probe log-probs (the reload itself waits for `activate`, as it cannot
        overlap requests). Runs where the learners live (the trainer's thread); seconds per agent."""
        return self._each(lambda agent: self._stage_one(agent, version, self.out / WEIGHTS_DIR / agent /
                                                        f"v{version:06d}", export=True))

    def stage_from(self, version: int, folders: dict[str, Path]) -> dict[str, float]:
        """Stage `version` from weights saved earlier (a resumed asynchronous run's checkpoint): {agent: folder}."""
        return self._each(lambda agent: self._stage_one(agent, version, folders[agent], export=False))

    def activate(self, version: int) -> dict[str, float]:
        """Later requests of every engine use the staged `version`: switch the served adapter, or reload the full
        weights (checked with the probe); adapters of older versions are unloaded. Call between requests of the
        caller's own (the producer's thread in an asynchronous run); seconds per agent."""
        seconds = self._each(lambda agent: self._activate_one(agent, version))
        self.version = version
        return seconds

    def prune(self, below: int) -> None:
        """Remove the weight folders of versions older than `below` (kept until then so a checkpoint can copy
        them)."""
        for agent in self.chats:
            for v in [v for v in self._staged[agent] if v < below]:
                folder, _ = self._staged[agent].pop(v)
                if folder.is_relative_to(self.out / WEIGHTS_DIR):
                    shutil.rmtree(folder, ignore_errors=True)

    def staged_folder(self, agent: str, version: int) -> Path:
        """The folder `version`'s weights of `agent` were staged from (a checkpoint copies it)."""
        return self._staged[agent][version][0]

    def _each(self, fn) -> dict[str, float]:
        with ThreadPoolExecutor(max_workers=max(1, len(self.chats))) as pool:
            return dict(zip(self.chats, pool.map(fn, list(self.chats))))

    def _stage_one(self, agent: str, version: int, folder: Path, export: bool) -> float:
        t0 = time.perf_counter()
        chat = self.chats[agent]
        if export:
            shutil.rmtree(folder, ignore_errors=True)
            self.learners.export_weights(agent, folder)
        probe = None
        if self.lora:
            chat.load_adapter(f"{agent}-v{version}", folder)
        elif export:  # the learner's log-probs at these weights, computed now: by activate it may have moved on
            probe = self.learners.probe_logprobs(agent, chat.probe())
        self._staged[agent][version] = (folder, probe)
        return time.perf_counter() - t0

    def _activate_one(self, agent: str, version: int) -> float:
        t0 = time.perf_counter()
        chat = self.chats[agent]
        if version not in self._staged[agent]:
            raise RolloutError(f"agent {agent}: weight version {version} was never staged on its engine "
                               f"(staged: {sorted(self._staged[agent])})")
        folder, probe = self._staged[agent][version]
        if self.lora:
            name = f"{agent}-v{version}"
            chat.serve(name, version)
            for old in [v for v in self._adapters[agent] if v < version]:  # no request of ours names it any more
                chat.unload_adapter(f"{agent}-v{old}")
                self._adapters[agent].remove(old)
            self._adapters[agent].append(version)
        else:
            expect, tolerance = probe if probe is not None else (None, 0.0)
            chat.reload_weights(folder, version, expect=expect, tolerance=tolerance)
        return time.perf_counter() - t0

# ------------------------------------------------------------------------------------------------ hf samplers
class HFSampler:
    """A trained agent's chat model for asynchronous rollouts on the hf engine: a copy of its learner's model at a
    staged weight version, generating under the learner's caps (`Sampler.generate_with`, m1/marl/actor/sampler.py)
    and stamping the version on every completion, so the learners update their own weights while the producer
    samples."""

    def __init__(self, sampler: Sampler):
        import copy

        self.sampler, self.name, self.accepts_images = sampler, sampler.name, sampler.accepts_images
        self.chat = copy.copy(sampler.chat)  # the same settings; its own model and tokenizer below
        self.chat.tokenizer = copy.deepcopy(sampler.chat.tokenizer)  # a fast tokenizer is not safe across threads
        if hasattr(self.chat, "processor"):
            self.chat.processor = self.chat.tokenizer if sampler.chat.processor is sampler.chat.tokenizer else \
                copy.deepcopy(sampler.chat.processor)
        self.chat.model = copy.deepcopy(sampler.policy).eval().requires_grad_(False)
        self.version = -1

    def trainable_state(self) -> dict[str, Any]:
        """A copy of the learner's trainable tensors now (LoRA: the adapter; full fine-tuning: every weight)."""
        return {n: p.detach().clone() for n, p in self.sampler.policy.named_parameters() if p.requires_grad}

    def load(self, state: dict[str, Any], version: int) -> None:
        import torch

        params = dict(self.chat.model.named_parameters())
        missing = set(state) - set(params)
        if missing:
            raise RolloutError(f"agent {self.sampler.agent}: staged weights name parameters the sampler copy lacks: "
                               f"{sorted(missing)[:3]}")

        with torch.no_grad():
            for n, t in state.items():
                params[n].copy_(t)
        self.version = version

    def generate(self, requests, params):
        outs = self.sampler.generate_with(self.chat, requests, params)
        for o in outs:
            o.meta["weight_version"] = self.version
        return outs


class HFSamplers(StagedVersions):
    """The engines' interface (stage, activate, prune, versions) for asynchronous rollouts on the hf engine: one
    `HFSampler` per trained agent, in this process. Staged versions are kept in memory; a checkpoint writes the ones
    it needs (`staged_folder`)."""

    FILE = "sampler_weights.pt"

    def __init__(self, learners, out_dir: str | Path):
        local = getattr(learners, "learners", None)
        if local is None:
            raise ValueError("rollout.max_staleness > 0 with rollout.engine hf needs placement: local (the sampler "
                             "copies live beside the learners in this process); use rollout.engine vllm under Ray")
        self.samplers = {agent: HFSampler(learner.sampler) for agent, learner in local.items()}
        self.out = Path(out_dir).resolve()
        self.version: int | None = None
        self._staged: dict[str, dict[int, dict[str, Any]]] = {a: {} for a in self.samplers}

    def chat_models(self) -> dict[str, HFSampler]:
        return dict(self.samplers)

    def stage(self, version: int) -> dict[str, float]:
        return self._each(lambda agent: self._put(agent, version, self.samplers[agent].trainable_state()))

    def stage_from(self, version: int, folders: dict[str, Path]) -> dict[str, float]:
        import torch

        return self._each(lambda agent: self._put(
            agent, version, torch.load(Path(folders[agent]) / self.FILE, weights_only=True)))

    def activate(self, version: int) -> dict[str, float]:
        seconds = self._each(lambda agent: self._load(agent, version))
        self.version = version
        return seconds

    def _put(self, agent: str, version: int, state: dict[str, Any]) -> None:
        self._staged[agent][version] = state

    def _load(self, agent: str, version: int) -> None:
        if version not in self._staged[agent]:
            raise RolloutError(f"agent {agent}: weight version {version} was never staged on its sampler "
                               f"(staged: {sorted(self._staged[agent])})")
        self.samplers[agent].load(self._staged[agent][version], version)

    def _each(self, fn) -> dict[str, float]:
        """fn(agent) for every agent in turn (one process: nothing to overlap); seconds per agent."""
        seconds = {}
        for agent in self.samplers:
            t0 = time.perf_counter()
            fn(agent)
            seconds[agent] = time.perf_counter() - t0
        return seconds

    def prune(self, below: int) -> None:
        for agent, versions in self._staged.items():
            for v in [v for v in versions if v < below]:
                del versions[v]
                shutil.rmtree(self.out / WEIGHTS_DIR / agent / f"v{v:06d}", ignore_errors=True)

    def staged_folder(self, agent: str, version: int) -> Path:
        """The staged weights written to a folder of their own (a checkpoint copies it)."""
        import torch

        folder = self.out / WEIGHTS_DIR / agent / f"v{version:06d}"
        if not (folder / self.FILE).is_file():
            folder.mkdir(parents=True, exist_ok=True)
            torch.save(self._staged[agent][version], folder / self.FILE)
        return folder

    def close(self) -> None:
        pass
