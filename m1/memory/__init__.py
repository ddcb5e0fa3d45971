from m1.memory.buffer import SharedMemory, render_record

__all__ = ["SharedMemory", "render_record"]
