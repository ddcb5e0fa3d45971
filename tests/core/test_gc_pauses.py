"""m1/gc_pauses.py: inside the block the collector walks fewer objects less often; after it, everything is back."""
import gc

import pytest

from m1.gc_pauses import fewer_gc_pauses


def test_the_block_freezes_what_lives_and_raises_the_young_threshold_then_restores_both():
    before, frozen = gc.get_threshold(), gc.get_freeze_count()
    with fewer_gc_pauses(gen0=12_345):
        assert gc.get_threshold() == (max(12_345, before[0]), *before[1:])
        assert gc.get_freeze_count() > frozen  # what was alive at the start is no longer walked
        garbage = []
        garbage.append(garbage)  # a cycle: reference counting alone cannot free it
    assert gc.get_threshold() == before and gc.get_freeze_count() == frozen
    del garbage
    assert gc.collect() >= 1  # cycles made inside are still collectable after it


def test_an_error_inside_restores_the_collector_too():
    before, frozen = gc.get_threshold(), gc.get_freeze_count()
    with pytest.raises(RuntimeError, match="boom"), fewer_gc_pauses():
        raise RuntimeError("boom")
    assert gc.get_threshold() == before and gc.get_freeze_count() == frozen
