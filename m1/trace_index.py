"""The run's trace index: one page listing every episode of a trace folder, rebuilt from the episode JSONs that
`m1.trace` writes beside each page, and the small HTTP server `m1 view` shows a trace folder with.

The index carries accuracy per family and filters (family, right/wrong, text) that run in the browser, so it too
needs nothing but the folder.
"""
from __future__ import annotations

import os
import time
from collections import defaultdict
from pathlib import Path

from m1.files import write_whole
from m1.results import result_row
from m1.schema import Episode
from m1.trace import _CSS, INDEX_NAME, _e, family_of


def index_row(ep: Episode, href: str) -> dict:
    """One line of the index: the same answer/truth/correct as the results file, plus family and link."""
    row = result_row(ep)
    return {"id": ep.id, "href": href, "family": family_of(ep), "question": ep.question.text,
            "answer": row.get("answer"), "truth": row.get("truth"), "correct": row.get("correct"),
            "error": ep.error, "votes": {a: v["answer"] for a, v in row["agents"].items()},
            "frames": ep.frames_used}


def _result(row: dict) -> str:
    if row.get("error"):
        return "error"
    if row.get("correct") is None:
        return "ungraded"
    return "right" if row["correct"] else "wrong"


_INDEX_JS = r"""
(function(){
  var rows=[].slice.call(document.querySelectorAll('tr.q')), fam=document.getElementById('family'),
      res=document.getElementById('result'), txt=document.getElementById('search'), shown=document.getElementById('shown');
  function apply(push){
    var f=fam.value, r=res.value, s=txt.value.trim().toLowerCase(), n=0;
    rows.forEach(function(tr){
      var ok=(!f||tr.dataset.family===f)&&(!r||tr.dataset.result===r)&&(!s||tr.dataset.text.indexOf(s)>=0);
      tr.hidden=!ok; if(ok) n++;
    });
    shown.textContent=n; document.body.dataset.shown=n;
    if(push){var p=[];if(f)p.push('family='+encodeURIComponent(f));if(r)p.push('result='+r);
      if(s)p.push('q='+encodeURIComponent(s));history.replaceState(null,'',p.length?'#'+p.join('&'):location.pathname+location.search);}
  }
  function load(){
    var src=(location.hash.slice(1)||location.search.slice(1)).split('&');
    src.forEach(function(kv){var i=kv.indexOf('='); if(i<0) return; var k=kv.slice(0,i), v=decodeURIComponent(kv.slice(i+1).replace(/\+/g,' '));
      if(k==='family') fam.value=v; else if(k==='result') res.value=v; else if(k==='q') txt.value=v;});
    apply(false);
  }
  [fam,res].forEach(function(el){el.addEventListener('change',function(){apply(true);});});
  txt.addEventListener('input',function(){apply(true);});
  window.addEventListener('hashchange',load);
  load();
})();
"""


def render_index(rows: list[dict], title: str = "M1 traces", skipped: int = 0,
                 up: tuple[str, str] | None = None) -> str:
    """The run's index: accuracy per family, one row per question linking its page, and client-side
    filters (family, right/wrong, text) that also read `#family=..&result=..&q=..` from the URL. `up`: (href, text)
    of the page this index belongs to (a training step's samples link back to the run's page)."""
    rows = sorted(rows, key=lambda r: r["id"])
    fams: dict[str, list[int]] = defaultdict(lambda: [0, 0, 0, 0])  # right, graded, errors, all
    for r in rows:
        f = fams[r["family"]]
        f[3] += 1
        if r.get("error"):
            f[2] += 1
        elif r.get("correct") is not None:
            f[1] += 1
            f[0] += bool(r["correct"])
    tot = [sum(v[i] for v in fams.values()) for i in range(4)]

    def pct(c, n):
        return f"{c / n:.1%}" if n else "–"

    acc = "".join(f"<tr class='fam' data-family='{_e(f)}'><td><a href='#family={_e(f)}'>{_e(f)}</a></td>"
                  f"<td class='acc'>{c}/{n}</td><td class='pct'>{pct(c, n)}</td><td>{e}</td><td>{a}</td></tr>"
                  for f, (c, n, e, a) in sorted(fams.items()))
    acc += (f"<tr class='fam all' data-family=''><th>all</th><th class='acc'>{tot[0]}/{tot[1]}</th>"
            f"<th class='pct'>{pct(tot[0], tot[1])}</th><th>{tot[2]}</th><th>{tot[3]}</th></tr>")
    marks = {"right": "<span class='ok'>✓</span>", "wrong": "<span class='bad'>✗</span>",
             "error": "<span class='err'>error</span>", "ungraded": "<span class='muted'>–</span>"}
    body = []
    for r in rows:
        res = _result(r)
        votes = ", ".join(f"{a}={v if v is not None else '∅'}" for a, v in r["votes"].items())
        text = " ".join(str(x) for x in (r["id"], r["question"], r["family"], r["answer"], r["truth"]) if x is not None)
        body.append(f"<tr class='q' data-id='{_e(r['id'])}' data-family='{_e(r['family'])}' data-result='{res}' "
                    f"data-text='{_e(text.lower())}'><td>{marks[res]}</td>"
                    f"<td><a href='{_e(r['href'])}'>{_e(r['id'])}</a></td><td>{_e(r['family'])}</td>"
                    f"<td>{_e(r['question'])}</td><td class='answer'>{_e(r['answer'])}</td>"
                    f"<td class='truth'>{_e(r['truth'])}</td><td class='muted'>{_e(votes)}"
                    + (f"<br><span class='err'>{_e(r['error'])}</span>" if r.get("error") else "") + "</td></tr>")
    fam_opts = "".join(f"<option value='{_e(f)}'>{_e(f)}</option>" for f in sorted(fams))
    when = time.strftime("%Y-%m-%d %H:%M:%S")
    return (f"<!doctype html><html lang='en'><head><meta charset='utf-8'><title>{_e(title)}</title>"
            f"<meta name='viewport' content='width=device-width'><style>{_CSS}"
            "tr.q[hidden]{display:none}tr.q td:nth-child(2){white-space:nowrap}"
            ".filters{margin:10px 0}.filters>*{margin-right:8px}</style></head><body>"
            + (f"<p class='up'><a href='{_e(up[0])}'>↑ {_e(up[1])}</a></p>" if up else "")
            + f"<h1>{_e(title)}</h1><p class='muted'>{len(rows)} questions · written {when}"
            + (f" · {skipped} unreadable trace files left out" if skipped else "") + "</p>"
            "<h2>Accuracy per family</h2><table class='families'><tr><th>family</th><th>right/graded</th>"
            f"<th>accuracy</th><th>errors</th><th>questions</th></tr>{acc}</table>"
            "<h2>Questions</h2><div class='filters'>"
            f"<select id='family'><option value=''>all families</option>{fam_opts}</select>"
            "<select id='result'><option value=''>right and wrong</option><option value='right'>right</option>"
            "<option value='wrong'>wrong</option><option value='error'>error</option>"
            "<option value='ungraded'>no truth</option></select>"
            "<input id='search' type='search' placeholder='search text' size='30'>"
            f"<span><b id='shown'>{len(rows)}</b> of {len(rows)} shown</span></div>"
            "<table class='questions'><tr><th></th><th>id</th><th>family</th><th>question</th><th>team</th>"
            "<th>truth</th><th>votes</th></tr>" + "".join(body) + "</table>"
            f"<script>{_INDEX_JS}</script></body></html>")


class TraceIndex:
    """The rows of a trace folder's index, read from its episode JSONs once each (a cache keyed by file
    size and mtime), so rewriting the index while a run goes on costs a directory listing."""

    def __init__(self, trace_dir: Path):
        self.dir = Path(trace_dir)
        self._rows: dict[str, tuple[tuple[int, int], dict | None]] = {}  # json name -> (stamp, row or None)

    @staticmethod
    def _stamp(path: Path) -> tuple[int, int] | None:
        try:
            st = path.stat()
        except OSError:
            return None
        return st.st_size, st.st_mtime_ns

    def add(self, ep: Episode, json_path: Path) -> None:
        """An episode just written to `json_path` (no need to read it back)."""
        stamp = self._stamp(json_path)
        if stamp is not None:
            self._rows[json_path.name] = (stamp, index_row(ep, json_path.with_suffix(".html").name))

    def rows(self) -> tuple[list[dict], int]:
        """Every readable episode's row, and how many JSON files were not episodes (or not readable)."""
        from pydantic import ValidationError

        names = set()
        if self.dir.is_dir():
            for path in self.dir.glob("*.json"):
                if path.name.startswith("."):
                    continue
                names.add(path.name)
                stamp = self._stamp(path)
                cached = self._rows.get(path.name)
                if stamp is None or (cached is not None and cached[0] == stamp):
                    continue
                try:
                    ep = Episode.model_validate_json(path.read_bytes())
                    row = index_row(ep, path.with_suffix(".html").name)
                except (OSError, ValueError, ValidationError):
                    row = None
                self._rows[path.name] = (stamp, row)
        for gone in set(self._rows) - names:
            del self._rows[gone]
        rows = [r for _, r in self._rows.values() if r is not None]
        return rows, len(self._rows) - len(rows)

    def html(self, title: str | None = None, up: tuple[str, str] | None = None) -> str:
        rows, skipped = self.rows()
        d = self.dir.resolve()
        return render_index(rows, title or f"M1 traces · {d.parent.name if d.name == 'traces' else d.name}", skipped,
                            up)

    def write(self) -> Path:
        """Write `index.html` whole (temporary file renamed over it); WriteError if it cannot be."""
        self.dir.mkdir(parents=True, exist_ok=True)
        path = self.dir / INDEX_NAME
        write_whole(path, self.html().encode())
        return path


def build_index(trace_dir: Path) -> Path:
    """(Re)build a trace folder's index from its episode JSONs; returns its path."""
    return TraceIndex(trace_dir).write()


def index_is_stale(trace_dir: Path) -> bool:
    """No index yet, or an episode JSON newer than it."""
    path = Path(trace_dir) / INDEX_NAME
    if not path.is_file():
        return True
    built = path.stat().st_mtime_ns
    return any(p.stat().st_mtime_ns > built for p in Path(trace_dir).glob("*.json") if not p.name.startswith("."))


def find_trace_dir(run_dir: Path) -> Path:
    """The trace folder of a run folder: RUN_DIR/traces, or RUN_DIR itself when it holds the traces."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise FileNotFoundError(f"{run_dir}: no such folder")
    for cand in (run_dir / "traces", run_dir):
        if (cand / INDEX_NAME).is_file() or (any(cand.glob("*.json")) and any(cand.glob("*.html"))):
            return cand
    raise FileNotFoundError(f"{run_dir}: no traces found (neither {run_dir / 'traces' / INDEX_NAME} nor "
                            f"{run_dir / INDEX_NAME}, nor episode files); write them with --trace-dir")



def serve(folder: Path, port: int = 0):
    """An HTTP server for `folder` on 127.0.0.1 (port 0: a free one); the caller runs `serve_forever`."""
    import functools
    from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer

    root = os.path.realpath(folder)

    class Quiet(SimpleHTTPRequestHandler):
        def log_message(self, format, *args):  # one line per request would bury the URL
            pass

        def send_head(self):
            """Only what lies inside the trace folder once links are followed: a symlink in it that leads out
            (to /etc, to a home folder) is answered 404, like a path that is not there."""
            real = os.path.realpath(self.translate_path(self.path))
            if real != root and not real.startswith(root + os.sep):
                self.send_error(404, "File not found")
                return None
            return super().send_head()

    server = ThreadingHTTPServer(("127.0.0.1", port), functools.partial(Quiet, directory=str(folder)))
    server.block_on_close = False  # Ctrl-C stops at once, even while a browser holds a connection open
    return server
