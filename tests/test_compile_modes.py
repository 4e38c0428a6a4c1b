"""torch.compile's ``mode=`` and ``options=`` with the fxcoalesce backend (issue: they raised
``BackendCompilerFailed: TypeError``). They reach Inductor as with ``backend="inductor"``;
what cannot be honoured is a clear error naming it."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

import fxcoalesce
from fxcoalesce import Config
from fxcoalesce.apps.launch import init_fake_group


def two_independent(x, w):
    a = funcol.all_reduce(x @ w, "sum", dist.group.WORLD)
    b = funcol.all_reduce(x * 2, "sum", dist.group.WORLD)
    return a + b.sum()


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
    assert (report.all_reduce["before"], report.all_reduce["after"]) == (2, 1)


def test_string_backend_accepts_options():
    report = compile_and_run(backend="fxcoalesce", options={"epilogue_fusion": False})
    assert report.all_reduce["after"] == 1


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
    assert "Vectorized" in codes[None] and "Vectorized" not in codes[1]


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
