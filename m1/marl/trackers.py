"""Experiment trackers a run's metrics go to besides metrics.jsonl: TensorBoard, mlflow and wandb (`log.backends`).

Each backend's package is imported only when `log.backends` names it, and `require_trackers` names a missing one
(and the pip extra that brings it) before any model loads. Only the process of rank 0 (the driver; `RANK` unset or
0) opens trackers, so a launcher that starts several copies of the driver writes one run. The run's config and its
placement plan are logged as parameters; secrets never are (a config holds only the *names* of key variables,
and any key that looks like a secret is masked anyway).

A tracker run outlives a killed process: `run_ids()` is saved in every checkpoint (trainer_state.json), and a resumed
run hands it back, so mlflow and wandb continue the same run instead of starting a new one.
"""
from __future__ import annotations

import importlib.util
import logging
import math
import os
import re
from pathlib import Path
from collections.abc import Sequence
from typing import Any

from m1.config_files import ConfigError

log = logging.getLogger(__name__)

# backend -> (module that must be importable, the pip extra of m1 that installs it)
PACKAGES = {"tensorboard": ("tensorboard", None), "mlflow": ("mlflow", "mlflow"), "wandb": ("wandb", "wandb")}
_SECRET = re.compile(r"(api_?key|secret|password|token)(?!s?_env$)", re.I)
_MAX_PARAM = 6000  # mlflow's longest parameter value


def is_main_process() -> bool:
    """Rank 0 of a launcher (torchrun, deepspeed), or a plain process."""
    return os.environ.get("RANK", "0").strip() in ("", "0")


def require_trackers(backends: Sequence[str]) -> None:
    """ConfigError naming each backend of `log.backends` whose package is not installed, and how to install it."""
    missing = [b for b in backends if importlib.util.find_spec(PACKAGES[b][0]) is None]
    if missing:
        how = "; ".join(f"{b}: pip install 'm1[{PACKAGES[b][1]}]'" if PACKAGES[b][1] else
                        f"{b}: pip install {PACKAGES[b][0]}" for b in missing)
        raise ConfigError(f"log.backends names {missing}, not installed here ({how}); or leave "
                          f"{'it' if len(missing) == 1 else 'them'} out of log.backends")


def flat_params(data: Any, prefix: str = "") -> dict[str, str]:
    """A nested config as dotted keys with string values (what trackers show as parameters), secrets masked."""
    out: dict[str, str] = {}
    if isinstance(data, dict):
        for k, v in data.items():
            out.update(flat_params(v, f"{prefix}{k}."))
        return out
    key = prefix.rstrip(".")
    text = "" if data is None else str(data)
    out[key] = "***" if _SECRET.search(key.rsplit(".", 1)[-1]) and text else text[:_MAX_PARAM]
    return out


def plan_params(plan) -> dict[str, str]:
    """The placement plan (m1/marl/plan/placement_plan.py) as parameters: GPUs per node, each unit's GPUs and
    estimate."""
    if plan is None:
        return {"plan": "none: no GPUs, actors placed freely"}
    out = {"plan.nodes": str(plan.nodes), "plan.gpus": str(plan.gpus_needed), "plan.gpu_mem_gb": str(plan.gpu_mem_gb)}
    for u in plan.units:
        out[f"plan.{u.role}.{u.name}.gpus"] = str(u.gpus)
        if u.memory is not None:
            out[f"plan.{u.role}.{u.name}.peak_gb"] = f"{u.memory.peak:.2f}"
    return out


def _numbers(row: dict[str, Any]) -> dict[str, float]:
    return {k: float(v) for k, v in row.items() if k != "step" and isinstance(v, (int, float))
            and not isinstance(v, bool) and math.isfinite(v)}


# ================================================================================================ backends
class TensorBoard:
    name = "tensorboard"
    run_id = None  # its event files in <out_dir>/tensorboard are appended to on resume

    def __init__(self, out_dir: Path, params: dict[str, str], **_):
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(str(out_dir / "tensorboard"))
        self.writer.add_text("config", "\n".join(f"    {k}: {v}" for k, v in params.items()))

    def log(self, row: dict[str, Any], step: int) -> None:
        for k, v in _numbers(row).items():
            self.writer.add_scalar(k, v, step)
        self.writer.flush()

    def table(self, name: str, columns: list[str], rows: list[list], step: int) -> None:
        pass  # TensorBoard has no tables; the samples are on disk and in the other trackers

    def close(self, failed: bool = False) -> None:
        self.writer.close()


class Mlflow:
    """An mlflow run through `MlflowClient` (no global active run). Without a tracking URI, the file store
    <out_dir>/mlruns, which mlflow 3 keeps only behind MLFLOW_ALLOW_FILE_STORE (set here for that store only).
    The file store keeps a metric in a file named by its key, so `plans/entropy` and `plans/entropy/order` cannot
    both exist there: on a file store, metric names use '.' where the run's keys have '/'."""

    name = "mlflow"
    _BAD = re.compile(r"[^\w\-. /]")  # characters mlflow refuses in metric and parameter names

    def __init__(self, out_dir: Path, params: dict[str, str], run_name: str, settings, resume_id: str | None = None,
                 **_):
        from mlflow.entities import Param
        from mlflow.tracking import MlflowClient

        uri = settings.tracking_uri or os.environ.get("MLFLOW_TRACKING_URI") or (out_dir / "mlruns").resolve().as_uri()
        if uri.startswith("file:") or "://" not in uri:  # the file store (a sqlite: or http: URI needs no opt-in)
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        self.uri = uri
        self.file_store = uri.startswith("file:") or "://" not in uri
        self.client = client = MlflowClient(tracking_uri=uri)
        run = None
        if resume_id:
            try:
                run = client.get_run(resume_id)
            except Exception as exc:  # mlflow raises its own MlflowException for an unknown id
                log.warning("mlflow: the checkpoint's run %s is not in %s (%s); starting a new run", resume_id, uri,
                            exc)
        if run is None:
            experiment = settings.experiment or run_name
            found = client.get_experiment_by_name(experiment)
            exp_id = found.experiment_id if found is not None else client.create_experiment(experiment)
            run = client.create_run(exp_id, run_name=run_name)
            logged: dict[str, str] = {}
        else:
            client.update_run(run.info.run_id, status="RUNNING")
            logged = dict(run.data.params)
            log.info("mlflow: continuing run %s", run.info.run_id)
        self.run_id = run.info.run_id
        # parameters cannot change once logged: a resumed run adds new keys and keeps a changed value as a tag
        params = {self._key(k): v for k, v in params.items()}
        new = [Param(k, v) for k, v in params.items() if k not in logged]
        for i in range(0, len(new), 100):  # mlflow takes at most 100 parameters per batch
            client.log_batch(self.run_id, params=new[i:i + 100])
        for k, v in params.items():
            if k in logged and logged[k] != v:
                client.set_tag(self.run_id, f"resumed.{k}", v[:_MAX_PARAM])

    def _key(self, key: str) -> str:
        return self._BAD.sub("_", key)[:250]

    def log(self, row: dict[str, Any], step: int) -> None:
        import time

        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        metrics = [Metric(self._key(k.replace("/", ".") if self.file_store else k), v, now, step)
                   for k, v in _numbers(row).items()]
        for i in range(0, len(metrics), 1000):
            self.client.log_batch(self.run_id, metrics=metrics[i:i + 1000])

    def table(self, name: str, columns: list[str], rows: list[list], step: int) -> None:
        """mlflow's table artifact format ({"columns", "data"}), written without pandas."""
        self.client.log_dict(self.run_id, {"columns": columns, "data": rows}, f"{name}/step-{step:06d}.json")

    def close(self, failed: bool = False) -> None:
        self.client.set_terminated(self.run_id, "FAILED" if failed else "FINISHED")


class Wandb:
    """A wandb run (offline unless `log.wandb.mode: online`), its files under <out_dir>/wandb."""

    name = "wandb"

    def __init__(self, out_dir: Path, params: dict[str, str], run_name: str, settings, resume_id: str | None = None,
                 config: dict | None = None, **_):
        import wandb

        self.wandb = wandb
        self.run = wandb.init(project=settings.project or run_name, entity=settings.entity, name=run_name,
                              dir=str(out_dir), mode=settings.mode, id=resume_id,
                              resume="allow" if resume_id else None, config=params, reinit="create_new")
        self.run_id = self.run.id

    def log(self, row: dict[str, Any], step: int) -> None:
        self.run.log(_numbers(row), step=step)

    def table(self, name: str, columns: list[str], rows: list[list], step: int) -> None:
        self.run.log({name: self.wandb.Table(columns=columns, data=rows)}, step=step)

    def close(self, failed: bool = False) -> None:
        self.run.finish(exit_code=1 if failed else 0)


BACKENDS = {"tensorboard": TensorBoard, "mlflow": Mlflow, "wandb": Wandb}


class Trackers:
    """The backends `log.backends` names, opened on rank 0 only; each call goes to every one of them."""

    def __init__(self, backends: list[str], out_dir: Path, log_cfg, run_name: str, params: dict[str, str],
                 resume_ids: dict[str, str] | None = None):
        self.backends: list[Any] = []
        if not is_main_process():
            return
        require_trackers(backends)
        resume_ids = resume_ids or {}
        try:
            for b in backends:
                self.backends.append(BACKENDS[b](out_dir=Path(out_dir), params=params, run_name=run_name,
                                                 settings=getattr(log_cfg, b, None), resume_id=resume_ids.get(b)))
        except BaseException:
            self.close(failed=True)
            raise

    def run_ids(self) -> dict[str, str]:
        """What a checkpoint keeps so the resumed run continues the same tracker runs."""
        return {b.name: b.run_id for b in self.backends if b.run_id}

    def log(self, row: dict[str, Any]) -> None:
        for b in self.backends:
            b.log(row, int(row["step"]))

    def table(self, name: str, columns: list[str], rows: list[list], step: int) -> None:
        for b in self.backends:
            b.table(name, columns, rows, step)

    def close(self, failed: bool = False) -> None:
        for b in self.backends:
            try:
                b.close(failed)
            except Exception as exc:  # one tracker failing to close must not hide the others or the run's error
                log.warning("%s: closing the run failed: %s", b.name, exc)
        self.backends = []


def open_trackers(cfg, placement=None, resume_ids: dict[str, str] | None = None) -> Trackers:
    """The trackers of a MARL or SFT run (`cfg.log`), with its config and placement plan (`placement`: the
    RayPlacement it reserved, None on a CPU) as parameters, continuing `resume_ids` (from its checkpoint)."""
    params = flat_params(cfg.model_dump(mode="json"))
    params.update(plan_params(placement.plan if placement is not None else None))
    return Trackers(list(cfg.log.backends), Path(cfg.out_dir), cfg.log, cfg.name, params, resume_ids)
