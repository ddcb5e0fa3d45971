"""What a tool sees (ToolContext) and gives back (ToolResult)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from m1.config import ToolsConfig
from m1.schema import Question

if TYPE_CHECKING:
    from m1.tools.clip_index import ClipIndex
    from m1.video import VideoReader


@dataclass
class Focus:
    """The frames an agent is looking at: indices, their times, and the span they came from."""

    indices: list[int]
    timestamps: list[float]
    span: tuple[float, float]
    scattered: bool = False  # frames picked one by one (Image Retrieval), not a contiguous clip


@dataclass
class ToolResult:
    output: str
    focus: Focus | None = None
    answer: str | None = None
    span: tuple[float, float] | None = None
    error: str | None = None
    frames: list[int] = field(default_factory=list)  # frame indices the tool read


@dataclass
class ToolContext:
    question: Question
    video: VideoReader
    key_info: str
    cfg: ToolsConfig
    focus: Focus | None = None
    clip: ClipIndex | None = None


class ToolError(Exception):
    """A tool could not do its job; the engine writes the message into memory."""
