"""Keep what a failing property run found: its example and the seed it drew from.

The slow runs draw fresh examples each time; a failure seen once and not kept cannot be
explained later. ``seed_for(name)`` fixes the run's seed (``FXCOALESCE_PROPERTY_SEED``, else a
new one, printed), and ``recorded(name, case, check)`` writes the failing example, the seed
and the error to ``property-failures/<name>.<seed>.txt`` (under the checkout, or
``FXCOALESCE_PROPERTY_FAILURES``) before re-raising: hypothesis replays the shrunk example
last, so the file ends up holding that one.

    FXCOALESCE_PROPERTY_SEED=1234 pytest -m slow tests/test_property_ranks.py -k 10k
"""

from __future__ import annotations

import os
import random
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def seed_for(name: str) -> int:
    value = os.environ.get("FXCOALESCE_PROPERTY_SEED")
    seed = int(value) if value else random.SystemRandom().randrange(2**32)
    print(f"{name}: hypothesis seed {seed} (FXCOALESCE_PROPERTY_SEED={seed} replays it)")
    return seed


def examples_for(default: int) -> int:
    """How many examples a slow run draws: ``FXCOALESCE_PROPERTY_EXAMPLES``, else
    ``default`` (``tests/property_shards.py`` splits one 10k run into shards of fresh seeds)."""
    value = os.environ.get("FXCOALESCE_PROPERTY_EXAMPLES")
    return int(value) if value else default


def failures_dir() -> Path:
    return Path(os.environ.get("FXCOALESCE_PROPERTY_FAILURES", ROOT / "property-failures"))


def recorded(name: str, seed: int, case, check) -> None:
    """``check(case)``; on failure, write the case, the seed and the traceback first."""
    try:
        check(case)
    except BaseException:
        out = failures_dir()
        out.mkdir(parents=True, exist_ok=True)
        (out / f"{name}.{seed}.txt").write_text(
            f"seed: {seed} (FXCOALESCE_PROPERTY_SEED={seed})\n\ncase:\n{case!r}\n\n"
            f"error:\n{traceback.format_exc()}")
        raise
