"""Tier 1: the run-time tags (``ranks.tag``) and the per-call wrapper (``ranks.hooks``), on
hand-built graphs run by ``simulate`` (ranks in one process) and on one gloo rank.

A tagged graph (a rewritten one, or a re-cut of a function a rank rewrote) tags its first
all_reduce with its decision's id, and its second collective reads that check. A peer that
runs another tagged graph at the same point pairs tag with tag: every rank of the pairing
stops on its check, before any value of that pairing is returned. Graphs of the program's
own order carry nothing (real ranks: ``tests/test_fuzz_ranks.py``).
"""

from __future__ import annotations

import itertools

import pytest
import torch
from torch.fx import GraphModule
from graphs import GraphBuilder
from simulate import assert_loud, simulate

import fxcoalesce
from fxcoalesce import Config, run_pipeline
from fxcoalesce.checked import checked_firsts
from fxcoalesce.collectives import describe, group_of, is_collective
from fxcoalesce.meta import tensor_val
from fxcoalesce.ranks.tag import MESSAGE_START, TAG_BITS, agrees, bits, message, tag_pass
from fxcoalesce.pipeline import copy_graph_module
from fxcoalesce.errors import CollectiveMismatchError

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


def tagged(gm, tag: int = 7):
    out = copy_graph_module(gm)
    lines = tag_pass(out, tag, world=lambda n: WORLD, where="test")
    return out, lines


def inputs():
    return [[torch.full((2, 4), float(r + 1), dtype=torch.float64),
             torch.full((2, 4), float(r + 2), dtype=torch.float64)] for r in range(WORLD)]


def test_a_tagged_graph_keeps_its_values_and_sends_2k_more_elements():
    """The first all_reduce carries the tag's 2K elements, the second one element made from
    the first's check (issued only after it)."""
    gm = pair_program()
    out, lines = tagged(gm, 7)
    assert [line.split(":")[1].strip() for line in lines] == ["tag 7, sum",
                                                              "issued after the check"]
    ars = [n for n in out.graph.nodes if "all_reduce" in str(n.target)]
    assert [tuple(n.meta["val"].shape) for n in ars] == [(8 + 2 * TAG_BITS,), (9,)]
    want, got = simulate([gm] * WORLD, inputs()), simulate([out] * WORLD, inputs())
    assert not got.raised
    for w, g in zip(want.outputs, got.outputs, strict=True):
        assert all(torch.equal(a, b) for a, b in zip(w, g, strict=True))


def test_a_rewrite_tags_its_first_all_reduce_and_orders_the_second_after_its_check():
    b = GraphBuilder()
    x, y = b.input("x", (2, 4), torch.float64), b.input("y", (2, 4), torch.float64)
    first = b.collective(x)  # issued first, waited late: the second is in flight meanwhile
    second = b.all_reduce(y)
    out, lines = tagged(b.build(b.add(b.wait(first), second)), 3)
    assert len(lines) == 2 and "tag 3," in lines[0] and "after the check" in lines[1]
    order = list(out.graph.nodes)
    [after] = [n for n in order if n.target is torch.ops.fxcoalesce.tag_after.default]
    waits = [n for n in order if "wait_tensor" in str(n.target)]
    # the second all_reduce's tag is made only once the first tag checked out
    assert order.index(waits[0]) < order.index(after)
    ars = [n for n in order if "all_reduce" in str(n.target)]
    assert order.index(after) < order.index(ars[1])


def test_a_peer_running_another_graph_stops_every_rank_of_the_pairing():
    """Rank 0 re-cut the stretch (the program's own order, tagged: it rewrote this function
    before, under another decision), rank 1 runs the agreed sum."""
    prog, _ = tagged(pair_program(), 2)
    rew, _ = tagged(summed(), 1)
    sim = simulate([prog, rew], inputs())
    assert sorted(sim.raised) == [0, 1] and not any(sim.outputs)
    assert sim.failed == {0: 0, 1: 0}  # the check of the first pairing, on both
    assert_loud(sim)
    # with the same rewrite on both: no check fails, the sum is right
    ok = simulate([rew, rew], inputs())
    assert not ok.raised and torch.equal(ok.outputs[0][0],
                                         simulate([summed()] * 2, inputs()).outputs[0][0])


def test_two_different_rewrites_stop_too():
    a, _ = tagged(summed(), 1)
    b, _ = tagged(summed(), 2 ** TAG_BITS - 1)
    sim = simulate([a, b], inputs())
    assert sorted(sim.raised) == [0, 1]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.int32])
@pytest.mark.parametrize("op", ["sum", "avg", "max", "min"])
def test_a_check_passes_on_one_rank_exactly_when_it_passes_on_all(dtype, op):
    """What W ranks' tags reduce to passes a rank's check only if every rank sent the same
    id, in every tagged dtype and op, on groups of 2 to 128, whatever mix of ids they send
    (ids that differ in one bit, in all bits, the smallest and the largest)."""
    if op == "avg" and not dtype.is_floating_point:
        pytest.skip("a mean of integers is not a tagged op")
    ids = [1, 2, 3, 0x5555, 0xAAAA, 2 ** TAG_BITS - 1]
    for world in (2, 3, 4, 8, 128):
        for mix in itertools.product(ids[:4] if world > 4 else ids, repeat=min(world, 3)):
            sent = list(mix) + [mix[-1]] * (world - len(mix))
            cols = torch.stack([torch.tensor(bits(t), dtype=dtype) for t in sent])
            red = {"sum": lambda c: c.sum(0, dtype=dtype), "max": lambda c: c.amax(0),
                   "min": lambda c: c.amin(0),
                   "avg": lambda c: (c.sum(0, dtype=dtype) / world).to(dtype)}[op](cols)
            for t in set(sent):
                assert agrees(red, t) == (len(set(sent)) == 1), (op, dtype, world, sent, t)


def test_tag_ids_are_handed_out_once_even_across_a_new_store():
    import torch.distributed as dist

    from fxcoalesce.ranks.store import RESERVED_ID, Store

    store = dist.HashStore()
    a, b = Store(store, 0, "t"), Store(store, 1, "t")
    got = [x.new_id() for _ in range(50) for x in (a, b)]
    assert len(set(got)) == 100 and min(got) >= 1 and RESERVED_ID not in got
    fresh = Store(dist.HashStore(), 0, "t")
    fresh.floor = max(got)  # a process that took those ids joins a new store
    assert fresh.new_id() > max(got)
    with pytest.raises(ValueError):
        bits(2 ** TAG_BITS)


def first_tagged(gm: GraphModule) -> dict:
    """``checked.checked_firsts`` of ``gm``'s collectives."""
    return checked_firsts([n for n in gm.graph.nodes if is_collective(n)])


def _prefix(gm: GraphModule, first) -> list[str]:
    """The collectives of ``first``'s group before it, described without their origin."""
    out = []
    for n in gm.graph.nodes:
        if n is first:
            return out
        if is_collective(n) and group_of(n) == group_of(first):
            out.append(describe(n).split(" <- ")[0])
    return out


def compatible(program: GraphModule, rewritten: GraphModule) -> str | None:
    """What every pass must keep (``checked.pinned``), so that a rewritten graph's tag pairs
    with the program's own first all_reduce of each group (a rank that re-cuts runs that):
    ``tests/test_property_ranks.py`` asserts it of every ladder step of its programs. Why ``rewritten``'s first all_reduce in some group could not pair, tag for tag, with
    the program's own first all_reduce of that group at that place (None when every group's
    can): another kind, op, dtype or element count, or other collectives of the group before
    it."""
    from torch.fx.experimental.symbolic_shapes import statically_known_true

    firsts_a, firsts_b = first_tagged(program), first_tagged(rewritten)
    for group in sorted(firsts_a.keys() | firsts_b.keys(), key=str):
        a, b = firsts_a.get(group), firsts_b.get(group)
        if a is None or b is None:
            return f"no tagged all_reduce in group {group} where the program has one"
        if _prefix(program, a) != _prefix(rewritten, b):
            return f"other collectives of group {group} before its first tagged all_reduce"
        va, vb = tensor_val(a.args[0]), tensor_val(b.args[0])
        if (str(a.args[1]), va.dtype) != (str(b.args[1]), vb.dtype):
            return f"its first all_reduce in group {group} has another op or dtype"
        if not statically_known_true(va.numel() == vb.numel()):
            return (f"its first all_reduce in group {group} has {vb.numel()} elements where "
                    f"the program's has {va.numel()}")
    return None



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
    text = message("graph 1234567890 with a long name", 2 ** TAG_BITS - 1)
    assert text.startswith(MESSAGE_START) and len(text) < 255
    assert '"' not in text and "\\" not in text and "\n" not in text


def test_the_wrapper_names_what_to_do_and_agrees_again_on_a_new_group(monkeypatch):
    from types import SimpleNamespace

    from fxcoalesce.ranks import hooks as runtime

    def fails(*args):
        raise RuntimeError(message("g", 1))

    job = SimpleNamespace(cfg=Config(), name="g", frame="", cut=None, guards=[])
    with pytest.raises(CollectiveMismatchError, match="reorderable_logging_functions"):
        runtime.Guarded(fails, [], job, None)(1)
    seen = []
    monkeypatch.setattr(runtime.Guarded, "_again", lambda self: seen.append(self.group))
    g = runtime.Guarded(lambda x: x + 1, [], job, None)
    assert g(1) == 2 and not seen  # the same group: nothing but a comparison
    monkeypatch.setattr(runtime, "default_group", lambda: object())
    assert g(1) == 2 and len(seen) == 1  # another group: the ranks agree again first


def test_program_order_runs_the_dynamo_graph_eagerly_untagged(tmp_path):
    """``hooks.ProgramOrder`` on one gloo rank: the Dynamo graph run as it is: the right
    values."""
    import torch.distributed as dist
    import torch.distributed._functional_collectives as funcol

    from fxcoalesce.ranks.hooks import ProgramOrder

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
    from fxcoalesce.ranks.agreement import TORCH_OWN

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


def test_the_error_is_a_plain_exception():
    """Making a ``CollectiveMismatchError`` does nothing but make it: no store, no thread."""
    import threading

    before = threading.active_count()
    e = CollectiveMismatchError("fxcoalesce: rank 0 stopped")
    assert isinstance(e, RuntimeError) and str(e) == "fxcoalesce: rank 0 stopped"
    assert threading.active_count() == before
