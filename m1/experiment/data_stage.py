"""The data stage of an experiment (<out_dir>/data/stage.json): synthetic worlds rendered, datasets split, the SFT
teacher examples built once for every seed, and the check that no eval video is a training video."""
from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any, Callable

from m1.data.prepare import parse_split, prepare
from m1.experiment.config import Experiment, ExperimentError
from m1.experiment.stages import StageRun, eval_questions, load_stage_config, write_stage
from m1.marl.sft import data_settings, examples_path, prepare_examples
from m1.marl.rollout.stream import load_questions
from m1.signature import file_sha256
from m1.synth.make import make_dataset


def _world_files(folder: Path) -> list[Path]:
    return sorted((folder / "videos").glob("*.mp4"))


def _render_world(out: Path, w) -> None:
    """Render a world into a folder unique to this process, then move its files into `out` by renames, questions.jsonl
    last: a reader never sees a half-written video or question file, and `out/questions.jsonl` existing means the
    world is complete."""
    import shutil

    tmp = out.parent / f".{out.name}.{os.getpid()}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        make_dataset(tmp, w.videos, w.seed, duration=w.duration, questions_per_video=w.questions_per_video)
        files = sorted(p for p in tmp.rglob("*") if p.is_file() and p.name != "questions.jsonl")
        for src in files + [tmp / "questions.jsonl"]:
            dest = out / src.relative_to(tmp)
            dest.parent.mkdir(parents=True, exist_ok=True)
            os.replace(src, dest)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def run_data(exp: Experiment, progress: Callable[[str], None] = print) -> dict[str, Any]:
    """The data stage (<out_dir>/data/stage.json): render the worlds not yet rendered, build each SFT owner arm's
    teacher examples, and check that no eval video has the bytes of a training video (a held-out world made from a
    training seed would score questions the students were trained on)."""
    assert exp.data is not None
    folder = Path(exp.out_dir) / "data"
    t0 = time.perf_counter()
    worlds = []
    for w in exp.data.worlds:
        out = Path(w.out)
        if (out / "questions.jsonl").is_file():
            progress(f"data: world {out} (seed {w.seed}) exists")
        else:
            progress(f"data: rendering world {out}: {w.videos} videos of {w.duration:g} s, seed {w.seed}")
            _render_world(out, w)
        worlds.append({"out": str(out), "seed": w.seed, "videos": len(_world_files(out))})
    datasets = []
    for d in exp.data.datasets:
        out, fractions = Path(d.out), parse_split(d.split)
        made = json.loads((out / "prepare.json").read_text()) if (out / "prepare.json").is_file() else {}
        same = {k: made.get(k) for k in ("format", "annotations", "videos", "seed", "split")}
        if same == {"format": d.format, "annotations": str(Path(d.annotations)), "videos": str(Path(d.videos)),
                    "seed": d.seed, "split": fractions}:
            progress(f"data: {out} was split before ({made['questions']} questions)")
        else:
            progress(f"data: splitting {d.annotations} ({d.format}) into {out}")
            made = prepare(d.format, Path(d.annotations), Path(d.videos), out, fractions, d.seed,
                           progress=lambda m: progress(f"data: {m}"))
        datasets.append({"out": str(out), "questions": made["questions"], "skipped": made["skipped"]})
    examples: dict[str, Any] = {}
    if exp.data.sft_examples and exp.sft is not None:
        built: dict[str, tuple[str, dict]] = {}
        for arm in exp.arms:
            owner = exp.owner(arm, "sft")
            if owner != arm:
                continue
            run = StageRun(arm, exp.seeds[0], "sft", exp.stage_dir(arm, exp.seeds[0], "sft"))
            cfg = load_stage_config(exp, run)[0]
            if cfg.data.teacher is None:
                continue
            if not cfg.data.examples:
                raise ExperimentError(f"arm {arm}, stage sft: data.examples must name a file for the data stage to "
                                      f"build it once for every seed (it defaults to one per run folder)")
            path, settings = str(examples_path(cfg)), data_settings(cfg)
            if path in built and built[path][1] != settings:
                raise ExperimentError(f"arms {built[path][0]} and {arm} build SFT examples with other settings into "
                                      f"the same file {path}: give one of them another data.examples")
            if path not in built:
                found, stats = prepare_examples(cfg, progress=lambda m: progress(f"data: {m}"))
                built[path] = (arm, settings)
                examples[path] = {"examples": len(found),
                                  "stats": {k: v for k, v in stats.items() if k != "data"}}
    overlap = check_held_out(exp)
    record = {"experiment": exp.name, "stage": "data", "wall_s": time.perf_counter() - t0, "worlds": worlds,
              "datasets": datasets, "sft_examples": examples, "held_out_check": overlap}
    folder.mkdir(parents=True, exist_ok=True)
    write_stage(folder, record)
    progress(f"data: ready in {record['wall_s']:.1f}s ({overlap})")
    return record


def check_held_out(exp: Experiment) -> str:
    """Refuse an eval video whose bytes equal a training stage's video; returns what was compared."""
    if exp.eval is None:
        return "no eval stage"
    trained: dict[str, str] = {}
    for stage in ("sft", "marl"):
        if getattr(exp, stage) is None:
            continue
        for arm in exp.arms:
            run = StageRun(arm, exp.seeds[0], stage, exp.stage_dir(arm, exp.seeds[0], stage))
            d = load_stage_config(exp, run)[0].data
            if d.questions and Path(d.questions).is_file():
                for q in load_questions(d.questions, d.video_dir):
                    if Path(q.video).is_file() and q.video not in trained.values():
                        trained[file_sha256(q.video)] = q.video
    held, _ = eval_questions(exp)
    videos = sorted({q.video for q in held if Path(q.video).is_file()})
    for v in videos:
        same = trained.get(file_sha256(v))
        if same is not None:
            raise ExperimentError(f"eval video {v} has the same bytes as training video {same}: the held-out "
                                  f"questions must come from another world (another synth seed)")
    return f"{len(videos)} eval videos share no bytes with {len(trained)} training videos"

