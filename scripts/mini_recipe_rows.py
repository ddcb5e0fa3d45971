"""The mini recipe's CSV with the team from the base beside it (issue #71): docs/experiments/mini_recipe.csv keeps its
own rows (the team from random weights, issues #39 and #49) and gets mini_base_recipe's rows, arms prefixed `base_`
(`base_sft`, `base_sft_marl`, `base_sft_plain`, `base_random_sft`, `base_teacher`), rendered from the committed
records as `m1 experiment report mini_base_recipe` renders them. Rerun after more of its stages are recorded; an arm
with no finished eval is left out.

    python scripts/mini_recipe_rows.py
"""
import csv
import io
from pathlib import Path

from m1.experiment.config import load_experiment
from m1.experiment.report import write_csv
from m1.experiment.stats import report_stats

CSV = Path("docs/experiments/mini_recipe.csv")
PREFIX = "base_"

stats = report_stats(load_experiment("mini_base_recipe"))
rows = [dict(r, arm=PREFIX + r["arm"]) for r in stats.rows if r["seeds"]]
tmp = CSV.with_suffix(".base.tmp")
write_csv(tmp, rows)
new = list(csv.reader(io.StringIO(tmp.read_text())))
tmp.unlink()
old = list(csv.reader(io.StringIO(CSV.read_text())))
if old[0] != new[0]:
    raise SystemExit(f"{CSV}: columns {old[0]} differ from the report's {new[0]}")
kept = [r for r in old[1:] if not r[0].startswith(PREFIX)]
buf = io.StringIO()
csv.writer(buf).writerows([old[0], *kept, *new[1:]])
CSV.write_text(buf.getvalue())
print(f"{CSV}: {len(kept)} rows of the team from random weights, {len(new) - 1} from the base "
      f"(arms {sorted({r[0] for r in new[1:]})})")
