"""How far the pinned trainer records move across CPU kernels and thread counts (issue 63).

Runs the pinned SFT and MARL runs of tests/marl/test_trainer_regression.py in a fresh process per setting (torch threads,
ATen's vector ISA, MKL's instruction set: the knobs that change float summation order on one machine), then prints
the largest absolute and relative deviation of each figure from the stored record, per step. The record itself was
written on another CPU, so every row here is also a cross-CPU comparison.

    python scripts/float_spread.py --out runs/float_spread.json
    python scripts/float_spread.py --demo      # the demo's greedy margins instead (run it once per setting)

`--demo` runs `m1 demo`'s default and prints the smallest gaps between the top two logits over its greedy steps:
its exact answers hold on another CPU as long as those gaps exceed the logits' float spread.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SETTINGS = {  # name -> environment
    "1 thread": {"M1_SPREAD_THREADS": "1"},
    "2 threads": {"M1_SPREAD_THREADS": "2"},
    "1 thread, ATen AVX2": {"M1_SPREAD_THREADS": "1", "ATEN_CPU_CAPABILITY": "avx2"},
    "1 thread, ATen AVX2, MKL AVX2": {"M1_SPREAD_THREADS": "1", "ATEN_CPU_CAPABILITY": "avx2",
                                      "MKL_ENABLE_INSTRUCTIONS": "AVX2"},
    "2 threads, ATen scalar, MKL AVX2": {"M1_SPREAD_THREADS": "2", "ATEN_CPU_CAPABILITY": "default",
                                         "MKL_ENABLE_INSTRUCTIONS": "AVX2"},
}


def _child(out: str) -> None:
    """One setting: run every pinned run and write {name: rows}."""
    import torch

    threads = int(os.environ["M1_SPREAD_THREADS"])
    torch.set_num_threads(threads)
    sys.path.insert(0, str(ROOT))
    from tests.conftest import make_video
    from tests.marl import test_trainer_regression as reg

    work = Path(tempfile.mkdtemp(prefix="m1-spread-"))
    os.environ["M1_CACHE"] = str(work / "cache")
    video = str(make_video(work / "v.mp4", seconds=6, fps=2))
    got = {"sft": reg.run_sft(work)}
    for name in sorted(reg.MARL_CASES):
        got[f"marl/{name}"] = reg.run_marl(name, work, video)
    got["_cpu"] = torch.backends.cpu.get_cpu_capability()
    Path(out).write_text(json.dumps(got))


def demo_margins() -> None:
    """The demo's answers and the smallest top-1 minus top-2 logit gaps over its greedy decoding steps."""
    import torch

    from m1.cli import DEMO_TEAM
    from m1.demo import run_demo
    from m1.models import hf

    torch.set_num_threads(1)
    gaps: list[float] = []
    sample = hf.RowSampler.scores  # both samplers (m1/models/sampler.py, transformers' generate) score through it

    def recording(self, logits, generators):
        if generators is None:  # greedy
            top = logits.float().topk(2, dim=-1).values
            gaps.extend((top[:, 0] - top[:, 1]).tolist())
        return sample(self, logits, generators)

    hf.RowSampler.scores = recording
    work = Path(tempfile.mkdtemp(prefix="m1-spread-"))
    os.environ.setdefault("M1_CACHE", str(work / "cache"))
    out = run_demo(work / "demo", DEMO_TEAM, videos=1, duration=40.0, questions_per_video=4, echo=lambda s: None)
    print(out)
    print(f"{len(gaps)} greedy steps; smallest top-1 minus top-2 logit gaps:",
          " ".join(f"{g:.2e}" for g in sorted(gaps)[:5]))


def deviations(got: dict, want: dict) -> dict:
    """figure -> step -> (abs, rel) deviation of `got` from `want`, per run name; 'flip' when keys differ."""
    out = {}
    for name, rows in want.items():
        for step, (g, w) in enumerate(zip(got[name], rows), 1):
            for k, v in w.items():
                d = abs(g[k] - v)
                out.setdefault(f"{name} {k}", {})[step] = (d, d / abs(v) if v else (0.0 if d == 0 else float("inf")))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="runs/float_spread.json")
    ap.add_argument("--demo", action="store_true", help="the demo's greedy margins instead of the pinned runs")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.demo:
        return demo_margins()
    if args.child:
        return _child(args.child)
    record = json.loads((ROOT / "tests/fixtures/trainer_losses.json").read_text())
    results = {}
    for label, env in SETTINGS.items():
        with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
            path = f.name
        subprocess.run([sys.executable, __file__, "--child", path], check=True, cwd=ROOT,
                       env={**os.environ, "OMP_NUM_THREADS": env["M1_SPREAD_THREADS"], "HF_HUB_OFFLINE": "1",
                            "TRANSFORMERS_VERBOSITY": "error", **env})
        results[label] = json.loads(Path(path).read_text())
        os.unlink(path)
        worst = max((rel for fig in deviations(results[label], record).values() for _, rel in fig.values()))
        print(f"{label:36s} ATen {results[label].pop('_cpu'):7s} largest relative deviation from the record: "
              f"{worst:.2e}", flush=True)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"record_cpu": "Intel Xeon (the record)", "runs": results}, indent=1))
    # per figure kind (the key after the run name's last '/'), the worst deviation over settings and runs, per step
    kinds: dict[tuple[str, int], list[float]] = {}
    for label, got in results.items():
        for fig, steps in deviations(got, record).items():
            kind = fig.split()[-1].split("/")[-1]
            for step, (a, r) in steps.items():
                cur = kinds.setdefault((kind, step), [0.0, 0.0])
                cur[0], cur[1] = max(cur[0], a), max(cur[1], r)
    print("\nfigure            step   max abs     max rel")
    for (kind, step), (a, r) in sorted(kinds.items()):
        print(f"{kind:16s} {step:4d}   {a:.2e}   {r:.2e}")


if __name__ == "__main__":
    main()
