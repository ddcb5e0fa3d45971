"""The tools agents plan with. Names are exact; `group` is select (sets the focus) or browse (reads it).

The names and settings live in m1/registry.py (configs validate against them there); this module re-exports them.
"""
from m1.registry import BROWSE_TOOLS, SELECT_TOOLS, TOOL_NAMES, TOOLS, ToolSpec, register_tool

__all__ = ["SELECT_TOOLS", "BROWSE_TOOLS", "TOOL_NAMES", "TOOLS", "ToolSpec", "register_tool"]
