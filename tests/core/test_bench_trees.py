"""The loop bench times two source trees side by side: each side, and every process it spawns, imports only its
own tree, whatever the checkout that launches it has installed (an editable install of this repository)."""
from __future__ import annotations

import json
import sys
import textwrap
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"

# A stand-in tree: `m1.marl.sft.SFTTrainer.train` spawns a child (as the SFT example builder does) that imports a
# module of its own layout and records which files both processes imported.
SFT = '''
import json, multiprocessing as mp, os


def _child(name):
    import importlib
    import m1
    mod = importlib.import_module(name)
    return [m1.__file__, mod.__file__]


class SFTTrainer:
    def __init__(self, cfg):
        self.cfg = cfg

    def train(self):
        import m1
        with mp.get_context("spawn").Pool(1) as pool:
            child = pool.apply(_child, (os.environ["LAYOUT_MODULE"],))
        with open("seen.json", "w") as f:
            json.dump({"parent": m1.__file__, "child": child}, f)
        return [{"step": 1, "time/step": 0.5, "loss": 1.0, "other": 2}]

    def close(self):
        pass
'''
CONFIG = "def load_sft_config(name, sets):\n    return type('Cfg', (), {'team_overrides': []})()\n"


def _tree(root: Path, layout_module: str) -> Path:
    pkg = root / "m1" / "marl"
    pkg.mkdir(parents=True)
    (root / "m1" / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    (pkg / "sft.py").write_text(textwrap.dedent(SFT))
    (pkg / "config.py").write_text(CONFIG)
    (pkg / f"{layout_module}.py").write_text("")
    return root


@pytest.mark.parametrize("layout", ["sft_examples", "teacher_rows"])
def test_each_side_and_its_spawned_workers_import_their_own_tree(tmp_path, monkeypatch, layout):
    sys.path.insert(0, str(BENCH))
    try:
        from bench_mini_loop import run_side
    finally:
        sys.path.remove(str(BENCH))
    a = _tree(tmp_path / "a", "sft_examples")  # two layouts: a module one tree has and the other lacks
    b = _tree(tmp_path / "b", "teacher_rows")
    monkeypatch.setenv("LAYOUT_MODULE", f"m1.marl.{layout}")
    for tree in (a, b):
        work = tmp_path / f"work_{tree.name}"
        (work / "runs").mkdir(parents=True)
        if (tree / "m1" / "marl" / f"{layout}.py").is_file():
            rows = run_side(tree, work, "sft", 1, [])
            assert rows == [{"step": 1, "time/step": 0.5, "loss": 1.0}]
            seen = json.loads((work / "seen.json").read_text())
            files = [seen["parent"], *seen["child"]]
            assert all(Path(f).resolve().is_relative_to(tree.resolve()) for f in files), files
        else:  # the other tree's module is not found, not borrowed from the checkout or the other tree
            with pytest.raises(RuntimeError, match=f"No module named 'm1.marl.{layout}'"):
                run_side(tree, work, "sft", 1, [])
