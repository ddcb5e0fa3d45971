"""The top-level boxes of an ISO BMFF file (mp4, mov, m4v, 3gp), walked by their headers: what tells a file that is
cut short or still being written from a shorter video.

A file still being written, or cut short, must not pass for a shorter video: FFmpeg reads what is there and reports
that as the whole video. For ISO BMFF two things show it:
 - the file ends inside a top-level box (a `moof`/`mdat` whose size runs past the end of the file): a recorder that
   is still writing, or a copy cut in half, almost always stops mid-box; a finished file never does;
 - a fragmented MP4 that declares its total length (`mehd` in `moov/mvex`, written by MP4Box, GStreamer and
   recorders that rewrite the header when they finish) holds less than that: compared with the packets present.
What cannot be told: a fragmented MP4 that declares no total length (FFmpeg's `empty_moov` writes no `mehd` and an
`mvhd` of 0 s) cut exactly at a fragment boundary is a valid shorter file; nothing in it says more was meant.
A non-fragmented mp4 describes every sample in its `moov`, so a cut one shows a torn `mdat` (or FFmpeg finds no
`moov` at all). Other containers (mkv/webm/avi) are not compared: FFmpeg may estimate their duration from the
bitrate, which PyAV does not tell apart from a declared one, so a comparison would flag good files.
The check against the packets is `probing.py`'s.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

_BMFF_FIRST = {b"ftyp", b"styp", b"moov", b"mdat", b"free", b"skip", b"wide", b"pnot", b"uuid", b"sidx", b"junk"}


@dataclass(frozen=True)
class BmffLayout:
    fragmented: bool  # a `moof` or `moov/mvex` is present
    declared: float | None  # total seconds from `mehd` (fragmented files only); None when not declared
    torn: tuple[str, int, int] | None  # (box type, its declared size, bytes present) when the file ends inside it


def _boxes(data: bytes, start: int, end: int) -> Iterable[tuple[bytes, int, int]]:
    """(type, payload start, payload end) of the boxes in data[start:end]; stops at the first malformed one."""
    pos = start
    while pos + 8 <= end:
        size, kind, header = int.from_bytes(data[pos:pos + 4], "big"), data[pos + 4:pos + 8], 8
        if size == 1 and pos + 16 <= end:
            size, header = int.from_bytes(data[pos + 8:pos + 16], "big"), 16
        elif size == 0:
            size = end - pos
        if size < header or pos + size > end:
            return
        yield kind, pos + header, pos + size
        pos += size


def _declared_from_moov(moov: bytes) -> float | None:
    """The total length a fragmented movie declares: `mehd` fragment_duration over the `mvhd` timescale."""
    timescale, total = 0, None
    for kind, a, b in _boxes(moov, 0, len(moov)):
        if kind == b"mvhd" and b - a >= 24:
            timescale = int.from_bytes(moov[a + 20:a + 24] if moov[a] == 1 else moov[a + 12:a + 16], "big")
        elif kind == b"mvex":
            for sub, c, d in _boxes(moov, a, b):
                if sub == b"mehd" and d - c >= 8:
                    wide = moov[c] == 1 and d - c >= 12
                    value = int.from_bytes(moov[c + 4:c + 12] if wide else moov[c + 4:c + 8], "big")
                    if 0 < value < (1 << (64 if wide else 32)) - 1:  # all ones means "unknown"
                        total = value
    return total / timescale if total and timescale > 0 else None


def bmff_layout(path: Path) -> BmffLayout | None:
    """The top-level boxes of an ISO BMFF file, walked by their headers (only `moov` is read); None when the file
    does not start like one."""
    size = path.stat().st_size
    declared, fragmented, pos = None, False, 0
    with open(path, "rb") as f:
        while pos + 8 <= size:
            f.seek(pos)
            head = f.read(16)
            box, kind, header = int.from_bytes(head[:4], "big"), head[4:8], 8
            if not (kind.isascii() and kind.decode("latin-1").isprintable()):
                if pos == 0:
                    return None
                break  # trailing bytes that are not a box (padding): not a sign of a cut
            if pos == 0 and kind not in _BMFF_FIRST:
                return None
            if box == 1:
                if len(head) < 16:
                    return BmffLayout(fragmented, None, (kind.decode("latin-1"), 16, len(head)))
                box, header = int.from_bytes(head[8:16], "big"), 16
            elif box == 0:  # "extends to the end of the file"
                box = size - pos
            if box < header:
                if pos == 0:
                    return None
                break
            if pos + box > size:
                return BmffLayout(fragmented, declared if fragmented else None,
                                  (kind.decode("latin-1"), box, size - pos))
            if kind == b"moof":
                fragmented = True
            elif kind == b"moov" and box <= 64 << 20:
                f.seek(pos + header)
                moov = f.read(box - header)
                fragmented = fragmented or any(k == b"mvex" for k, _, _ in _boxes(moov, 0, len(moov)))
                declared = _declared_from_moov(moov)
            pos += box
    return BmffLayout(fragmented, declared if fragmented else None, None)
