"""``fxcoalesce bench`` with one more variant: fxcoalesce with ``Config(run_checks=False)``
(no run-time check: no tag, no gate), beside the hand-merged model and fxcoalesce as it comes,
in one run on the same ranks, weights and rounds.

    python benchmarks/bench_checks.py [fxcoalesce bench arguments] \\
        --variants hand-merged,fxcoalesce,fxcoalesce-no-reorder

On torch < 2.14 the bench's ``fxcoalesce-no-reorder`` variant is skipped (nothing to turn
off); this script lends its slot to the checks-off variant: where bench prints
``fxcoalesce-no-reorder``, read ``fxcoalesce, run_checks=False`` (its report's bytes carry no
check). On torch 2.14+ the slot stays what it is and this script refuses to run. The patches
sit at module level, so the rank processes (spawned: they import this file again) get them.
"""

from __future__ import annotations

import sys

import torch

import fxcoalesce.compiler
from fxcoalesce.apps.bench import run as bench_run
from fxcoalesce.apps.bench import variants
from fxcoalesce.config import Config

SLOT = "fxcoalesce-no-reorder"
_original_tiers, _original_compile = variants.option_tiers, variants.compile_variant
_original_backend = fxcoalesce.compiler.backend
_checks_off = [False]


def _tiers(name, device, cudagraphs):
    return _original_tiers("fxcoalesce" if name == SLOT else name, device, cudagraphs)


def _backend(config=None, **kwargs):
    if _checks_off[0]:
        config = Config(run_checks=False)
    return _original_backend(config, **kwargs)


def _compile(name, fn, label, **kwargs):
    _checks_off[0] = name == SLOT
    try:
        return _original_compile(SLOT if name == SLOT else name, fn, label, **kwargs)
    finally:
        _checks_off[0] = False


if tuple(int(x) for x in torch.__version__.split(".")[:2]) < (2, 14):
    variants.option_tiers = bench_run.option_tiers = _tiers
    variants.compile_variant = bench_run.compile_variant = _compile
    fxcoalesce.compiler.backend = _backend


if __name__ == "__main__":
    if variants.option_tiers is not _tiers:
        sys.exit(f"torch {torch.__version__}: {SLOT} is a variant of its own here")
    from fxcoalesce.apps.cli import main

    sys.exit(main(["bench", *sys.argv[1:]]))
