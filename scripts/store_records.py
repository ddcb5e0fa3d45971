"""Store committed experiment records compactly: every eval's rows file under ROOT (default docs/experiments) longer
than m1.experiment.rows.GZIP_LINES becomes `<stage>.jsonl.gz` (same bytes for the same rows), and its record's
`rows` names it. `m1 experiment run` already writes new records so; this converts ones written before, or by hand.

    .venv/bin/python scripts/store_records.py [ROOT]
"""
from __future__ import annotations

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from m1.experiment.rows import store_record  # noqa: E402


def main(root: Path) -> None:
    for rows in sorted(root.rglob("*.jsonl")):
        record = rows.with_suffix(".json")
        if record.is_file():  # else not an eval's rows (e.g. a training run's metrics copied beside a report)
            print(store_record(record))


if __name__ == "__main__":
    main(Path(sys.argv[1] if len(sys.argv) > 1 else "docs/experiments"))
