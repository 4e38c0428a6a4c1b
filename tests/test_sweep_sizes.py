"""benchmarks/sweep_sizes.py's judgement of "faster beyond the noise": a sign test over the
bench's interleaved rounds (each round runs every variant once, so a round's steps share its
load), not p10-p90 ranges, which a shared machine's noise keeps overlapping."""

import importlib.util
from pathlib import Path

spec = importlib.util.spec_from_file_location(
    "sweep_sizes", Path(__file__).parent.parent / "benchmarks" / "sweep_sizes.py")
sweep = importlib.util.module_from_spec(spec)
spec.loader.exec_module(sweep)


def variant(steps):
    s = sorted(steps)
    return {"steps_ms": steps, "median_ms": s[len(s) // 2], "p10_ms": s[1], "p90_ms": s[-2]}


def test_faster_in_13_of_15_rounds_is_beyond_the_noise_12_is_not():
    slow = [100.0 + 30 * (i % 3) for i in range(15)]  # noisy: ranges overlap
    wins13 = [x - 5 if i < 13 else x + 5 for i, x in enumerate(slow)]
    wins12 = [x - 5 if i < 12 else x + 5 for i, x in enumerate(slow)]
    a13, a12, b = variant(wins13), variant(wins12), variant(slow)
    assert not a13["p90_ms"] < b["p10_ms"]  # the spread test would say nothing
    assert sweep.faster(a13, b) and not sweep.faster(b, a13)
    assert not sweep.faster(a12, b)  # p = 0.018
    assert sweep.paired(a13, b) == (5.0, 13, 15)


def test_without_kept_steps_the_spread_decides():
    a = {"median_ms": 1.0, "p10_ms": 0.9, "p90_ms": 1.1}
    b = {"median_ms": 2.0, "p10_ms": 1.5, "p90_ms": 2.5}
    assert sweep.faster(a, b) and not sweep.faster(b, a)
