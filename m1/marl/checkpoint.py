"""Training checkpoints: one folder per saved step, written atomically, verified before a resume; graceful stops.

A checkpoint holds each learner's weights (or adapter) and optimizer state, the process RNG states and the trainer's
state (step, data cursor, seed, agents), so a resumed run repeats an uninterrupted one exactly on CPU.

What can go wrong and what guards it:

- a run killed while writing: everything goes to a hidden temp folder that is renamed into place only when complete,
  and the `latest` marker is replaced atomically after the rename; a failed write (a full disk) removes the temp
  folder and leaves the earlier checkpoints and the marker as they were;
- bytes that change or go missing later (a torn copy, a file truncated by a crash, a bad disk): the last file written
  is `manifest.json`, every file's path, size and sha256. A resume checks the newest checkpoint against it and stops
  with an error naming the file, unless asked (`checkpoint.resume_from: previous`, `--resume-from previous`) to
  resume from the newest intact one. Checkpoints written before manifests existed still load, with a warning;
- a job stopped by SIGTERM (Slurm, Kubernetes) or Ctrl-C: `stop_on_signals` turns the first signal into a flag the
  training loops read after each step; they write a checkpoint of that step and return. A second signal stops at once.
"""
from __future__ import annotations

import errno
import hashlib
import json
import logging
import os
import re
import shutil
import signal
import sys
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from m1.marl.actor.learner_io import rng_state, set_rng_state

log = logging.getLogger(__name__)

CHECKPOINT_DIR = "checkpoints"
LATEST = "latest"
MANIFEST = "manifest.json"
STATE = "trainer_state.json"
_STEP = re.compile(r"^step-(\d+)$")


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be resumed from; the message names the folder, the file and what to do."""


# ------------------------------------------------------------------------------------------------ manifests
def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
    return h.hexdigest()


def _hashes(paths: list[Path]) -> list[str]:
    """sha256 of many files at once (hashlib releases the GIL: a 100 GB full fine-tune is disk-bound, not CPU-bound)."""
    if len(paths) < 2:
        return [_sha256(p) for p in paths]
    with ThreadPoolExecutor(max_workers=min(8, len(paths), os.cpu_count() or 1)) as pool:
        return list(pool.map(_sha256, paths))


def write_manifest(folder: Path) -> Path:
    """`folder/manifest.json`: path, size and sha256 of every file below `folder`, written last and atomically, so
    its presence means every file it lists was complete."""
    folder = Path(folder)
    files = sorted((p for p in folder.rglob("*")
                    if p.is_file() and p.relative_to(folder).as_posix() not in (MANIFEST, MANIFEST + ".tmp")),
                   key=lambda p: p.relative_to(folder).as_posix())
    entries = [{"path": p.relative_to(folder).as_posix(), "size": p.stat().st_size, "sha256": h}
               for p, h in zip(files, _hashes(files))]
    tmp = folder / (MANIFEST + ".tmp")
    with open(tmp, "w") as f:
        json.dump({"files": entries}, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, folder / MANIFEST)
    return folder / MANIFEST


def checkpoint_problem(folder: Path) -> str | None:
    """What is wrong with a checkpoint folder, in words naming the file; None when every file matches the manifest.

    A checkpoint written before manifests existed (no manifest.json, and its trainer_state.json does not say it has
    one) cannot be verified: None, with a warning.
    """
    folder = Path(folder)
    manifest = folder / MANIFEST
    if not manifest.is_file():
        state = folder / STATE
        if not state.is_file():
            return f"{STATE} is missing (and it has no {MANIFEST})"
        try:
            wrote_manifest = json.loads(state.read_text()).get("manifest", False)
        except (ValueError, AttributeError):
            return f"{STATE} is not valid JSON (and it has no {MANIFEST})"
        if wrote_manifest:
            return f"{MANIFEST} is missing"
        log.warning("checkpoint %s was written before checkpoints had manifests: its files cannot be verified",
                    folder)
        return None
    try:
        entries = [(str(e["path"]), int(e["size"]), str(e["sha256"])) for e in json.loads(manifest.read_text())["files"]]
    except (ValueError, KeyError, TypeError) as exc:
        return f"{MANIFEST} cannot be read ({exc})"
    for rel, size, _ in entries:  # sizes first: a truncated file is found without reading anything
        path = folder / rel
        if not path.is_file():
            return f"{rel} is missing"
        if path.stat().st_size != size:
            return f"{rel} has {path.stat().st_size} bytes, the manifest says {size}"
    for (rel, _, want), got in zip(entries, _hashes([folder / e[0] for e in entries])):
        if got != want:
            return f"{rel} does not match its sha256 in the manifest (its bytes changed after it was written)"
    return None


def _state_of(folder: Path) -> dict[str, Any]:
    try:
        return json.loads((folder / STATE).read_text())
    except (OSError, ValueError):
        return {}


# ------------------------------------------------------------------------------------------------ which checkpoints
def _step_of(folder: Path) -> int:
    m = _STEP.match(folder.name)
    return int(m.group(1)) if m else -1


def checkpoint_history(out_dir: Path) -> list[Path]:
    """The run's checkpoint folders, newest first: the one `latest` names, then those of earlier steps.

    Folders of later steps than `latest` belong to a history the run left (a resume from an earlier checkpoint, or a
    run with checkpoint.resume off) and are not part of it. Without a usable marker: every step folder.
    """
    root = Path(out_dir) / CHECKPOINT_DIR
    if not root.is_dir():
        return []
    folders = sorted((p for p in root.iterdir() if _STEP.match(p.name) and p.is_dir()), key=_step_of, reverse=True)
    marker = root / LATEST
    if marker.is_file():
        try:
            name = marker.read_text().strip()
        except OSError:
            name = ""
        newest = next((p for p in folders if p.name == name), None)
        if newest is not None:
            return [newest] + [p for p in folders if _step_of(p) < _step_of(newest)]
    return folders


def find_latest_checkpoint(out_dir: Path) -> Path | None:
    """The newest checkpoint of a run, unverified (e.g. to name its weights); resumes use `resume_point`."""
    history = checkpoint_history(out_dir)
    return history[0] if history else None


def _mark_latest(root: Path, name: str) -> None:
    tmp = root / f".{LATEST}.tmp"
    tmp.write_text(name)
    os.replace(tmp, root / LATEST)


def resume_point(out_dir: Path, resume_from: str = "latest") -> Path | None:
    """The verified checkpoint a run resumes from, or None when there is none.

    latest: the newest; a damaged one is a CheckpointError naming the file and the intact checkpoint
    `--resume-from previous` would use. previous: the newest intact one (a warning names each damaged one skipped,
    and `latest` is pointed at the one used, so the skipped ones are left out of the run from then on).
    """
    history = checkpoint_history(out_dir)
    root = Path(out_dir) / CHECKPOINT_DIR
    damaged: list[tuple[Path, str]] = []
    for folder in history:
        problem = checkpoint_problem(folder)
        if problem is None:
            if damaged:
                for bad, why in damaged:
                    log.warning("skipping damaged checkpoint %s (%s); resuming from %s", bad, why, folder.name)
                _mark_latest(root, folder.name)
            return folder
        damaged.append((folder, problem))
        if resume_from != "previous":
            intact = next((p for p in history[1:] if checkpoint_problem(p) is None), None)
            todo = (f"rerun with --resume-from previous (config: checkpoint.resume_from=previous) to resume from "
                    f"{intact.name} (intact), or delete the damaged folder" if intact is not None else
                    "no earlier checkpoint is intact: delete the damaged folder to start again from step 0")
            raise CheckpointError(f"checkpoint {folder} is damaged: {problem}; {todo}")
    if damaged:
        listed = "; ".join(f"{p.name}: {why}" for p, why in damaged)
        raise CheckpointError(f"no intact checkpoint in {root} ({listed}): delete {root} to start again from step 0")
    return None


# ------------------------------------------------------------------------------------------------ save / load
def _disk_full(exc: BaseException, where: Path) -> bool:
    """Whether a failed write ran out of space: ENOSPC/EDQUOT anywhere in the chain, the words of the libraries that
    do not raise OSError (safetensors' StorageFull), or torch's own writer failing on a nearly full disk (its bare
    "file write failed", or "[enforce fail at inline_container.cc] ... unexpected pos" when a write came up short)."""
    seen = exc
    while seen is not None:
        if isinstance(seen, OSError) and seen.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        text = str(seen)
        if "No space left on device" in text or "StorageFull" in text or "Disk quota exceeded" in text:
            return True
        if "file write failed" in text or ("inline_container" in text and "unexpected pos" in text):
            try:
                return shutil.disk_usage(where).free < 64 * 2**20
            except OSError:
                return False
        seen = seen.__cause__ or seen.__context__
    return False


def save_state_file(state: dict[str, Any], path: Path) -> None:
    """torch.save `state` to `path` atomically (a temp file beside it, renamed over it), for a run whose checkpoint is
    one file (`m1 pretrain`): a run killed mid-write keeps the previous file, and a full disk is an OSError(ENOSPC)
    naming `path` with the temp file removed, as `save_checkpoint` does for a folder."""
    import torch

    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        torch.save(state, tmp)
    except BaseException as exc:
        tmp.unlink(missing_ok=True)
        if isinstance(exc, Exception) and _disk_full(exc, path.parent):
            raise OSError(errno.ENOSPC, "No space left on device", str(path)) from exc
        raise
    os.replace(tmp, path)


def save_checkpoint(out_dir: Path, step: int, learners, state: dict[str, Any], keep_last: int,
                    interim: bool = False, folders: dict[str, Path] | None = None) -> Path:
    """Write <out>/checkpoints/step-NNNNNN atomically (temp folder, manifest last, then rename); keep the newest
    `keep_last` of the schedule. `interim`: written off the schedule by a stop; removed once a later one exists.
    `folders`: more to keep, {path inside the checkpoint: folder copied there} (an asynchronous run's older weight
    versions that its next steps sample with).

    A write that fails (ENOSPC is raised as an OSError naming the checkpoint) leaves nothing behind: the temp folder
    is removed, and the earlier checkpoints and the `latest` marker are untouched.
    """
    import torch

    root = Path(out_dir) / CHECKPOINT_DIR
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"step-{step:06d}"
    tmp = root / f".{final.name}.tmp"
    marker_tmp = root / f".{LATEST}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    try:  # everything that takes space happens before the commit below
        tmp.mkdir()
        learners.save(tmp / "agents")
        for rel, source in (folders or {}).items():
            shutil.copytree(source, tmp / rel)
        torch.save(rng_state(), tmp / "rng.pt")
        (tmp / STATE).write_text(json.dumps({**state, "manifest": True, "interim": interim}, indent=2))
        write_manifest(tmp)
        marker_tmp.write_text(final.name)
    except BaseException as exc:
        full = isinstance(exc, Exception) and _disk_full(exc, root)
        shutil.rmtree(tmp, ignore_errors=True)
        marker_tmp.unlink(missing_ok=True)
        if full:
            raise OSError(errno.ENOSPC, "No space left on device", str(final)) from exc
        raise
    # commit: renames only. A folder of the same step (a history the run left, or a damaged one) goes aside first, so
    # a crash here leaves either it or the new one, never neither
    old = root / f".{final.name}.old"
    if final.exists():
        shutil.rmtree(old, ignore_errors=True)
        final.rename(old)
    tmp.rename(final)
    os.replace(marker_tmp, root / LATEST)
    shutil.rmtree(old, ignore_errors=True)
    kept = 0
    for folder in checkpoint_history(out_dir)[1:]:
        if _state_of(folder).get("interim", False) or kept >= keep_last - 1:
            shutil.rmtree(folder, ignore_errors=True)
        else:
            kept += 1
    return final


def load_checkpoint(folder: Path, learners, agents: list[str], seed: int, verified: bool = False) -> dict[str, Any]:
    """Restore learners and RNG states from a checkpoint folder (checked against its manifest unless `verified`
    already); returns its saved state."""
    import torch

    folder = Path(folder)
    if not verified and (problem := checkpoint_problem(folder)) is not None:
        raise CheckpointError(f"checkpoint {folder} is damaged: {problem}; delete it or resume from another one")
    state = json.loads((folder / STATE).read_text())
    if sorted(state["agents"]) != sorted(agents):
        raise ValueError(f"{folder}: checkpoint trains agents {state['agents']}, the config {agents}")
    if state["seed"] != seed:
        raise ValueError(f"{folder}: checkpoint seed {state['seed']} differs from the config's {seed}")
    try:
        learners.load(folder / "agents")
        set_rng_state(torch.load(folder / "rng.pt", weights_only=False))
    except ValueError:  # the learners' own one-line checks (finetune, GPU count)
        raise
    except Exception as exc:  # a file no manifest vouched for (a checkpoint older than manifests) that does not read
        raise CheckpointError(f"cannot read checkpoint {folder}: {type(exc).__name__}: {exc}; delete that folder and "
                              f"rerun the same command to resume from the checkpoint before it") from exc
    return state


@contextmanager
def naming_full_disk(path: Path) -> Iterator[None]:
    """A full disk while writing `path` is an OSError(ENOSPC) that names it (a write error on an open file does not)."""
    try:
        yield
    except OSError as exc:
        if exc.errno in (errno.ENOSPC, errno.EDQUOT) and not exc.filename:
            raise OSError(exc.errno, exc.strerror or "No space left on device", str(path)) from exc
        raise


# ------------------------------------------------------------------------------------------------ graceful stops
class StopFlag:
    """Set by the first SIGTERM/SIGINT: the training loop finishes its step, checkpoints it and returns."""

    def __init__(self) -> None:
        self.signum: int | None = None
        self._handlers: dict[int, Any] = {}

    def reclaim(self) -> None:
        """Put the handlers back where something replaced them: `ray.init` installs its own SIGTERM handler (exit at
        once) in the driver, so the loop calls this before its first step."""
        for signum, handler in self._handlers.items():
            if signal.getsignal(signum) is not handler:
                signal.signal(signum, handler)

    def __bool__(self) -> bool:
        return self.signum is not None

    @property
    def name(self) -> str:
        return signal.Signals(self.signum).name if self.signum else ""

    @property
    def exit_status(self) -> int:
        """The shell's status of a process killed by the signal (143 SIGTERM, 130 SIGINT): schedulers read it so."""
        return 128 + (self.signum or 0)


class TrainingStopped(Exception):
    """Training stopped by a signal after checkpointing its last completed step; `exit_status`: 128 + the signal."""

    def __init__(self, step: int, flag: StopFlag, checkpoint: Path | None):
        self.step, self.signal, self.checkpoint = step, flag.name, checkpoint
        self.exit_status = flag.exit_status
        super().__init__(f"stopped at step {step}; rerun the same command to resume")


def stopped(name: str, trainer, flag: StopFlag, progress) -> TrainingStopped:
    """The TrainingStopped of a run (Trainer or SFTTrainer) a signal ended, after saying where its checkpoint is."""
    folder = find_latest_checkpoint(trainer.out) if trainer.checkpointed else None
    progress(f"{name}: {flag.name} received; " + (f"step {trainer.step} is checkpointed in {folder}" if folder
                                                  else "no step was trained, nothing to checkpoint"))
    return TrainingStopped(trainer.step, flag, folder)


class StoppedAtOnce(KeyboardInterrupt):
    """A second signal: raised wherever the run is, no checkpoint written (a KeyboardInterrupt, so no `except
    Exception` on the way swallows it)."""

    def __init__(self, signum: int):
        self.signum, self.exit_status = signum, 128 + signum
        super().__init__(f"stopped at once by a second {signal.Signals(signum).name}; the steps after the newest "
                         f"checkpoint are lost; rerun the same command to resume from it")


@contextmanager
def stop_on_signals(signals: tuple[int, ...] = (signal.SIGTERM, signal.SIGINT)) -> Iterator[StopFlag]:
    """Handlers for the duration of a command: the first signal sets the yielded flag, the second raises
    StoppedAtOnce; the previous handlers come back afterwards. Off the main thread (where Python cannot install
    handlers) the flag is never set."""
    flag = StopFlag()
    if threading.current_thread() is not threading.main_thread():
        yield flag
        return

    def handler(signum, frame):
        if flag.signum is not None:
            raise StoppedAtOnce(signum)
        flag.signum = signum
        try:
            sys.stderr.write(f"{signal.Signals(signum).name}: finishing this step, then writing a checkpoint and "
                             f"stopping (send it again to stop at once)\n")
            sys.stderr.flush()
        except (OSError, RuntimeError):  # e.g. a closed stream, or a print the signal interrupted
            pass

    previous = {s: signal.signal(s, handler) for s in signals}
    flag._handlers = {s: handler for s in signals}
    try:
        yield flag
    finally:
        flag._handlers = {}
        for s, h in previous.items():
            signal.signal(s, h if h is not None else signal.SIG_DFL)
