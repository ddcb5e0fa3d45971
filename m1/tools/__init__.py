"""The paper's eight tools. Names are exact; `group` is select (sets the focus) or browse (reads it).

This module stays import-light: configs use TOOL_NAMES for validation.
"""
SELECT_TOOLS = ["Global Sampling", "Video Retrieval", "Time Stamp Retrieval", "Image Retrieval"]
BROWSE_TOOLS = ["Rough Browser", "Fine Browser", "Space Tool", "Grounding Tool"]
TOOL_NAMES = {**{t: "select" for t in SELECT_TOOLS}, **{t: "browse" for t in BROWSE_TOOLS}}

__all__ = ["SELECT_TOOLS", "BROWSE_TOOLS", "TOOL_NAMES"]
