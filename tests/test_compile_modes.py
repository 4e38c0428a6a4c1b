"""torch.compile's ``mode=`` and ``options=`` with the fxcoalesce backend (issue: they raised
``BackendCompilerFailed: TypeError``). They reach Inductor as with ``backend="inductor"``;
what cannot be honoured is a clear error naming it."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch.testing import FileCheck

import fxcoalesce
from fxcoalesce import Config
from fxcoalesce.apps.launch import init_fake_group


def two_independent(x, w):
    """Two independent sums (bucketed) behind a max: a graph's first all_reduce carries the
    run-time check and joins no bucket."""
    c = funcol.all_reduce(x, "max", dist.group.WORLD)
    a = funcol.all_reduce(x @ w, "sum", dist.group.WORLD)
    b = funcol.all_reduce(x * 2, "sum", dist.group.WORLD)
    return a + b.sum() + c


def compile_and_run(**compile_kwargs):
    init_fake_group(2)
    torch._dynamo.reset()
    fxcoalesce.clear_reports()
    x, w = torch.randn(8, 8), torch.randn(8, 8)
    got = torch.compile(two_independent, fullgraph=True, **compile_kwargs)(x, w)
    torch.testing.assert_close(got, two_independent(x, w))
    (report,) = fxcoalesce.reports()
    return report


@pytest.mark.parametrize("mode", ["default", "reduce-overhead", "max-autotune-no-cudagraphs"])
def test_string_backend_accepts_modes(mode):
    report = compile_and_run(backend="fxcoalesce", mode=mode)
    # the pass still ran under the mode
    assert (report.all_reduce["before"], report.all_reduce["after"]) == (3, 2)


def test_string_backend_accepts_options():
    report = compile_and_run(backend="fxcoalesce", options={"epilogue_fusion": False})
    assert report.all_reduce["after"] == 2


def test_backend_factory_takes_mode_from_torch_compile_and_itself():
    compile_and_run(backend=fxcoalesce.backend(Config()), mode="reduce-overhead")
    compile_and_run(backend=fxcoalesce.backend(Config(), options={"epilogue_fusion": False}))


def test_options_reach_inductor():
    """An option that changes the generated code shows up in it."""
    from torch._inductor.utils import run_and_get_code

    init_fake_group(2)
    torch._dynamo.reset()
    x, w = torch.randn(8, 8), torch.randn(8, 8)
    codes = {}
    for simdlen in (None, 1):  # 1: no SIMD in the C++ kernels
        torch._dynamo.reset()
        fn = torch.compile(two_independent, backend=fxcoalesce.backend(
            Config(), options={"cpp.simdlen": simdlen}), fullgraph=True)
        _, (codes[simdlen],) = run_and_get_code(fn, x, w)
    FileCheck().check("Vectorized").run(codes[None])      # SIMD kernels by default
    FileCheck().check_not("Vectorized").run(codes[1])     # none with simdlen=1


@pytest.mark.parametrize("kwargs, message", [
    ({"mode": "bogus"}, "bogus"),                                     # unknown mode
    ({"options": {"no_such_option": 1}}, "no_such_option"),           # unknown option
])
def test_unusable_mode_or_option_is_named(kwargs, message):
    with pytest.raises(Exception, match=message):
        compile_and_run(backend="fxcoalesce", **kwargs)
    with pytest.raises(ValueError, match=message):  # the factory fails at once
        fxcoalesce.backend(Config(), **kwargs)


def test_eager_codegen_cannot_honour_a_mode():
    with pytest.raises(ValueError, match="codegen='eager'.*reduce-overhead"):
        fxcoalesce.backend(Config(codegen="eager"), mode="reduce-overhead")


def test_compile_caches_forced_on_by_environment_do_not_skip_the_passes(tmp_path):
    """TORCHINDUCTOR_AUTOGRAD_CACHE=1 overrides a config patch: AOTAutograd's cache served
    plain Inductor's code for the same graph to the fxcoalesce backend, the passes never ran
    (found through `gpu_bench.sh`, which sets it). Env vars are read at import: a subprocess."""
    import os
    import subprocess
    import sys

    script = """
import torch, fxcoalesce
from tests.test_compile_modes import two_independent
from fxcoalesce.apps.launch import init_fake_group
init_fake_group(2)
x, w = torch.randn(8, 8), torch.randn(8, 8)
torch.compile(two_independent, fullgraph=True)(x, w)   # plain Inductor fills the caches
torch._dynamo.reset()
torch.compile(two_independent, fullgraph=True, backend="fxcoalesce")(x, w)
(report,) = fxcoalesce.reports()
print("after", report.all_reduce["after"])
"""
    env = {**os.environ, "TORCHINDUCTOR_AUTOGRAD_CACHE": "1", "TORCHINDUCTOR_FX_GRAPH_CACHE": "1",
           "TORCHINDUCTOR_CACHE_DIR": str(tmp_path)}
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    done = subprocess.run([sys.executable, "-c", script], env=env, cwd=root,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "after 2" in done.stdout


def test_keep_mutation_renames_patches_inductor_only_inside_and_only_before_2_15():
    """fxcoalesce's backport of pytorch#185873 (torch_releases.keep_mutation_renames) wraps
    ``SchedulerNode.recompute_size_and_body`` while a graph compiles, on torch < 2.15 only,
    and puts Inductor's own back after (the TP-2 speculative step's canary, slow:
    tests/test_eagle3_static.py::test_compiled_step_tp2_hidden_matches_eager)."""
    from torch._inductor.scheduler import SchedulerNode

    from fxcoalesce.torch_releases import (MUTATION_RENAMES_KEPT_FROM, keep_mutation_renames,
                                           torch_version)

    before = SchedulerNode.recompute_size_and_body
    with keep_mutation_renames():
        inside = SchedulerNode.recompute_size_and_body
    assert SchedulerNode.recompute_size_and_body is before
    assert (inside is not before) == (torch_version() < MUTATION_RENAMES_KEPT_FROM)
