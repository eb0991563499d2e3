"""What a start spends beside loading the model (serving/fast_start.py): full collections held off until the
engine is ready and then put back as they were; what is imported frozen; torch's compiler keys prefetched
unchanged."""

from __future__ import annotations

import gc
from collections.abc import Iterator

import pytest

from spark_edge.serving import fast_start


@pytest.fixture(autouse=True)
def _threshold() -> Iterator[None]:
    before = gc.get_threshold()
    yield
    gc.set_threshold(*before)
    gc.unfreeze()


def test_full_collections_are_held_off_until_resumed() -> None:
    before = gc.get_threshold()
    fast_start.hold_off_full_collections()
    fast_start.hold_off_full_collections()  # twice: what is put back is still the first threshold
    held = gc.get_threshold()
    assert held[:2] == before[:2] and held[2] > 1_000_000
    fast_start.resume_full_collections()
    assert gc.get_threshold() == before


def test_what_is_imported_is_frozen_out_of_the_collectors_sight() -> None:
    gc.unfreeze()
    fast_start.freeze_imported()
    assert gc.get_freeze_count() > 10_000  # this test run's modules, at least


def test_prefetched_compiler_keys_are_the_keys_computed_in_place() -> None:
    """The prefetch only moves the hashing earlier: the keys vLLM's cache is keyed by stay what they were."""
    import subprocess
    import sys

    from torch._inductor import codecache

    fast_start.prefetch_compiler_keys()
    keys = [codecache.torch_key().hex(), str(codecache.triton_key())]
    code = "from torch._inductor import codecache as c; print(c.torch_key().hex()); print(c.triton_key())"
    fresh = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert keys == fresh
