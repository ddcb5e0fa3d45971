"""The mini base's report: per-seed held-out accuracy and cost from each run's record, the shipped base's CSV.

Reads `<run>/base/record.json` of every run given (one per seed of `m1 pretrain --config mini_base`), copies each
run's evaluation rows to docs/experiments/mini_base/, writes docs/experiments/mini_base.csv (family, accuracy) from
the shipped run and prints the markdown table for docs/experiments/mini_base.md.

    python scripts/mini_base_report.py --ship /work/exp/base_s0 /work/exp/base_s0 /work/exp/base_s1 /work/exp/base_s2
"""
import argparse
import csv
import json
import shutil
from pathlib import Path

from m1.pretrain.drills import CHAINS, FAMILIES

DOCS = Path("docs/experiments")

ap = argparse.ArgumentParser()
ap.add_argument("runs", nargs="+", type=Path, help="the seeds' out_dirs")
ap.add_argument("--ship", type=Path, required=True, help="the run whose base is shipped (assets/mini_base)")
ap.add_argument("--rows-name", default="base_s{seed}", help="file name of each run's copied rows")
a = ap.parse_args()

records = {}
for run in a.runs:
    path = run / "base" / "record.json"
    if not path.is_file():
        raise SystemExit(f"{path}: no record (the run has not finished)")
    rec = json.loads(path.read_text())
    seed = rec["config"].get("seed", 0)  # the record keeps settings that differ from their defaults
    records[run] = rec
    shutil.copyfile(run / "metrics.jsonl", DOCS / "mini_base" / f"{a.rows_name.format(seed=seed)}.metrics.jsonl")

shipped = records[a.ship]["held_out"]
with (DOCS / "mini_base.csv").open("w", newline="") as f:
    w = csv.writer(f)
    w.writerow(["family", "accuracy"])
    for family in FAMILIES:
        w.writerow([family, f"{shipped[family]:.4f}"])

head = ["seed", "steps", "core-hours"] + [f"**{f}**" if f in CHAINS else f for f in FAMILIES]
print("| " + " | ".join(head) + " |")
print("|" + "---|" * len(head))
for run, rec in records.items():
    mark = " (shipped)" if run == a.ship else ""
    cells = [f"{rec['config'].get('seed', 0)}{mark}", str(rec["steps"]), f"{rec['core_hours']:.2f}"]
    cells += [f"{rec['held_out'][f]:.3f}" for f in FAMILIES]
    print("| " + " | ".join(cells) + " |")
