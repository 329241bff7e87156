"""``benchmarks/async_scheduling.py``'s GPU idle arithmetic (the runs themselves need a GPU)."""

import pytest

from benchmarks.async_scheduling import busy_fraction, largest_gaps_idle


def test_idle_between_steps_from_the_largest_gaps():
    # three steps: kernels with short gaps inside a step (0.1), longer ones between steps (2 and 3)
    intervals = [(0, 1), (1.1, 2), (1.5, 1.8), (4, 5), (5.1, 6), (9, 10)]
    assert busy_fraction(intervals) == pytest.approx((4.8, 10))
    assert largest_gaps_idle(intervals, steps=3) == pytest.approx((5, 10))
    assert largest_gaps_idle(intervals, steps=2) == pytest.approx((3, 10))
    assert largest_gaps_idle(intervals, steps=1) == (0.0, 10)
    assert largest_gaps_idle([], steps=3) == (0.0, 0.0)
