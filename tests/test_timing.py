"""apps.bench.timing.timed: the one timer bench and demo share."""

import time

from fxcoalesce.apps.bench.timing import timed


def test_timed_returns_result_and_microseconds_on_cpu():
    out, us = timed(lambda: time.sleep(0.02) or "done", "cpu")
    assert out == "done"
    assert 20_000 <= us < 2_000_000  # microseconds: at least the 20 ms slept
