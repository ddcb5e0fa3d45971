"""Frames: (1) decoded frames per episode / unique frames the tools asked for (target 1.0);
(2) 16-frame sampling vs decoding every frame of a generated 20-minute 480p video.

(1) A 4-agent episode whose agents use seven different tools (Global Sampling, Image Retrieval,
Video Retrieval, Time Stamp Retrieval, Rough/Fine Browser, Space Tool) with a real tiny
open_clip; chat and browser are scripted (they cost nothing and do not touch frames). A wrapper
around each VideoReader records every index the tools request; `VideoPool.decoded_total` counts
what was actually decoded. Run on a 2-minute and on the 20-minute 480p video, and for a batch of
4 episodes on the same video (frames shared across episodes).

(2) Sampling 16 frames uniformly (what Global Sampling and the Rough Browser need) vs decoding
all frames (read in chunks and dropped, so memory stays bounded). ratio = 16-frame time / all.

    python benchmarks/bench_frames.py [--minutes 20] [--json out.json]
"""
from __future__ import annotations

import time

from _common import CannedVision, Figure, Result, ScriptedChat, bench_video, cli, finish

PLANS = {
    "m_a": "##key info: overview of the scenes\n##tool use: <Global Sampling>, <Rough Browser>",
    "m_b": "##key info: the white square\n##tool use: <Image Retrieval>, <Fine Browser>",
    "m_c": "##key info: the red bar\n##tool use: <Video Retrieval>, <Rough Browser>",
    "m_d": "##key info: what is on screen at 01:00\n##tool use: <Time Stamp Retrieval>, <Space Tool>",
}


class CountingReader:
    """A VideoReader that remembers which frame indices were asked for."""

    def __init__(self, reader, log: list[int]):
        self._reader, self._log = reader, log

    def frames(self, indices):
        idx = list(indices)
        self._log.extend(int(i) for i in idx)
        return self._reader.frames(idx)

    def __getattr__(self, name):
        return getattr(self._reader, name)


def counting_pool(max_bytes: int):
    from m1.video import VideoPool

    class CountingPool(VideoPool):
        def __init__(self, *a, **kw):
            super().__init__(*a, **kw)
            self.requested: dict[str, list[int]] = {}

        def open(self, path):
            reader = super().open(path)
            return CountingReader(reader, self.requested.setdefault(str(reader.path), []))

    return CountingPool(max_bytes=max_bytes)


def team_cfg():
    from m1.config import TeamConfig, load_team

    clip_spec = load_team("tiny").models["clip"].model_dump()
    models = {k: {"interface": "chat", "path": f"scripted/{k}"} for k in PLANS}
    models["vlm"] = {"interface": "vision", "path": "scripted/vlm"}
    models["clip"] = clip_spec
    agents = [{"name": f"agent_{k[-1]}", "model": k} for k in PLANS]
    return TeamConfig.model_validate({"name": "bench-frames", "models": models, "agents": agents,
                                      "tools": {"clip": "clip", "browser": "vlm"},
                                      "limits": {"max_turns": 3, "max_tool_calls": 4, "batch_episodes": 8}})


def episode_counts(cfg, clip_model, video: str, n_episodes: int) -> dict:
    from m1.models.hub import ModelHub
    from m1.schema import Question
    from m1.team.cpp import Team

    hub = ModelHub(cfg.models)
    for key, plan in PLANS.items():
        hub.register(key, ScriptedChat(key, plan))
    hub.register("vlm", CannedVision())
    hub.register("clip", clip_model)
    pool = counting_pool(cfg.limits.frame_cache_mb << 20)  # the cache size the engine uses
    team = Team(cfg, hub=hub, pool=pool)
    qs = [Question(id=f"q{i}", video=video, text="What colour is the square at 01:00?",
                   options=["white", "red", "blue", "green"], task="mcq") for i in range(n_episodes)]
    t0 = time.perf_counter()
    eps = team.run(qs)
    wall = time.perf_counter() - t0
    errors = [e.error for e in eps if e.error] + [t.error for e in eps for r in e.memory.values()
                                                  for t in r.turns if t.error]
    if errors:
        raise RuntimeError(f"the episode had errors: {errors[:3]}")
    requested = [i for log in pool.requested.values() for i in log]
    return {"decoded": pool.decoded_total, "unique": len(set(requested)), "requested": len(requested),
            "evictions": pool.cache.evictions, "wall": wall, "frames_used": [e.frames_used for e in eps],
            "timings": eps[0].timings, "tools": sorted({t.tool for r in eps[0].memory.values() for t in r.turns})}


def decode_times(path) -> dict:
    from m1.video import VideoReader, uniform_indices

    r16 = VideoReader(path, cache=None)
    idx = uniform_indices(r16.info, 16)
    t0 = time.perf_counter()
    frames = r16.frames(idx)
    t16 = time.perf_counter() - t0
    assert frames.shape[0] == 16 and r16.decoded == 16
    r16.close()
    rall = VideoReader(path, cache=None)
    n = rall.info.num_frames
    t0 = time.perf_counter()
    for start in range(0, n, 200):  # all frames, in bounded chunks
        rall.frames(range(start, min(n, start + 200)))
    tall = time.perf_counter() - t0
    assert rall.decoded == n
    info = rall.info
    rall.close()
    return {"t16": t16, "tall": tall, "n": n, "info": info}


def main() -> None:
    p = cli(__doc__.splitlines()[0])
    p.add_argument("--minutes", type=float, default=20.0)
    args = p.parse_args()

    res = Result("bench_frames.py")
    long_path, gen_s = bench_video("long480p", seconds=args.minutes * 60, fps=5, width=640, height=480)
    short_path, gen_short = bench_video("short480p", seconds=120, fps=5, width=640, height=480)
    res.add("video (long)", f"{long_path.name}: generated in {gen_s:.1f} s" if gen_s is not None
            else f"{long_path.name}: cached (generation time was reported on the first run)")
    if gen_short is not None:
        res.add("video (short)", f"{short_path.name}: generated in {gen_short:.1f} s")

    cfg = team_cfg()
    from m1.models.hub import ModelHub

    clip_model = ModelHub(cfg.models).clip("clip")
    for label, path, n_eps in (("2-min 480p, 1 episode", short_path, 1),
                               ("2-min 480p, 4 episodes in one batch", short_path, 4),
                               (f"{args.minutes:g}-min 480p, 1 episode", long_path, 1)):
        c = episode_counts(cfg, clip_model, str(path), n_eps)
        res.add(f"{label}: decoded / unique requested / requested with repeats",
                f"{c['decoded']} / {c['unique']} / {c['requested']} (cache evictions {c['evictions']}, "
                f"wall {c['wall']:.2f} s)")
        t = c["timings"]
        res.add(f"{label}: episode timings", ", ".join(f"{k} {t[k]:.2f}s" for k in
                                                       ("open_video", "tools", "vision", "llm", "batch_wall") if k in t)
                + f"; frames_used {c['frames_used']}")
        ratio = c["decoded"] / c["unique"]
        note = ""
        if c["evictions"]:
            note = (f"the shared FrameCache (1 GiB) evicted {c['evictions']} frames: Image Retrieval scans "
                    "2 fps of a 480p video, more than the cache holds, so a few frames were decoded twice")
        res.add(f"{label}: tools used", ", ".join(c["tools"]))
        res.figures.append(Figure(figure=f"decoded / unique frames needed ({label}, {len(c['tools'])} tools)",
                                  baseline=f"{c['unique']} unique", measured=f"{c['decoded']} decoded",
                                  ratio=ratio, ratio_def="decoded / unique", target="1.0",
                                  met=abs(ratio - 1.0) < 1e-9, note=note))

    d = decode_times(long_path)
    info = d["info"]
    res.add("long video", f"{info.width}x{info.height}, {info.fps:g} fps, {info.num_frames} frames, "
                          f"{info.duration / 60:.1f} min, {long_path.stat().st_size / 1e6:.1f} MB")
    res.add("16-frame uniform sampling", f"{d['t16'] * 1000:.0f} ms")
    res.add("decode every frame", f"{d['tall']:.2f} s ({d['tall'] / d['n'] * 1000:.2f} ms/frame)")
    res.figures.append(Figure(figure=f"16-frame sampling vs decoding every frame ({args.minutes:g}-min 480p, "
                                     f"{d['n']} frames)",
                              baseline=f"{d['tall']:.2f} s", measured=f"{d['t16'] * 1000:.0f} ms",
                              ratio=d["t16"] / d["tall"], ratio_def="sampled / all", target="-", met=None))
    finish(res, args.json)


if __name__ == "__main__":
    main()
