"""fxcoalesce's Inductor pass beside another library's (torchao, vLLM register theirs too).

Inductor runs its post-grad passes here directly (``post_grad_passes`` on a hand-built ATen
graph): the same custom-pass hooks a compile calls, without code generation.

- Torch 2.15's custom-pass options take a list of passes: fxcoalesce's and another, in
  either order, both run, in that order; the backend's keyed pre-pass runs every pass the
  user's option holds.
- ``torch._inductor.custom_graph_pass.custom_pass_context`` (pytorch#184019, closed
  unmerged in May 2026; a form of it is on PyTorch's main branch, in no release up to 2.15.0)
  raises where a legacy option (``config.post_grad_custom_post_pass = ...``) is set beside
  it. fxcoalesce's pass registered through the context works beside another in both orders,
  and the backend's pre-pass runs the context's passes once. Skipped on a torch without it.
"""

from __future__ import annotations

import pytest
import torch
from graphs import GraphBuilder
from torch._inductor import config
from torch._inductor.custom_graph_pass import CustomGraphPass
from torch._inductor.fx_passes.post_grad import post_grad_passes
from torch._inductor.virtualized import V

import fxcoalesce
from fxcoalesce.collectives import is_all_reduce
from fxcoalesce.compile_cache import KeyedPass
from fxcoalesce.torch_releases import torch_version

custom_graph_pass = torch._inductor.custom_graph_pass
LISTS = torch_version() >= (2, 15)
needs_lists = pytest.mark.skipif(not LISTS, reason=f"torch {torch.__version__}'s custom-pass "
                                 "options take one pass, not a list (2.15 on)")
needs_context = pytest.mark.skipif(
    not hasattr(custom_graph_pass, "custom_pass_context"),
    reason=f"torch {torch.__version__} has no torch._inductor.custom_graph_pass."
           "custom_pass_context (none up to 2.15.0)")


def count(graph) -> int:
    """all_reduces, in place or not (Inductor's post-grad passes make them in place)."""
    return sum(is_all_reduce(n) for n in graph.nodes)


class Other(CustomGraphPass):
    """Another library's pass: it rewrites nothing and notes the all_reduces it saw."""

    def __init__(self, uuid: str | None = "other-pass"):
        self.seen: list[int] = []
        self._uuid = uuid

    def __call__(self, graph) -> None:
        self.seen.append(count(graph))

    def uuid(self):
        return self._uuid


def summed_pair():
    """Two all_reduces summed: fxcoalesce's pass makes them one."""
    b = GraphBuilder()
    x, y = b.input("x", (4, 8)), b.input("y", (4, 8))
    return b, b.build(b.add(b.all_reduce(b.add(x, x)), b.all_reduce(b.add(y, y))))


def post_grad(**patches) -> tuple[int, list]:
    """Inductor's post-grad passes over :func:`summed_pair` with ``patches``: (all_reduces
    after, fxcoalesce's reports)."""
    b, gm = summed_pair()
    fxcoalesce.clear_reports()
    with config.patch(patches), V.set_fake_mode(b.mode):
        post_grad_passes(gm, True)
    return count(gm.graph), fxcoalesce.reports()


def test_the_keyed_pre_pass_runs_every_pass_the_option_holds():
    first, second = Other("a"), Other("b")
    _, gm = summed_pair()
    KeyedPass([first, second], "k")(gm.graph)
    assert first.seen == second.seen == [2]
    assert KeyedPass([first, second], "k").uuid() == "fxcoalesce-k-('a', 'b')"
    assert KeyedPass(first, "k").uuid() == "fxcoalesce-k-a"
    assert KeyedPass([first, Other(None)], "k").uuid() is None  # one uncacheable: none cached
    assert KeyedPass(None, "k").uuid() == "fxcoalesce-k-None"


@needs_lists
@pytest.mark.parametrize("fx_first", [True, False])
def test_beside_another_post_grad_pass_in_a_list(fx_first):
    other = Other()
    passes = [fxcoalesce.inductor_pass(), other]
    after, reports = post_grad(post_grad_custom_post_pass=passes if fx_first else passes[::-1])
    assert after == 1 and reports[-1].all_reduce["after"] == 1
    assert other.seen == ([1] if fx_first else [2])  # it ran after fxcoalesce's, or before


@needs_context
@pytest.mark.parametrize("fx_first", [True, False])
def test_beside_custom_pass_context_in_both_orders(fx_first):
    context = custom_graph_pass.custom_pass_context
    fx, other = fxcoalesce.inductor_pass(), Other()
    # one context holding both, in either order
    with context(post_grad_post_passes=[fx, other] if fx_first else [other, fx]):
        after, reports = post_grad()
    assert after == 1 and reports[-1].all_reduce["after"] == 1 and len(other.seen) == 1
    # nested: one library's context inside the other's
    other.seen.clear()
    outer, inner = (fx, other) if fx_first else (other, fx)
    with context(post_grad_post_passes=[outer]), context(post_grad_post_passes=[inner]):
        after, reports = post_grad()
    assert after == 1 and reports[-1].all_reduce["after"] == 1 and len(other.seen) == 1
    # the legacy option beside the context: torch refuses the mix (set it through the context)
    with config.patch(post_grad_custom_post_pass=fx), pytest.raises(RuntimeError,
                                                                    match="custom_pass_context"):
        with context(post_grad_post_passes=[other]):
            pass


@needs_context
def test_the_backend_runs_a_context_pre_pass_once():
    """The backend wraps the user's post_grad_custom_pre_pass (here the context's) in its keyed
    pass and patches it in (graph_compile); the context's pass runs once, not again through
    the context's own hook."""
    context = custom_graph_pass.custom_pass_context
    other = Other()
    with context(post_grad_pre_passes=[other]):
        keyed = KeyedPass(config.post_grad_custom_pre_pass, "k")
        post_grad(post_grad_custom_pre_pass=keyed)
        assert other.seen == [2]
        patched = getattr(custom_graph_pass,
                          "patched_inductor_config_with_custom_pass_context", None)
        if patched is not None:  # where compile_fx routes config_patches through the context
            other.seen.clear()
            b, gm = summed_pair()
            with patched({"post_grad_custom_pre_pass": keyed}), V.set_fake_mode(b.mode):
                post_grad_passes(gm, True)
            assert other.seen == [2]
