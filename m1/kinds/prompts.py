"""System prompts and user turns of the seed kinds, in our own words, with each paper's action syntax.

The first user turn shows the glance (uniform frames, each after a `<frame k at t s>` label, VideoZoomer's
interleaving) and then the question; every later user turn carries tool observations: a short text line per
tool and the frames it returned. Frames are image parts (m1.models.base.ChatRequest); a text-only model sees
placeholders instead.
"""
from __future__ import annotations

from collections.abc import Sequence

from m1.agents.prompts import render_question
from m1.registry import SAGE, WEAVER, ZOOMER
from m1.schema import Question

WEAVER_USAGE = {
    "temporal_grounding": ("Finds the clip of the current context where an event happens and returns it.",
                           '{"tool_name": "temporal_grounding", "query": "the event to ground"}'),
    "frame_selection": ("Picks the single frame of the current context that best shows a scene.",
                        '{"tool_name": "frame_selection", "query": "a description of the wanted moment"}'),
    "temporal_count": ("Checks the current context clip by clip for an event and returns the clips where it "
                       "happens, joined, so the occurrences can be counted.",
                       '{"tool_name": "temporal_count", "query": "the event to count"}'),
    "trim": ("Cuts the video from start to end (seconds, floats; start defaults to 0, end to the video's end); "
             "also good for 'before' or 'after' an event.",
             '{"tool_name": "trim", "start": 0.0, "end": 30.0}'),
    "spatial_tracking": ("Follows the named objects through the current context clip and reports where they go.",
                         '{"tool_name": "spatial_tracking", "objects": ["object1", "object2"]}'),
    "spatial_grounding": ("Locates the named objects in a still scene (the middle frame when the context holds "
                          "several).",
                          '{"tool_name": "spatial_grounding", "objects": ["object1", "object2"]}'),
}

SAGE_USAGE = {
    "ground-event": ("Finds when an event happens between start and end (HH:MM:SS; the whole video when left "
                     "out); returns start and end times, or nulls when it does not happen.",
                     '{"event": "what happens", "start": "00:00:00", "end": "00:02:00"}'),
    "extract-video-parts": ("Returns frames between start and end (HH:MM:SS, at most 5 minutes apart).",
                            '{"start": "00:01:00", "end": "00:01:30", "type": "frames"}'),
    "analyze": ("Asks a vision model a question about the frames last extracted (or between start and end).",
                '{"query": "what to find out", "start": "00:01:00", "end": "00:01:30"}'),
}


def weaver_system(tools: Sequence[str]) -> str:
    lines = ["You answer questions about a video by reasoning step by step and, when it helps, calling tools "
             "that return new clips or frames of the video.", "", "# Tools"]
    for t in tools:
        what, usage = WEAVER_USAGE[t]
        lines += [f"- {t}: {what}", f"  Usage: <tool_call>{usage}</tool_call>"]
    if not tools:
        lines.append("- (no tools in this run: answer from the frames you have)")
    lines += ["", "# Rules",
              "1. Think about what the question needs and whether a tool would show it; call at most one tool per "
              "reply.",
              "2. Temporal tools (temporal_grounding, temporal_count, frame_selection) find moments; spatial tools "
              "(spatial_tracking, spatial_grounding) read positions. Pick the one that fits.",
              "3. Check what a tool returns; if it missed, call again with other arguments.",
              "4. Tools can be wrong: trust what you see in the frames.",
              "5. When you know, give only the final answer inside <answer></answer>, e.g. <answer>B</answer>."]
    return "\n".join(lines)


def zoomer_system(zoom_frames: int, tools: Sequence[str]) -> str:
    lines = ["You receive a low-frame-rate glance at a video and a question about it."]
    if tools:
        lines += [
            "When you need a closer look at a moment, ask for a zoom: give the segment in seconds and the frame "
            "rate you want, as JSON inside <video_zoom></video_zoom>, e.g. "
            '<video_zoom>{"segment": [4.0, 6.0], "fps": 2}</video_zoom>.',
            f"A zoom returns at most {zoom_frames} frames: (end - start) * fps must not exceed {zoom_frames}. "
            "Do not give an answer in a reply that zooms.",
            "Zoom as often as you need until you can answer or are told to stop."]
    lines += ["Reason inside <think></think> first in every reply, then either zoom or put the final answer "
              "inside <answer></answer>."]
    return "\n".join(lines)


def sage_system(tools: Sequence[str]) -> str:
    lines = ["You are a video reasoning agent. Decide whether the frames and the tool results so far are enough "
             "to answer the question; if not, name the tools to call next with their arguments. Use only the "
             "evidence you have; do not invent facts.",
             "Every reply is one JSON object between <json> and </json>:",
             '<json>{"answerable": {"verdict": true, "reasoning": "..."}, "final_answer": "... or null", '
             '"recommended_tools": {"needed": false, "why_no_tool": "...", "tool_calls": '
             '[{"rationale": "...", "name": "...", "arguments": {...}}]}}</json>',
             "Give final_answer (and needed: false) only when the evidence answers the question.",
             "", "Tools:"]
    for t in tools:
        what, args = SAGE_USAGE[t]
        lines.append(f"- {t}: {what} Arguments: {args}")
    if not tools:
        lines.append("- (none in this run: answer from the frames)")
    return "\n".join(lines)


# kind -> its system prompt from (tools, zoom_frames)
SYSTEMS = {WEAVER: lambda tools, zoom_frames: weaver_system(tools),
           ZOOMER: lambda tools, zoom_frames: zoomer_system(zoom_frames, tools),
           SAGE: lambda tools, zoom_frames: sage_system(tools)}


def system_prompt(kind: str, tools: Sequence[str], zoom_frames: int = 16) -> str:
    if kind not in SYSTEMS:
        raise ValueError(f"no system prompt for agent kind {kind!r}")
    return SYSTEMS[kind](tools, zoom_frames)


# What a captioner (`seed_system.captioner`) is asked of each frame a text policy is shown
CAPTION_PROMPT = "Describe this frame: every object you see, its colour, shape and size, and where it is."


def caption_text(reply: str) -> str:
    """A captioner's reply as one line for the policy's chat: without M1's `##Summary:` marker and line breaks."""
    text = reply.strip()
    if text.lower().startswith("##summary:"):
        text = text[len("##summary:"):]
    return " ".join(text.split())


def frame_parts(indices: Sequence[int], times: Sequence[float], start: int = 0) -> list[dict]:
    """Each frame as a `<frame k at t s>` label followed by its image part (k counts from `start`)."""
    parts: list[dict] = []
    for k, (i, t) in enumerate(zip(indices, times)):
        parts.append({"type": "text", "text": f"<frame {start + k} at {t:.1f}s>"})
        parts.append({"type": "image", "time": round(float(t), 3), "frame": int(i)})
    return parts


# kind -> the line after the question in its first turn
ASK = {WEAVER: "Think step by step; call a tool or give <answer></answer>.",
       ZOOMER: "Answer the question, zooming in where you need to.",
       SAGE: "Reply with the <json> object."}


def first_turn(kind: str, question: Question, duration: float, indices: Sequence[int],
               times: Sequence[float]) -> list[dict]:
    """The glance and the question: the content of the first user message."""
    head = (f"The video lasts {duration:.1f} s. {len(indices)} frames sampled uniformly follow, each after its "
            f"time.")
    ask = ASK[kind]
    parts = [{"type": "text", "text": head}] + frame_parts(indices, times)
    parts.append({"type": "text", "text": "\n" + render_question(question) + "\n" + ask})
    return parts


LAST_TURN = {WEAVER: "No tool calls are left: give your final answer in <answer></answer> now.",
             ZOOMER: "Stop using the tool: give your final answer in <answer></answer> now.",
             SAGE: "No tool calls are left: reply with the <json> object holding your final_answer now."}
