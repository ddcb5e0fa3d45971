"""Run every speed benchmark, each in its own process, print the figures and rewrite the
results table in benchmarks/README.md (between the `results` markers).

    python benchmarks/run_all.py [--only bench_clip ...] [--no-readme]
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
SCRIPTS = ["bench_batching", "bench_openai", "bench_rollout", "bench_frames", "bench_clip", "bench_grpo_vs_trl"]
START, END = "<!-- results:start -->", "<!-- results:end -->"


def _cell(text: str) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def table(results: list[dict], failures: list[tuple[str, str]]) -> str:
    sys.path.insert(0, str(HERE))
    from _common import machine_line

    lines = []
    machines = {machine_line(r["machine"]).split(" | ", 1)[1].rsplit(" | load", 1)[0] for r in results}
    dates = sorted(r["machine"]["date"] for r in results)
    if results:
        lines.append(f"Measured {dates[0]} – {dates[-1]} on: {'; '.join(sorted(machines))}. "
                     f"1-minute load average when each script ended: "
                     + ", ".join(f"{r['script']} {r['machine'].get('load_avg_1m')}" for r in results) + ".")
        lines.append("")
    lines.append("| figure | baseline | measured | ratio | target | met | script |")
    lines.append("|---|---|---|---|---|---|---|")
    for r in results:
        for f in r["figures"]:
            met = {True: "yes", False: "**no**", None: "–"}[f["met"]]
            lines.append(f"| {_cell(f['figure'])} | {_cell(f['baseline'])} | {_cell(f['measured'])} | "
                         f"{f['ratio']:.3g} ({_cell(f['ratio_def'])}) | {_cell(f['target'])} | {met} | "
                         f"`{r['script']}` |")
    for script, err in failures:
        lines.append(f"| {script} failed: {_cell(err[-300:])} | | | | | **no** | `{script}.py` |")
    return "\n".join(lines)


def update_readme(text: str) -> None:
    readme = HERE / "README.md"
    body = readme.read_text() if readme.exists() else f"# Speed benchmarks\n\n{START}\n{END}\n"
    if START not in body or END not in body:
        raise SystemExit(f"{readme}: the markers {START} / {END} are missing; add them where the table goes")
    head, rest = body.split(START, 1)
    _, tail = rest.split(END, 1)
    readme.write_text(f"{head}{START}\n{text}\n{END}{tail}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--only", nargs="*", choices=SCRIPTS, help="run only these scripts")
    p.add_argument("--no-readme", action="store_true", help="print the table, leave README.md alone")
    args = p.parse_args()
    results, failures = [], []
    with tempfile.TemporaryDirectory(prefix="m1-bench-") as tmp:
        for name in args.only or SCRIPTS:
            out = Path(tmp) / f"{name}.json"
            t0 = time.perf_counter()
            print(f"\n### {name}.py", flush=True)
            proc = subprocess.run([sys.executable, str(HERE / f"{name}.py"), "--json", str(out)],
                                  stdout=sys.stdout, stderr=subprocess.PIPE, text=True)
            print(f"### {name}.py took {time.perf_counter() - t0:.0f} s (exit {proc.returncode})", flush=True)
            if proc.returncode != 0 or not out.exists():
                failures.append((name, proc.stderr.strip() or f"exit code {proc.returncode}"))
                print(proc.stderr, file=sys.stderr)
                continue
            results.append(json.loads(out.read_text()))
    text = table(results, failures)
    print("\n" + text)
    if not args.no_readme and not args.only:
        update_readme(text)
        print(f"\nupdated {HERE / 'README.md'}")
    elif args.only and not args.no_readme:
        print("\n(--only: README.md left alone; run without --only to refresh the whole table)")
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
