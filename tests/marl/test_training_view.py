"""`m1 view RUN_DIR` on a training run (m1/marl/view.py): a front page with the run's plots and the steps whose
episodes were kept (`log.samples_every`), each linking to that step's trace pages; served like a trace folder and
checked in a real headless Chromium (skipped where none is installed, like tests/core/test_trace_pages.py)."""
import os
import urllib.request
from pathlib import Path

import pytest

from tests.core.test_trace_pages import _browser, _chromium, parse, serving_view
from tests.marl.test_trackers import tiny_cfg, trainer

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def run(tmp_path_factory, m1_cache):
    from tests.conftest import make_video

    root = tmp_path_factory.mktemp("trained")
    video = str(make_video(root / "v.mp4", seconds=6, fps=2))
    out = root / "run"
    tr = trainer(tiny_cfg(out, steps=2, backends=[], samples_every=1), video)
    tr.train()
    tr.close()
    return out


@pytest.mark.slow
def test_the_run_index_lists_each_kept_step_with_its_pages_and_the_plots(run):
    from m1.marl.view import build_run_index, is_training_run

    assert is_training_run(run)
    page = parse(build_run_index(run).read_text())
    steps = page.all("tr", "step")
    assert [tr.attrs["data-step"] for tr in steps] == ["1", "2"]
    for tr in steps:
        href = tr.one("a").attrs["href"]
        assert (run / href).is_file() and href.startswith("samples/step-00000")
        up = parse((run / href).read_text()).one("p", "up").one("a").attrs["href"]  # the step's page links back
        assert ((run / href).parent / up).resolve() == (run / "index.html").resolve()
        cells = [td.text() for td in tr.all("td")]
        assert cells[1] == "2" and "trained" in cells[2]  # the step's 2 episodes (K=2, one question)
    imgs = [im.attrs["src"] for im in page.all("img")]
    assert imgs and all((run / src).is_file() for src in imgs) and "plots/loss.png" in imgs


def test_the_run_index_without_samples_says_how_to_keep_them(tmp_path):
    from m1.marl.view import render_run_index

    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "loss": 0.5}\n')
    page = parse(render_run_index(tmp_path))
    assert "log.samples_every" in page.one("p", "no-samples").text()


@pytest.mark.slow
def test_m1_view_serves_a_training_run(run):
    with serving_view(run) as (built, serving, url):
        assert built == f"built {run / 'index.html'}"
        assert serving.startswith(f"serving {run} at http://127.0.0.1:"), serving
        with urllib.request.urlopen(url, timeout=10) as r:
            html = r.read().decode()
        href = parse(html).all("tr", "step")[0].one("a").attrs["href"]
        base = url.rsplit("/", 1)[0]
        with urllib.request.urlopen(f"{base}/{href}", timeout=10) as r:  # the step's index of its episodes
            step_index = r.read().decode()
        page = parse(step_index).all("tr", "q")[0].one("a").attrs["href"]
        with urllib.request.urlopen(f"{base}/{href.rsplit('/', 1)[0]}/{page}", timeout=10) as r:
            assert "class='credit advantage" in r.read().decode()


@pytest.mark.slow
def test_training_run_index_screenshot(run, tmp_path):
    from PIL import Image
    import numpy as np

    _chromium()
    from m1.marl.view import build_run_index

    index = build_run_index(run)
    shot = tmp_path / "shot.png"
    _browser(tmp_path, f"--screenshot={shot}", "--window-size=1200,1400", index.as_uri())
    img = Image.open(shot).convert("RGB")
    assert img.size == (1200, 1400)
    px = np.asarray(img)
    assert px.std() > 20 and (px < 100).all(axis=2).mean() > 0.005  # the table and the plots, not a blank page
    dom = parse(_browser(tmp_path, "--virtual-time-budget=3000", "--dump-dom", index.as_uri()))
    assert len(dom.all("tr", "step")) == 2
    if os.environ.get("M1_WRITE_DOCS") == "1":
        img.save(REPO / "docs" / "training_view.png", optimize=True)
    # a step's trace page shows reward and advantage beside the generations
    step = run / "samples" / "step-000001"
    page = sorted(p for p in step.glob("*.html") if p.name != "index.html")[0]
    dom = parse(_browser(tmp_path, "--virtual-time-budget=3000", "--dump-dom", page.as_uri()))
    assert dom.all("span", "advantage") and dom.all("span", "reward")
