"""Fewer garbage-collector pauses in the long loops (training steps, a questions file).

Why: a MARL step of the mini team makes some 10^5 short-lived Python objects (prompt dicts, token lists, tensor
wrappers). At CPython's default thresholds (700, 10, 10) the cyclic collector ran 819 times in three steps, and
each older-generation pass walks every object the models, tokenizers and caches hold: 0.70 s of collection. Here
it ran 9 times in the same three steps, plus one full collection of 0.3 s when the loop starts (run 2026-12-02,
AMD EPYC, one thread, `mini_recipe`). So while a loop runs, what was alive before it is frozen (`gc.freeze`: the
collector no longer walks it) and the youngest generation waits for `GEN0` allocations. Reference counting still
frees at once everything that is not in a cycle; only cyclic garbage waits a little longer.
"""
from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager

GEN0 = 50_000


@contextmanager
def fewer_gc_pauses(gen0: int = GEN0) -> Iterator[None]:
    """Within the block: older objects frozen, the youngest generation collected every `gen0` allocations; the
    thresholds are restored after it, and the frozen set unless something had frozen objects before (it cannot be
    unfrozen in part: those stay frozen, as they were)."""
    before, frozen = gc.get_threshold(), gc.get_freeze_count()
    gc.collect()
    gc.freeze()
    gc.set_threshold(max(gen0, before[0]), *before[1:])
    try:
        yield
    finally:
        gc.set_threshold(*before)
        if not frozen:
            gc.unfreeze()
