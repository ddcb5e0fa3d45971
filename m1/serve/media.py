"""A request's video as a file the team can read: a local file under an allowed root, a `data:` video written to
the request's temporary folder, or image frames encoded as one clip.

Every URL is untrusted: local files are read only under the roots the operator allowed, after resolving symlinks,
so `..`, links out of a root and URL-encoded escapes are refused; http(s) URLs are never fetched.
"""

import base64
import binascii
import io
from pathlib import Path
from urllib.parse import unquote, urlparse

from m1.serve.limits import Limits
from m1.serve.protocol import ApiError, ChatCompletionRequest, bad
from m1.video import out_of_handles


def _parse_url(url: str, param: str):
    try:
        return urlparse(url)
    except ValueError:  # e.g. "http://[::1" (an unclosed IPv6 host)
        raise bad(f"not a valid URL: {url[:100]!r}", param) from None


def _within(path: Path, roots: list[Path]) -> bool:
    return any(path == r or r in path.parents for r in roots)


def local_media(url: str, roots: list[Path], param: str) -> Path:
    """The file a `file://` URL (or a bare absolute path) names, if it lies under an allowed root once every
    symlink is resolved. The URL's percent-escapes are decoded once, and a path holding `..` is refused outright,
    whether written plainly or escaped, so no spelling of a path climbs out of a root."""
    if not roots:
        raise bad("local files are not served: start m1 serve with --allowed-media-root DIR", param)
    parsed = _parse_url(url, param)
    if parsed.scheme == "file":
        if parsed.netloc not in ("", "localhost"):
            raise bad(f"file URL with host {parsed.netloc!r}: only local files (file:///abs/path)", param)
        raw = unquote(parsed.path)
    else:
        raw = url
    if "\x00" in raw or "%" in raw:
        raise bad("the file path holds a NUL or a doubly escaped character", param)
    if not raw.startswith("/"):
        raise bad(f"file path {raw!r} is not absolute", param)
    if ".." in Path(raw).parts:
        raise bad(f"file path {raw!r} holds '..'", param)
    try:
        real = Path(raw).resolve(strict=True)
    except OSError as exc:
        if out_of_handles(exc) is not None:  # the server's file table, not the request: a 503 (m1/serve/app.py)
            raise
        raise bad(f"no such video file: {raw}", param) from None
    except RuntimeError:  # a symlink loop
        raise bad(f"no such video file: {raw}", param) from None
    if not _within(real, roots):
        raise bad(f"{raw} is outside the allowed media roots", param)
    if not real.is_file():
        raise bad(f"{raw} is not a file", param)
    return real


def data_url(url: str, param: str, prefix: str) -> tuple[str, bytes]:
    """(media type, bytes) of a `data:<type>;base64,...` URL whose type starts with `prefix`."""
    head, sep, payload = url.partition(",")
    if not sep or not head.startswith("data:") or not head.endswith(";base64"):
        raise bad(f"a data URL must read data:{prefix}...;base64,<data>", param)
    mtype = head[5:-7]
    if not mtype.startswith(prefix):
        raise bad(f"data URL of type {mtype!r}: expected {prefix}*", param)
    try:
        return mtype, base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise bad("the data URL's payload is not valid base64", param) from None


def frames_clip(images: list[tuple[str, str]], fps: float, tmp: Path, limits: Limits) -> Path:
    """A list of image parts as one short video at `fps`: the team's tools read videos, so the frames are encoded
    (each resized to the first frame's size, even sides for H.264)."""
    import numpy as np
    from PIL import Image, UnidentifiedImageError

    from m1.video import write_video

    if len(images) > limits.max_frames:
        raise ApiError(413, f"{len(images)} image frames: at most {limits.max_frames}", "messages")
    frames = []
    for url, param in images:
        data = data_url(url, param, "image/")[1] if url.startswith("data:") else \
            local_media(url, limits.allowed_roots, param).read_bytes()
        try:
            img = Image.open(io.BytesIO(data)).convert("RGB")
        except (UnidentifiedImageError, OSError, ValueError, Image.DecompressionBombError):
            raise bad("an image_url part is not a readable image", param) from None
        frames.append(img)
    w, h = frames[0].size
    w, h = max(2, w - w % 2), max(2, h - h % 2)
    arrays = [np.asarray(f.resize((w, h)) if f.size != (w, h) else f) for f in frames]
    out = tmp / "frames.mp4"
    write_video(out, arrays, max(1, round(fps)), w, h)
    return out


def video_file(req: ChatCompletionRequest, limits: Limits, tmp: Path) -> Path:
    """The request's one video as a readable file (an inline one written under `tmp`); 400 naming the part when
    it cannot be read, with `tmp` shown as "<upload>"."""
    from m1.video import VideoError, probe

    videos, images = req.media()
    if videos:
        url, param = videos[0]
        if url.startswith("data:"):
            _, data = data_url(url, param, "video/")
            path = tmp / "video.mp4"
            path.write_bytes(data)
        elif _parse_url(url, param).scheme in ("http", "https"):
            raise bad("http(s) video URLs are not fetched: send file:// under an allowed root or a data URL", param)
        else:
            path = local_media(url, limits.allowed_roots, param)
    else:
        path = frames_clip(images, req.frame_fps, tmp, limits)
    try:
        probe(path)
    except (VideoError, OSError) as exc:
        if out_of_handles(exc) is not None:  # the server's file table, not the video: a 503 (m1/serve/app.py)
            raise
        raise bad(f"unreadable video: {str(exc).replace(str(tmp), '<upload>')}", "messages") from None
    return path
