"""Trace pages and the run index (m1/trace.py, m1/trace_index.py), `m1 view`, and the pages in a real headless Chromium.

One offline demo run (the shipped mini team on one generated M1-Synth video, three questions, a random DAG
with agent dropout) feeds every test. The Chromium checks skip where no Chromium binary is installed
(`apt-get install chromium`); set M1_WRITE_DOCS=1 to also refresh docs/trace_page.png from the screenshot.
"""
import base64
import io
import json
import os
import shutil
import signal
import subprocess
import sys
import urllib.request
from contextlib import contextmanager
from html.parser import HTMLParser
from pathlib import Path

import numpy as np
import pytest

from m1.schema import Episode

REPO = Path(__file__).resolve().parents[2]
TINY_CLIP = ("models.clip={interface: clip, backend: open_clip, device: cpu, "
             "tiny: {arch: open_clip, hidden_size: 64, layers: 2, image_size: 64, seed: 6}}")
# a random DAG with dropout: with topology seed 0 the three questions get 3, 2 and 4 active agents
OVERRIDES = [TINY_CLIP, "topology.mode=random", "topology.dropout=0.3", "topology.edge_prob=0.7"]


# ------------------------------------------------------------------ a small DOM from the stdlib parser

class Node:
    def __init__(self, tag, attrs, parent=None):
        self.tag, self.attrs, self.parent, self.children = tag, dict(attrs), parent, []

    @property
    def classes(self):
        return (self.attrs.get("class") or "").split()

    def text(self):
        return "".join(c if isinstance(c, str) else c.text() for c in self.children)

    def all(self, tag=None, cls=None, **attrs):
        out = []
        for c in self.children:
            if isinstance(c, Node):
                if ((tag is None or c.tag == tag) and (cls is None or cls in c.classes)
                        and all(c.attrs.get(k.replace("_", "-")) == v for k, v in attrs.items())):
                    out.append(c)
                out += c.all(tag, cls, **attrs)
        return out

    def one(self, tag=None, cls=None, **attrs):
        found = self.all(tag, cls, **attrs)
        assert len(found) == 1, f"expected one <{tag} class={cls} {attrs}>, found {len(found)}"
        return found[0]


class _Tree(HTMLParser):
    VOID = {"meta", "img", "br", "input", "link", "hr", "source", "wbr"}

    def __init__(self):
        super().__init__(convert_charrefs=True)
        self.root = self.cur = Node("#root", {})

    def handle_starttag(self, tag, attrs):
        node = Node(tag, attrs, self.cur)
        self.cur.children.append(node)
        if tag not in self.VOID:
            self.cur = node

    def handle_startendtag(self, tag, attrs):
        self.cur.children.append(Node(tag, attrs, self.cur))

    def handle_endtag(self, tag):
        node = self.cur
        while node is not self.root and node.tag != tag:
            node = node.parent
        if node is not self.root:
            self.cur = node.parent

    def handle_data(self, data):
        self.cur.children.append(data)


def parse(text: str) -> Node:
    tree = _Tree()
    tree.feed(text)
    return tree.root


# ------------------------------------------------------------------ the run


@pytest.fixture(scope="module")
def demo(tmp_path_factory, m1_cache):
    from m1.demo import run_demo

    out = tmp_path_factory.mktemp("trace_run") / "demo"
    lines = []
    run_demo(out, "mini_trained", videos=1, duration=40.0, questions_per_video=3, overrides=OVERRIDES,
             echo=lines.append)
    return out, lines


def _episodes(traces: Path) -> list[Episode]:
    return [Episode.model_validate_json(p.read_text()) for p in sorted(traces.glob("*.json"))]


def _truth_text(q):
    return q.options["ABCD".index(q.answer)] if q.task == "mcq" else q.answer


def test_demo_ends_with_the_index_path(demo):
    out, lines = demo
    assert lines[-1].startswith(f"trace index: {out / 'traces' / 'index.html'}")
    assert (out / "traces" / "index.html").is_file()


def test_trace_page_shows_question_votes_dag_and_agents(demo):
    from PIL import Image

    from m1.trace import MAX_THUMBS, THUMB_WIDTH, clock, peer_views, spread

    out, _ = demo
    eps = _episodes(out / "traces")
    assert len(eps) == 3
    assert {len(ep.topology.active) for ep in eps} == {2, 3, 4}  # dropped agents on two pages
    for ep in eps:
        q = ep.question
        raw = (out / "traces" / f"{ep.id}.html").read_text()
        assert 20_000 < len(raw.encode()) < 400_000, len(raw.encode())  # thumbnails inline, still small
        assert "http://" not in raw and "https://" not in raw and "<link" not in raw  # self-contained
        page = parse(raw)
        assert page.one("h1").text() == ep.id
        assert page.one("span", "qtext").text() == q.text
        assert [li.text() for li in page.one("ol", "opts").all("li")] == q.options
        assert page.one("li", "truth").text() == _truth_text(q)
        banner = page.one("div", "banner")
        assert banner.one("span", "truth").text() == q.answer
        assert banner.one("span", "team-answer").text() == ep.final_answer
        assert ep.aggregation in banner.text()
        votes = {tr.attrs["data-agent"]: tr.one("span", "vote-answer").text() for tr in page.all("tr", "vote")}
        assert votes == {a.agent: a.answer for a in ep.answers}
        # the DAG: one node per agent, dropped ones marked, one arrow per edge
        dag = page.one("svg", "dag")
        nodes = dag.all("g", "node")
        assert sorted(n.attrs["data-agent"] for n in nodes) == sorted(ep.topology.agents)
        assert {n.attrs["data-agent"] for n in nodes if "dropped" in n.classes} == \
            set(ep.topology.agents) - set(ep.topology.active)
        assert sorted((e.attrs["data-from"], e.attrs["data-to"]) for e in dag.all("line", "edge")) == \
            sorted(map(tuple, ep.topology.edges))
        # each frame is inlined once (data-f); later thumbnails of it name that copy (data-same), filled by JS
        firsts = {img.attrs["data-f"]: img.attrs["src"] for img in page.all("img") if "data-f" in img.attrs}
        assert all(src.startswith("data:image/jpeg;base64,") for src in firsts.values())
        assert len(firsts) == len([img for img in page.all("img") if "data-f" in img.attrs])  # each frame once
        seen = set()
        for img in page.all("img"):
            if "data-f" in img.attrs:
                seen.add(img.attrs["data-f"])
            else:
                assert img.attrs["data-same"] in seen and "src" not in img.attrs
        video = None
        for name, rec in ep.memory.items():
            sec = page.one("section", "agent", data_agent=name)
            assert ("dropped" in sec.classes) == (name not in ep.topology.active)
            assert [c.text() for c in sec.all("span", "plan-tool")] == rec.plan
            assert [h.text() for h in sec.all("h3") if h.text().startswith("Step")] == \
                [f"Step {t.step}: {t.tool}" for t in rec.turns]
            # timeline: a mark at every time a tool looked
            marks = [float(m.attrs["data-t"]) for m in sec.all("rect", "mark")]
            assert marks == pytest.approx([t for turn in rec.turns for t in turn.timestamps], abs=1e-3)
            # thumbnails: at most MAX_THUMBS per turn, evenly spread, with their times under them
            turns = sec.all("div", "turn")
            assert len(turns) == len(rec.turns)
            for turn, div in zip(rec.turns, turns):
                want = spread(sorted(set(turn.timestamps)), MAX_THUMBS)
                imgs = div.all("img")
                assert len(imgs) == len(want)
                assert [f.text() for f in div.all("figcaption")] == [clock(t) for t in want]
                srcs = [firsts[img.attrs.get("data-f") or img.attrs["data-same"]] for img in imgs]
                for src, t in zip(srcs[:1], want):
                    thumb = Image.open(io.BytesIO(base64.b64decode(src.split(",", 1)[1])))
                    assert thumb.format == "JPEG" and thumb.width == THUMB_WIDTH
                    # it is the frame on screen at t: compare with the video, decoded here
                    from m1.video import VideoReader, time_to_index

                    video = video or VideoReader(q.video)
                    frame = video.frames([time_to_index(video.info, t)])[0]
                    small = np.asarray(Image.fromarray(frame).resize(thumb.size, Image.BILINEAR), np.float32)
                    assert np.abs(np.asarray(thumb.convert("RGB"), np.float32) - small).mean() < 12
                if not turn.error:
                    assert div.one("pre", "output").text() == turn.output
            # what it read of its peers: the very text its prompts held
            views = sec.all("details", "peers")
            expected = peer_views(ep, name)
            assert len(views) == len(expected) >= 1
            for det, (label, step, text) in zip(views, expected):
                phase = "answer" if step is None else "communicate"
                gen = next(g for g in ep.generations if g.agent == name and g.phase == phase
                           and (step is None or g.step == step))
                prompt = "\n".join(m["content"] for m in gen.prompt)
                assert text in prompt
                if text:
                    assert det.one("pre").text() == text
            if name not in ep.topology.active:
                assert all(text == "" for _, _, text in expected)  # a dropped agent reads nobody
            assert sec.one("span", "agent-answer").text() == (rec.answer or "")
            gens = [g for g in ep.generations if g.agent == name]
            assert len(sec.all("details", "gen")) == len(gens)
            assert [d.one("pre", "completion").text() for d in sec.all("details", "gen")] == \
                [g.completion for g in gens]
        if video is not None:
            video.close()


def test_index_lists_every_question_with_family_accuracy(demo):
    out, _ = demo
    traces = out / "traces"
    rows = {json.loads(l)["id"]: json.loads(l) for l in (out / "results.jsonl").read_text().splitlines()}
    family = {json.loads(l)["id"]: json.loads(l)["meta"]["family"]
              for l in (out / "data" / "questions.jsonl").read_text().splitlines()}
    page = parse((traces / "index.html").read_text())
    trs = page.all("tr", "q")
    assert sorted(tr.attrs["data-id"] for tr in trs) == sorted(rows)
    for tr in trs:
        r = rows[tr.attrs["data-id"]]
        assert tr.attrs["data-result"] == ("right" if r["correct"] else "wrong")
        assert tr.attrs["data-family"] == family[r["id"]]
        assert tr.one("td", "answer").text() == r["answer"] and tr.one("td", "truth").text() == r["truth"]
        href = tr.one("a").attrs["href"]
        assert (traces / href).is_file() and parse((traces / href).read_text()).one("h1").text() == r["id"]
    want: dict[str, list[int]] = {}
    for rid, r in rows.items():
        c = want.setdefault(family[rid], [0, 0])
        c[0] += r["correct"]
        c[1] += 1
    got = {tr.attrs["data-family"]: tr.one(None, "acc").text() for tr in page.all("tr", "fam")}
    assert got == {**{f: f"{c}/{n}" for f, (c, n) in want.items()},
                   "": f"{sum(c for c, _ in want.values())}/{len(rows)}"}
    pct = {tr.attrs["data-family"]: tr.one(None, "pct").text() for tr in page.all("tr", "fam")}
    assert all(pct[f] == f"{c / n:.1%}" for f, (c, n) in want.items())


def test_a_killed_run_has_a_full_index_after_its_rerun(demo, tmp_path):
    """A run killed after a trace but before its results line (and before any index): the rerun answers
    that question again and writes the index of all three."""
    from m1.demo import run_demo

    out = tmp_path / "demo"
    shutil.copytree(demo[0], out)
    (out / "traces" / "index.html").unlink()
    lines = (out / "results.jsonl").read_text().splitlines(keepends=True)
    (out / "results.jsonl").write_text("".join(lines[:2]))
    run_demo(out, "mini_trained", videos=1, duration=40.0, questions_per_video=3, overrides=OVERRIDES,
             echo=lambda *_: None)
    page = parse((out / "traces" / "index.html").read_text())
    assert len(page.all("tr", "q")) == 3 and len((out / "results.jsonl").read_text().splitlines()) == 3
    # killed after its last line: the rerun has nothing to answer, and still writes the index
    (out / "traces" / "index.html").unlink()
    run_demo(out, "mini_trained", videos=1, duration=40.0, questions_per_video=3, overrides=OVERRIDES,
             echo=lambda *_: None)
    assert len(parse((out / "traces" / "index.html").read_text()).all("tr", "q")) == 3


def test_unreadable_video_gives_a_page_with_a_note(demo, tmp_path):
    from m1.run import write_trace

    ep = _episodes(demo[0] / "traces")[0]
    bad = tmp_path / "notes.mp4"
    bad.write_text("not a video\n" * 10)
    for video in (bad, tmp_path / "gone.mp4"):
        ep2 = ep.model_copy(update={"question": ep.question.model_copy(update={"video": str(video)})}, deep=True)
        path = write_trace(tmp_path / "traces", ep2)  # no pool: the page opens the video itself
        page = parse(path.with_suffix(".html").read_text())
        note = page.one("p", "thumbs-note").text()
        assert note.startswith("no thumbnails: cannot read video") and video.name in note
        assert page.all("img") == []
        n_marks = sum(len(t.timestamps) for rec in ep.memory.values() for t in rec.turns)
        assert sum(len(sec.all("rect", "mark")) for sec in page.all("section", "agent")) == n_marks  # timelines stay


def test_model_and_question_text_is_escaped(demo, tmp_path):
    from m1.trace import _PAGE_JS, render_html
    from m1.trace_index import TraceIndex

    ep = _episodes(demo[0] / "traces")[0].model_copy(deep=True)
    evil = "<script>alert('x')</script>"
    ep.question.text = f"Which {evil}?"
    ep.question.options[0] = "<img src=x onerror=alert(1)>"
    name = next(iter(ep.memory))
    for t in ep.memory[name].turns:
        t.output, t.error, t.key_info = f"</pre>{evil}", None, evil
    ep.memory[name].turns[-1].error = f"tool failed: {evil}"
    ep.memory[name].answer = "<b>A</b>"
    ep.generations[0].completion = f"</details>{evil}"
    ep.final_reason = evil
    raw = render_html(ep)
    assert evil not in raw and "<img src=x" not in raw and "<b>A</b>" not in raw
    page = parse(raw)
    assert [sc.text() for sc in page.all("script")] == [_PAGE_JS]  # the thumbnail filler, nothing else
    assert page.one("span", "qtext").text() == f"Which {evil}?"
    sec = page.one("section", "agent", data_agent=name)
    assert [p.text() for p in sec.all("pre", "output")] == [f"</pre>{evil}"] * (len(ep.memory[name].turns) - 1)
    assert sec.all("div", "turn")[-1].one("p", "err").text() == f"tool failed: {evil}"
    traces = tmp_path / "t"
    traces.mkdir()
    (traces / "x.json").write_text(ep.model_dump_json())
    (traces / "not-an-episode.json").write_text("{}")
    idx = TraceIndex(traces).html()
    assert evil not in idx and "1 unreadable trace files left out" in idx
    assert len(parse(idx).all("script")) == 1  # the filter script, nothing else
    assert parse(idx).one("tr", "q").all("td")[3].text() == f"Which {evil}?"


@contextmanager
def serving_view(folder):
    """`m1 view FOLDER --port 0` running: yields its two first lines (built ..., serving ... at URL) and the URL.
    On leaving, Ctrl-C must stop it cleanly (exit 0, "stopped")."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    # a shell's background job starts with SIGINT ignored, and Python then keeps ignoring it: give `m1 view` the
    # terminal's Ctrl-C whatever way this test run was started
    p = subprocess.Popen([sys.executable, "-m", "m1", "view", str(folder), "--port", "0"], cwd=REPO, env=env,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        built, serving = p.stdout.readline().strip(), p.stdout.readline().strip()
        assert " at http://127.0.0.1:" in serving, (built, serving)
        yield built, serving, serving.split(" at ", 1)[1].split()[0]
        p.send_signal(signal.SIGINT)
        rest, err = p.communicate(timeout=20)
    finally:
        if p.poll() is None:
            p.kill()
    assert p.returncode == 0 and "stopped" in rest, err


def test_view_serves_the_index_and_stops_on_ctrl_c(demo, tmp_path):
    out = tmp_path / "demo"
    shutil.copytree(demo[0], out)
    (out / "traces" / "index.html").unlink()  # missing: `m1 view` builds it
    with serving_view(out) as (built, serving, url):
        assert built.startswith("built ") and built.endswith("index.html"), built
        assert serving.startswith(f"serving {out / 'traces'} at http://127.0.0.1:"), serving
        with urllib.request.urlopen(url, timeout=10) as r:
            assert r.status == 200 and "Accuracy per family" in r.read().decode()
        href = parse((out / "traces" / "index.html").read_text()).all("tr", "q")[0].one("a").attrs["href"]
        with urllib.request.urlopen(url.rsplit("/", 1)[0] + "/" + href, timeout=10) as r:
            assert r.status == 200 and "svg class='dag'" in r.read().decode()


def test_view_clear_errors(tmp_path):
    from typer.testing import CliRunner

    from m1.cli import app

    r = CliRunner().invoke(app, ["view", str(tmp_path / "nowhere")])
    assert r.exit_code == 2 and "nowhere: no such folder" in r.output
    r = CliRunner().invoke(app, ["view", str(tmp_path)])
    assert r.exit_code == 2 and "no traces found" in r.output and "--trace-dir" in r.output


# ------------------------------------------------------------------ in a real browser

def _chromium() -> str:
    for name in (os.environ.get("M1_CHROMIUM"), "chromium", "chromium-browser", "google-chrome",
                 "google-chrome-stable"):
        path = name and shutil.which(name)
        if path:
            return path
    pytest.skip("no Chromium binary found (chromium, chromium-browser, google-chrome, or $M1_CHROMIUM): "
                "`apt-get install chromium` to run the browser checks")


def _browser(tmp_path, *args, timeout=60) -> str:
    cmd = [_chromium(), "--headless=new", "--no-sandbox", "--disable-gpu", f"--user-data-dir={tmp_path / 'profile'}",
           "--no-first-run", "--hide-scrollbars", *args]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    assert r.returncode == 0, r.stderr[-2000:]
    return r.stdout


_COUNT_IMAGES = ("<script>addEventListener('load', function () {"
                 "var im = [].slice.call(document.images), b = document.body.dataset;"
                 "b.imagesLoaded = im.filter(function (i) { return i.complete && i.naturalWidth > 0; }).length;"
                 "b.imagesTotal = im.length;"
                 "b.dagWidth = Math.round(document.querySelector('svg.dag').getBoundingClientRect().width);"
                 "b.marks = document.querySelectorAll('rect.mark').length; });</script></body>")


def test_trace_page_images_load_in_chromium(demo, tmp_path):
    _chromium()
    ep = _episodes(demo[0] / "traces")[0]
    raw = (demo[0] / "traces" / f"{ep.id}.html").read_text()
    n_imgs = raw.count("<img ")
    assert n_imgs > 10
    probe = tmp_path / "probe.html"
    probe.write_text(raw.replace("</body>", _COUNT_IMAGES))
    body = parse(_browser(tmp_path, "--virtual-time-budget=5000", "--dump-dom", probe.as_uri())).one("body")
    assert body.attrs.get("data-images-total") == str(n_imgs)
    assert body.attrs.get("data-images-loaded") == str(n_imgs)
    assert int(body.attrs["data-dag-width"]) > 300
    assert body.attrs["data-marks"] == str(raw.count("class='mark'"))


def test_index_filters_in_chromium(demo, tmp_path):
    _chromium()
    index = demo[0] / "traces" / "index.html"
    rows = [tr.attrs for tr in parse(index.read_text()).all("tr", "q")]
    fam = rows[0]["data-family"]
    word = rows[-1]["data-text"].split()[-3]  # a word of the last question's text
    cases = {"#result=wrong": [r for r in rows if r["data-result"] == "wrong"],
             "#result=right": [r for r in rows if r["data-result"] == "right"],
             f"#family={fam}": [r for r in rows if r["data-family"] == fam],
             f"?q={word}": [r for r in rows if word in r["data-text"]],
             "": rows}
    for suffix, want in cases.items():
        dom = parse(_browser(tmp_path, "--virtual-time-budget=2000", "--dump-dom", index.as_uri() + suffix))
        shown = [tr.attrs["data-id"] for tr in dom.all("tr", "q") if "hidden" not in tr.attrs]
        assert shown == [r["data-id"] for r in want], suffix
        assert dom.one("body").attrs["data-shown"] == str(len(want))
        assert dom.one(None, id="shown").text() == str(len(want))
    assert cases["#result=wrong"] or cases["#result=right"]


def test_trace_page_screenshot(demo, tmp_path):
    from PIL import Image

    _chromium()
    eps = _episodes(demo[0] / "traces")
    ep = next((e for e in eps if len(e.topology.active) < len(e.topology.agents) and e.topology.edges), eps[0])
    shot = tmp_path / "shot.png"
    _browser(tmp_path, f"--screenshot={shot}", "--window-size=1200,2000",
             (demo[0] / "traces" / f"{ep.id}.html").as_uri())
    img = Image.open(shot).convert("RGB")
    assert img.size == (1200, 2000)
    px = np.asarray(img)
    assert px.std() > 20 and (px < 60).all(axis=2).mean() > 0.01  # text, graph and dark frames, not a blank page
    small = img.resize((900, 1500), Image.LANCZOS).quantize(colors=128)
    buf = io.BytesIO()
    small.save(buf, "PNG", optimize=True)
    assert len(buf.getvalue()) < 400_000
    if os.environ.get("M1_WRITE_DOCS") == "1":
        (REPO / "docs" / "trace_page.png").write_bytes(buf.getvalue())


def test_view_serves_nothing_a_symlink_leads_to_outside_the_folder(tmp_path):
    import threading
    import urllib.error

    from m1.trace_index import serve

    traces, outside = tmp_path / "traces", tmp_path / "outside"
    traces.mkdir()
    outside.mkdir()
    (traces / "index.html").write_text("<p>index</p>")
    (traces / "inner").mkdir()
    (traces / "inner" / "page.html").write_text("<p>inner</p>")
    (outside / "secret.txt").write_text("not for the browser")
    (traces / "etc").symlink_to(outside, target_is_directory=True)
    (traces / "secret.txt").symlink_to(outside / "secret.txt")
    (traces / "inside.html").symlink_to(traces / "inner" / "page.html")  # a link that stays inside is served
    server = serve(traces, 0)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    base = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        for path, body in (("/index.html", "<p>index</p>"), ("/inside.html", "<p>inner</p>")):
            with urllib.request.urlopen(base + path, timeout=10) as r:
                assert r.status == 200 and r.read().decode() == body
        for path in ("/etc/secret.txt", "/etc/", "/secret.txt", "/../outside/secret.txt", "/%2e%2e/outside/secret.txt"):
            with pytest.raises(urllib.error.HTTPError) as err:
                urllib.request.urlopen(base + path, timeout=10)
            assert err.value.code == 404, path
    finally:
        server.shutdown()
        server.server_close()
