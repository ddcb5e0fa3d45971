"""What one server accepts, set by `m1 serve`'s flags: every part of the server reads its bounds from here."""

from dataclasses import dataclass, field
from pathlib import Path

from m1.schema import MAX_QUESTION_CHARS


@dataclass
class Limits:
    """What one server accepts: media roots, request size, queue length, per-request time, gather window."""

    allowed_roots: list[Path] = field(default_factory=list)
    max_body_bytes: int = 64 << 20
    # the question's text and options, all together (a bound on tokenizing's cost; questions files share it)
    max_text_chars: int = MAX_QUESTION_CHARS
    max_frames: int = 512
    max_queue: int = 64
    timeout_s: float = 300.0
    gather_s: float = 0.05
