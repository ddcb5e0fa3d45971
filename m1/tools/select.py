"""Selection tools: each picks the frames an agent will browse (its focus)."""
from __future__ import annotations

import numpy as np

from m1.registry import GLOBAL_SAMPLING, IMAGE_RETRIEVAL, TIME_STAMP_RETRIEVAL, VIDEO_RETRIEVAL
from m1.text import format_time, parse_timestamp

from m1.tools.base import Focus, ToolContext, ToolError, ToolResult
from m1.video import fps_indices, uniform_indices


def _focus(ctx: ToolContext, indices: list[int], span: tuple[float, float]) -> Focus:
    return Focus(indices=list(indices), timestamps=ctx.video.timestamps(indices), span=span)


def global_focus(ctx: ToolContext) -> Focus:
    """`global_frames` frames spread evenly over the whole video (also what an agent browses when its plan has no
    selection before the browse)."""
    info = ctx.video.info
    return _focus(ctx, uniform_indices(info, ctx.cfg.global_frames), (0.0, info.duration))


def global_sampling(ctx: ToolContext) -> ToolResult:
    focus = global_focus(ctx)
    return ToolResult(output=f"Sampled {len(focus.indices)} frames uniformly over the whole video "
                             f"(00:00-{format_time(focus.span[1])}).", focus=focus)


def clip_spans(duration: float, n: int) -> list[tuple[float, float]]:
    """`n` equal clips that cover [0, duration] without gaps."""
    edges = np.linspace(0.0, duration, n + 1)
    return [(float(edges[i]), float(edges[i + 1])) for i in range(n)]


def video_retrieval(ctx: ToolContext) -> ToolResult:
    """Split into `retrieval_clips` equal clips, score each against the key info with CLIP (mean
    frame embedding), keep the best; with `adjacent_threshold`, extend to neighbouring clips
    scoring above it (at most `max_adjacent_clips` consecutive clips in all)."""
    if ctx.clip is None:
        raise ToolError("Video Retrieval needs a CLIP model (tools.clip) and none is configured")
    info = ctx.video.info
    spans = clip_spans(info.duration, ctx.cfg.retrieval_clips)
    text = ctx.clip.text_embedding(ctx.key_info or ctx.question.text)
    scores = []
    for s, e in spans:
        emb = ctx.clip.frame_embeddings(ctx.video, uniform_indices(info, 8, s, e)).mean(0)
        scores.append(float(emb @ text / (np.linalg.norm(emb) + 1e-8)))
    best = int(np.argmax(scores))
    lo = hi = best
    thr = ctx.cfg.adjacent_threshold
    while thr is not None and hi - lo + 1 < ctx.cfg.max_adjacent_clips:
        left = scores[lo - 1] if lo > 0 else -np.inf
        right = scores[hi + 1] if hi + 1 < len(spans) else -np.inf
        if max(left, right) <= thr:
            break
        if left >= right:
            lo -= 1
        else:
            hi += 1
    span = (spans[lo][0], spans[hi][1])
    idx = uniform_indices(info, ctx.cfg.retrieval_frames, *span)
    clips = f"clip {best + 1}" if lo == hi else f"clips {lo + 1}-{hi + 1}"
    return ToolResult(output=f"Best matching {clips} of {len(spans)} ({format_time(span[0])}-{format_time(span[1])}, "
                             f"score {scores[best]:.3f}); sampled {len(idx)} frames there.",
                      focus=_focus(ctx, idx, span))


def time_stamp_retrieval(ctx: ToolContext) -> ToolResult:
    """`timestamp_window` seconds centred on the time stated in the key info or the question,
    clipped to the video at both ends."""
    t = parse_timestamp(ctx.key_info or "")
    if t is None:
        t = parse_timestamp(ctx.question.text)
    if t is None:
        raise ToolError("Time Stamp Retrieval found no time (mm:ss, hh:mm:ss or seconds) in the key info or question")
    info = ctx.video.info
    if t > info.duration:
        raise ToolError(f"Time Stamp Retrieval: the stated time {format_time(t)} is past the end of the video "
                        f"({format_time(info.duration)})")
    half = ctx.cfg.timestamp_window / 2
    span = (max(0.0, t - half), min(info.duration, t + half))
    idx = uniform_indices(info, ctx.cfg.timestamp_frames, *span)
    return ToolResult(output=f"Took {format_time(span[0])}-{format_time(span[1])} around {format_time(t)}; "
                             f"sampled {len(idx)} frames.", focus=_focus(ctx, idx, span))


def image_retrieval(ctx: ToolContext) -> ToolResult:
    """Frames at `image_fps` over the video, scored by CLIP against the key info; the top
    `image_top_k` are kept and returned in time order."""
    if ctx.clip is None:
        raise ToolError("Image Retrieval needs a CLIP model (tools.clip) and none is configured")
    info = ctx.video.info
    cand = fps_indices(info, ctx.cfg.image_fps)
    scores = ctx.clip.scores(ctx.video, cand, ctx.key_info or ctx.question.text)
    k = min(ctx.cfg.image_top_k, len(cand))
    top = sorted(int(cand[i]) for i in np.argsort(-scores, kind="stable")[:k])
    ts = ctx.video.timestamps(top)
    return ToolResult(output=f"Kept the {k} of {len(cand)} frames (scored at {ctx.cfg.image_fps:g} fps) "
                             f"closest to the key info, from {format_time(ts[0])} to {format_time(ts[-1])}.",
                      focus=Focus(indices=top, timestamps=ts, span=(ts[0], ts[-1]), scattered=True))


# Each select tool's implementation under its registered name (m1/registry.py).
SELECT = {
    GLOBAL_SAMPLING.name: global_sampling,
    VIDEO_RETRIEVAL.name: video_retrieval,
    TIME_STAMP_RETRIEVAL.name: time_stamp_retrieval,
    IMAGE_RETRIEVAL.name: image_retrieval,
}
