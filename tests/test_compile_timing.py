"""``bench.compile_timing``: each variant compiles into an Inductor cache of its own (a
later variant never reuses an earlier one's kernels), and says what that cache did."""

import os

import torch

from fxcoalesce.apps.bench import compile_timing


def test_each_variant_has_a_cache_of_its_own(tmp_path, monkeypatch):
    """Regression: the demo's second variant compiled in a fifth of the first's time, on the
    first's kernels; the figures measured the order (issue 21)."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("TRITON_CACHE_DIR", raising=False)

    def step(x):  # one extern matmul: Inductor caches the graph, no C++ to build (fast)
        return x @ x.t()

    def compile_as(name: str) -> str:
        torch._dynamo.reset()
        with compile_timing.own_cache(name) as info:
            assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(
                tmp_path / "fxcoalesce-variants" / name)
            torch.compile(step, backend="inductor")(torch.ones(5, 3))
        return info["cache"]

    assert compile_as("a") == "cold"
    assert compile_as("b") == "cold"  # the same graph: a's cache does not serve it
    assert compile_as("a") == "warm"  # a's own, from its first compile
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path)  # restored
    assert "TRITON_CACHE_DIR" not in os.environ


def test_cache_state_words():
    assert [compile_timing.cache_state(h, m) for h, m in ((0, 2), (2, 0), (1, 1), (0, 0))] == [
        "cold", "warm", "partly warm", "uncached"]
