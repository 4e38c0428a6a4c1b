"""Tier 1: the run-time tags (``passes.tag``) and the per-call wrapper (``runtime``), on
hand-built graphs run by ``simulate`` (ranks in one process) and on one gloo rank.

A graph in the program's own order tags every all_reduce; a rewritten graph tags its first,
and its second collective reads that check. A peer that runs another graph at the same
point pairs tag with tag: every rank of the pairing stops on its check, before any value
of that pairing is returned.
"""

from __future__ import annotations

import itertools

import pytest
import torch
from graphs import GraphBuilder
from simulate import assert_loud, simulate

import fxcoalesce
from fxcoalesce import Config, run_pipeline
from fxcoalesce.passes.tag import (CHECKED, MESSAGE_START, PROGRAM_TAG, compatible, expected,
                                   message, rewrite_tag, tag_pass)
from fxcoalesce.pipeline import copy_graph_module
from fxcoalesce.rank_check import CollectiveMismatchError

aten = torch.ops.aten
WORLD = 2


def pair_program():
    """AR(x * 2) and AR(y * 3), their sum returned: the program's own order."""
    b = GraphBuilder()
    x, y = b.input("x", (2, 4), torch.float64), b.input("y", (2, 4), torch.float64)
    a = b.all_reduce(b.call(aten.mul.Tensor, x, 2.0))
    c = b.all_reduce(b.call(aten.mul.Tensor, y, 3.0))
    return b.build(b.add(a, c))


def summed():
    """The rewrite: AR(x * 2 + y * 3), one all_reduce of the same size as each."""
    b = GraphBuilder()
    x, y = b.input("x", (2, 4), torch.float64), b.input("y", (2, 4), torch.float64)
    s = b.add(b.call(aten.mul.Tensor, x, 2.0), b.call(aten.mul.Tensor, y, 3.0))
    return b.build(b.all_reduce(s))


def tagged(gm, rewritten: bool, digest: str = "d"):
    out = copy_graph_module(gm)
    lines = tag_pass(out, rewritten=rewritten, world=lambda n: WORLD, key="k", digest=digest,
                     where="test")
    return out, lines


def inputs():
    return [[torch.full((2, 4), float(r + 1), dtype=torch.float64),
             torch.full((2, 4), float(r + 2), dtype=torch.float64)] for r in range(WORLD)]


def test_program_order_tags_every_all_reduce_and_keeps_values():
    gm = pair_program()
    out, lines = tagged(gm, rewritten=False)
    assert [line.split(":")[1].strip() for line in lines] == ["tag 1, sum"] * 2
    ars = [n for n in out.graph.nodes if n.meta.get(CHECKED) is not None]
    # each carries one element more: the tag
    assert [tuple(n.meta["val"].shape) for n in ars] == [(9,), (9,)]
    want, got = simulate([gm] * WORLD, inputs()), simulate([out] * WORLD, inputs())
    assert not got.raised
    for w, g in zip(want.outputs, got.outputs, strict=True):
        assert all(torch.equal(a, b) for a, b in zip(w, g, strict=True))


def test_a_rewrite_tags_its_first_all_reduce_and_orders_the_second_after_its_check():
    b = GraphBuilder()
    x, y = b.input("x", (2, 4), torch.float64), b.input("y", (2, 4), torch.float64)
    first = b.collective(x)  # issued first, waited late: the second is in flight meanwhile
    second = b.all_reduce(y)
    out, lines = tagged(b.build(b.add(b.wait(first), second)), rewritten=True)
    assert len(lines) == 2 and all("tag 1," not in line for line in lines)  # not the program's
    order = list(out.graph.nodes)
    [after] = [n for n in order if n.target is torch.ops.fxcoalesce.tag_after.default]
    waits = [n for n in order if "wait_tensor" in str(n.target)]
    # the second all_reduce's tag is made only once the first tag checked out
    assert order.index(waits[0]) < order.index(after)
    ars = [n for n in order if n.meta.get(CHECKED) is not None]
    assert order.index(after) < order.index(ars[1])


def test_a_peer_running_another_graph_stops_every_rank_of_the_pairing():
    """Rank 0 re-cut the stretch (the program's own order), rank 1 runs the agreed sum."""
    prog, _ = tagged(pair_program(), rewritten=False)
    rew, _ = tagged(summed(), rewritten=True)
    sim = simulate([prog, rew], inputs())
    assert sorted(sim.raised) == [0, 1] and not any(sim.outputs)
    assert sim.failed == {0: 0, 1: 0}  # the check of the first pairing, on both
    assert_loud(sim)
    # with the same rewrite on both: no check fails, the sum is right
    ok = simulate([rew, rew], inputs())
    assert not ok.raised and torch.equal(ok.outputs[0][0],
                                         simulate([summed()] * 2, inputs()).outputs[0][0])


def test_two_different_rewrites_stop_too():
    a, _ = tagged(summed(), rewritten=True, digest="one")
    b, _ = tagged(summed(), rewritten=True, digest="two")
    sim = simulate([a, b], inputs())
    assert sorted(sim.raised) == [0, 1]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.int32])
@pytest.mark.parametrize("op", ["sum", "avg", "max", "min"])
def test_tags_differ_in_what_they_reduce_to_unless_all_are_equal(dtype, op):
    """The tags a rank can send (the program's, and the rewrites' 2**(c*i)): W of them reduce
    to what W equal ones give only if all are equal, in every tagged dtype, for every rank's
    check, whatever mix of graphs the W ranks run (every mix of up to four tags)."""
    from fxcoalesce.passes.tag import _exponents, spacing, taggable_value

    for world in (2, 3, 4, 8):
        if not taggable_value(op, dtype, world):
            continue
        k = _exponents(dtype, world, op)
        tags = [PROGRAM_TAG] + [float(2 ** (spacing(world) * (1 + i))) for i in range(k)]
        tags = tags[:3] + tags[-2:]  # the smallest and the largest exponents
        for mix in itertools.product(tags, repeat=min(world, 4)):
            sent = list(mix) + [mix[0]] * (world - len(mix))
            if op in ("max", "min"):
                cols = [torch.tensor([t, -t], dtype=dtype) for t in sent]
            else:
                cols = [torch.tensor([t], dtype=dtype) for t in sent]
            red = {"sum": lambda c: sum(c[1:], c[0]), "avg": lambda c: sum(c[1:], c[0]) / world,
                   "max": lambda c: torch.stack(c).amax(0),
                   "min": lambda c: torch.stack(c).amin(0)}[op](cols)
            for t in set(sent):
                want = torch.tensor(expected(op, t, world), dtype=dtype)
                passes = torch.equal(red.to(dtype), want)
                assert passes == (len(set(sent)) == 1), (op, dtype, world, sent, t)


def test_rewrite_tags_are_powers_of_two_other_than_the_programs():
    for i in range(50):
        t = rewrite_tag("key", f"d{i}", torch.bfloat16, 8, "sum")
        e = round(torch.log2(torch.tensor(t)).item())
        assert t != PROGRAM_TAG and t == 2.0 ** e and e % 4 == 0  # c = 4 on 8 ranks


def test_a_rewrite_whose_first_all_reduce_is_a_bucket_is_not_compatible():
    b = GraphBuilder()
    x, y = b.input("x", (2, 4), torch.float64), b.input("y", (2, 4), torch.float64)
    flat = [b.call(aten.reshape.default, v, [-1]) for v in (x, y)]
    bucket = b.build(b.all_reduce(b.call(aten.cat.default, flat)))
    assert "16 elements where the program's has 8" in compatible(pair_program(), bucket)
    assert compatible(pair_program(), summed()) is None


def test_the_first_all_reduce_stays_out_of_buckets_on_a_group_of_several_ranks():
    from fxcoalesce.apps.launch import init_fake_group

    group = init_fake_group(2).group_name
    b = GraphBuilder()
    x, y = b.input("x", (4, 4)), b.input("y", (4, 4))
    gm = b.build(b.all_reduce(x, group), b.all_reduce(y, group))
    out, report = run_pipeline(gm, Config(strict=True, passes=("bucket",)))
    assert report.all_reduce["after"] == 2
    assert any("stays out of its bucket" in w for w in report.warnings)
    assert "first all_reduce kept apart for the run-time check" in report.verdict
    _, report = run_pipeline(gm, Config(strict=True, passes=("bucket",), run_checks=False))
    assert report.all_reduce["after"] == 1


def test_the_message_fits_a_device_assert_and_a_cpp_literal():
    text = message("graph 1234567890 with a long name", "sum", 2.0 ** 60)
    assert text.startswith(MESSAGE_START) and len(text) < 255
    assert '"' not in text and "\\" not in text and "\n" not in text


def test_the_wrapper_names_what_to_do_and_agrees_again_on_a_new_group(monkeypatch):
    from types import SimpleNamespace

    from fxcoalesce import runtime

    def fails(*args):
        raise RuntimeError(message("g", "sum", 1.0))

    job = SimpleNamespace(cfg=Config(), name="g", frame="", cut=None, guards=[])
    with pytest.raises(CollectiveMismatchError, match="reorderable_logging_functions"):
        runtime.Guarded(fails, [], job, None)(1)
    seen = []
    monkeypatch.setattr(runtime.Guarded, "_again", lambda self: seen.append(self.group))
    g = runtime.Guarded(lambda x: x + 1, [], job, None)
    assert g(1) == 2 and not seen  # the same group: nothing but a comparison
    monkeypatch.setattr(runtime, "default_group", lambda: object())
    assert g(1) == 2 and len(seen) == 1  # another group: the ranks agree again first


def test_program_order_eagerly_tags_as_compiled_graphs_do(tmp_path):
    """``runtime.ProgramOrder`` on one gloo rank: the Dynamo graph run with every all_reduce
    tagged: the right values (the tag reduces to 1 on one rank)."""
    import torch.distributed as dist
    import torch.distributed._functional_collectives as funcol

    from fxcoalesce.runtime import ProgramOrder

    if dist.is_initialized():
        dist.destroy_process_group()
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0,
                            world_size=1)
    try:
        def fn(x):
            return funcol.all_reduce(x * 2, "sum", dist.group.WORLD) + 1

        graphs = []
        torch.compile(fn, backend=lambda gm, ex: graphs.append(gm) or gm.forward)(
            torch.ones(3))
        x = torch.arange(3.0)
        out = ProgramOrder(graphs[0], "g")(x)
        out = out[0] if isinstance(out, (tuple, list)) else out
        assert torch.equal(out, x * 2 + 1)
    finally:
        dist.destroy_process_group()
        fxcoalesce.clear_reports()


def test_bad_input_at_the_backend_is_one_clear_line(tmp_path, monkeypatch):
    """Issue 25: each was an AttributeError mid-compile, silently ignored, a
    NotADirectoryError mid-compile, or an IndexError."""
    with pytest.raises(TypeError, match=r"write fxcoalesce.backend\(fxcoalesce.Config\("
                                        r"dump_dir='d'\)\)"):
        fxcoalesce.backend({"dump_dir": "d"})
    with pytest.raises(TypeError, match=r"fxcoalesce.inductor_pass\(\) takes"):
        fxcoalesce.inductor_pass({"dump_dir": "d"})
    monkeypatch.setenv("FXCOALESCE_AGREE_TIMEOUT", "abc")
    with pytest.raises(ValueError, match="FXCOALESCE_AGREE_TIMEOUT='abc' is not a number"):
        fxcoalesce.backend()
    monkeypatch.delenv("FXCOALESCE_AGREE_TIMEOUT")
    afile = tmp_path / "afile"
    afile.write_text("")
    monkeypatch.setenv("FXCOALESCE_DUMP", str(afile))
    with pytest.raises(ValueError, match="names a file, not a directory"):
        fxcoalesce.backend()
    monkeypatch.delenv("FXCOALESCE_DUMP")
    fxcoalesce.clear_reports()
    assert fxcoalesce.reports()[3:] == []  # a slice of none, as for a list
    with pytest.raises(IndexError, match="no fxcoalesce report"):
        fxcoalesce.reports()[-1]


def test_guards_on_torchs_own_settings_are_not_a_rank_difference():
    """torch 2.15 guards on ``torch.compiler.config.compile_on_one_rank`` in a branch one rank
    takes (tests/test_rank_order.py's rank_branch): a process-wide setting, not a value one
    rank changes later, so the ranks did not fall back for it; a user's own values count."""
    from fxcoalesce.exchange import TORCH_OWN

    assert TORCH_OWN.search("G['torch'].compiler.config._config['compile_on_one_rank'].alias")
    assert TORCH_OWN.search("G['__import_torch_dot_distributed_dot__functional_collectives']"
                            ".torch.compiler.config._config['compile_on_one_rank'].default")
    assert TORCH_OWN.search("dict(type(G['torch'].compiler.config._config['compile_on_one_"
                            "rank']).__dict__)['hide']")
    for user in ("L['step']", "G['FLAG']['log']", "G['torchvision_flag']", "G['torch_step']",
                 "L['self'].G['torch_like']"):
        assert not TORCH_OWN.search(user), user


def test_assert_loud_rejects_a_member_that_returned_after_the_failing_pairing():
    """The property's own check has teeth: rank 1 stopped on #1, which rank 0 paired too and
    then returned its step from (a check that should have failed passed): not loud."""
    from simulate import Simulation

    def sim(raised, stuck, ends):
        return Simulation([None] * 2, [None] * 2, raised=raised, stuck=stuck,
                          members=[[0, 1], [0, 1]], ends=ends, failed=raised)

    assert_loud(sim({1: 1}, [0], [[0], []]))  # rank 0 returned before #1, then waits
    assert_loud(sim({1: 1, 0: 0}, [], [[], []]))  # rank 0 stopped first, #1 in flight
    with pytest.raises(AssertionError, match="returned a step after pairing #1"):
        assert_loud(sim({1: 1}, [0], [[1], []]))
    with pytest.raises(AssertionError, match="went on"):
        assert_loud(sim({1: 1}, [], [[0], []]))
