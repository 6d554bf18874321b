"""Faults across the link (pipeline/links.py): what a fenced-off worker does once it
runs again, with its link back or woken from SIGSTOP.
"""

from __future__ import annotations

import os
import time

import numpy as np
import pytest

from storage.arrays import open_cached
from storage.exchange import (Exchange, ExchangeError, SlotSpec, create_exchange,
                              remove_exchange)


def test_a_worker_woken_after_its_run_ended_neither_waits_nor_makes_its_workspace(tmp_path):
    """What a fenced-off worker does once it runs again (its link back, SIGCONT): its
    run's workspace is gone (the client removed it before the recovery). A wait
    gives up within a quarter second, and a slot's first write fails rather than
    make the workspace's folders again (a folder without an owner record, which no
    later run would remove)."""
    path = str(tmp_path / "ended.zarr")
    create_exchange(path, [SlotSpec("act/0/1", (2, 3), "float64")])
    exchange = Exchange(path)
    open_cached(exchange.data, "act/0/1")  # the worker had opened the slot, not written it
    remove_exchange(path)
    started = time.monotonic()
    with pytest.raises(ExchangeError, match="workspace is gone"):
        exchange.wait("act/0/1", 3, timeout=5)
    assert time.monotonic() - started < 1
    with pytest.raises(FileNotFoundError):
        exchange.write("act/0/1", 3, np.zeros((2, 3)))
    assert not os.path.exists(path)
