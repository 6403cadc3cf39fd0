"""A serving process's garbage collector (``engine/gc_heap.py``): the heap frozen while it serves, its full
collections counted and reported with an engine's stats."""

from __future__ import annotations

import gc
import weakref
from multiprocessing import Pipe

import pytest

from sloserve.core.errors import ConfigError
from sloserve.engine.engine_core import EngineCore
from sloserve.engine.gc_heap import FullCollections, freeze_switch, frozen_heap
from sloserve.engine.llm_engine import LLMEngine
from sloserve.engine.loader import load_model


class Node:
    """An object in a reference cycle (itself): only the cyclic collector frees it."""

    def __init__(self) -> None:
        self.me = self


def test_what_was_alive_when_the_heap_froze_is_not_collected_until_it_thaws():
    alive = Node()
    was_alive = weakref.ref(alive)
    with frozen_heap():
        assert gc.get_freeze_count() > 0
        del alive  # garbage now, but frozen
        made_since = Node()
        since = weakref.ref(made_since)
        del made_since
        gc.collect()
        assert was_alive() is not None
        assert since() is None  # what is made after the freeze is collected as ever
    assert gc.get_freeze_count() == 0
    gc.collect()
    assert was_alive() is None


def test_with_the_switch_off_nothing_is_frozen(monkeypatch):
    assert freeze_switch()  # (on by default)
    monkeypatch.setenv("SLOSERVE_FREEZE_GC", "0")
    alive = Node()
    was_alive = weakref.ref(alive)
    with frozen_heap(freeze_switch()):
        assert gc.get_freeze_count() == 0
        del alive
        gc.collect()
        assert was_alive() is None


@pytest.mark.parametrize("command", ["run", "serve"])
def test_a_bad_switch_value_stops_the_command_by_name_before_it_starts(command, monkeypatch):
    from click.testing import CliRunner

    from sloserve.cli import main

    monkeypatch.setenv("SLOSERVE_FREEZE_GC", "yes")
    with pytest.raises(ConfigError, match="SLOSERVE_FREEZE_GC must be 0 or 1, got 'yes'"):
        freeze_switch()
    from sloserve.bench.client import free_loopback_port

    args = ["--trace", "sharegpt", "--num-requests", "1"] if command == "run" else ["--port", str(free_loopback_port())]
    result = CliRunner().invoke(main, [command, "--model", "random:tiny-llama", *args])
    assert result.exit_code == 2, result.output
    assert "SLOSERVE_FREEZE_GC must be 0 or 1, got 'yes'" in result.output


def test_full_collections_count_the_oldest_generation_only_until_closed():
    collections = FullCollections()
    gc.disable()  # (no collection but these: the counts are exact)
    try:
        gc.collect(0)
        gc.collect(1)
        assert collections.count == 0
        gc.collect()
        gc.collect()
        assert collections.count == 2
        assert collections.seconds > 0
        collections.close()
        gc.collect()
        assert collections.count == 2
    finally:
        gc.enable()
        collections.close()


def test_an_engine_core_reports_its_processs_full_collections():
    """``EngineCore.run`` counts them (as the core process serves); each step's stats carry the totals."""
    engine = LLMEngine(load_model("random:tiny-llama", device="cpu"), "vllm", kv_capacity_tokens=1024)
    here, there = Pipe()
    core = EngineCore(engine, 0.0, there)
    assert (core.stats().gc_full_collections, core.stats().gc_full_collection_s) == (0, 0.0)  # (not serving yet)
    core.full_collections = FullCollections()
    try:
        gc.collect()
        stats = core.stats()
    finally:
        core.full_collections.close()
        here.close()
        there.close()
    assert stats.gc_full_collections >= 1
    assert stats.gc_full_collection_s > 0
