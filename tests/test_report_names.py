"""Reports in the user's terms: each all_reduce named by the module that issued it (its
``nn_module_stack``), FX names beside it; "bucketed" only for a concatenation, "summed" for a
linearity sum; the group's own all_reduce named by its backend. Hand-built nodes first, then
small modules compiled through the backend on a fake group of 2."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from graphs import GraphBuilder, diamond

import fxcoalesce
from fxcoalesce import Config, run_pipeline
from fxcoalesce.apps.launch import init_fake_group
from fxcoalesce.meta import module_path, user_frame
from fxcoalesce.report import Report, originals, with_origins

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.parametrize("written, path", [
    ("L['self'].blocks.0.attn", "blocks.0.attn"),
    ("L['self']._modules['blocks']._modules['0'].attn", "blocks.0.attn"),
    ("getattr(L['self'].blocks, '0').mlp", "blocks.0.mlp"),
    ("G['model'].model.layers.3.self_attn.o_proj", "model.layers.3.self_attn.o_proj"),
    ("L__self___blocks_0", "blocks_0"),  # the identifier form: dynamo's root prefix only
    ("L['self']", ""),  # the compiled root itself: no module below it
])
def test_module_path_of_a_collective_reads_up_its_input_chain(written, path):
    b = GraphBuilder()
    x, w = b.input("x"), b.input("w")
    mm = b.mm(x, w)
    wait = b.all_reduce(b.add(mm, x))
    b.build(wait)
    collective = wait.args[0]
    assert module_path(collective) == ""  # no stack anywhere up its inputs yet
    # the stack sits two nodes up (mm -> add -> all_reduce), as for a collective made
    # outside any module; the innermost entry is the path
    mm.meta["nn_module_stack"] = {"a": ("L['self']", torch.nn.Module), "b": (written, object)}
    assert module_path(collective) == path
    collective.meta["nn_module_stack"] = {"c": ("L['self'].own", object)}
    assert module_path(collective) == "own"  # its own stack first


TORCH_FILE = f"{torch.__path__[0]}/distributed/_functional_collectives.py"


def test_user_frame_is_the_innermost_frame_outside_torch():
    trace = (f'  File "/home/me/model.py", line 12, in forward\n'
             f'    return funcol.all_reduce(self.proj(x), "sum", group)\n'
             f'           ^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^\n'
             f'  File "{TORCH_FILE}", line 179, in all_reduce\n'
             f'    tensor = torch.ops._c10d_functional.all_reduce(\n')
    assert user_frame(trace) == ("/home/me/model.py", "12", "forward",
                                 'return funcol.all_reduce(self.proj(x), "sum", group)')
    only_torch = f'  File "{TORCH_FILE}", line 179, in all_reduce\n    tensor = 1\n'
    assert user_frame(only_torch) is None and user_frame(None) is None


def test_a_chain_of_passes_leads_back_to_the_programs_all_reduces():
    """A bucket of a sliced all_reduce and another: its members are FX names of the graph
    between passes; the report names the program's all_reduces behind them."""
    buckets = [{"members": ["all_reduce_3"], "collective": "all_reduce_default", "kind": "slice"},
               {"members": ["all_reduce_default", "all_reduce_4"], "collective":
                "all_reduce_default_1", "kind": "cat"}]
    behind = originals(buckets)
    assert behind == {"all_reduce_default": ["all_reduce_3"],
                      "all_reduce_default_1": ["all_reduce_3", "all_reduce_4"]}
    modules = {"all_reduce_3": "lm_head", "all_reduce_4": ""}
    assert with_origins(buckets[1], behind, modules) == {
        **buckets[1], "originals": ["all_reduce_3", "all_reduce_4"],
        "modules": ["lm_head", ""]}


def _report(buckets, decisions=()) -> Report:
    return Report(graph="graph 7", world_size=2, verdict="reached the lower bound",
                  all_reduce={"before": 4, "after": 2, "lower_bound": 2, "left_alone": 0,
                              "bytes_before": 512, "bytes_after": 384},
                  buckets=list(buckets), decisions=list(decisions))


def test_summary_says_bucketed_only_for_a_concatenation():
    cat = {"members": ["ar", "ar_1"], "collective": "ar_d", "kind": "cat",
           "originals": ["ar", "ar_1"], "modules": ["moe.shared", "moe.routed"]}
    summed = {"members": ["ar_2", "ar_3"], "collective": "ar_d_1", "kind": "sum",
              "originals": ["ar_2", "ar_3"], "modules": ["", ""]}  # no module known
    apart = {"pass": "bucket", "members": ["ar_4", "ar_5"], "chose": "separate",
             "predicted_exposed_us": {"chosen": 3.0, "merged": 9.5, "separate": 3.0},
             "originals": ["ar_4", "ar_5"], "modules": ["blocks.1.attn", "blocks.1.mlp"]}
    merged = {**apart, "chose": "merge all"}  # told by its bucket's line already
    assert _report([cat, summed], [apart, merged]).summary().splitlines() == [
        "fxcoalesce[graph 7]: all_reduce 4 -> 2 launches (lower bound 2), 512 -> 384 bytes, "
        "1 bucketed, 1 summed; reached the lower bound",
        "  moe.shared + moe.routed -> one all_reduce, bucketed  [ar + ar_1 -> ar_d]",
        "  ar_2 + ar_3 -> one all_reduce, summed  [ar_d_1]",
        "  blocks.1.attn + blocks.1.mlp: kept separate, predicted exposed 3.0 µs apart vs 9.5 "
        "µs merged  [ar_4 + ar_5]"]


def test_summary_of_a_large_graph_stays_short():
    buckets = [{"members": [f"a{i}", f"b{i}"], "collective": f"c{i}", "kind": "sum",
                "originals": [f"a{i}", f"b{i}"], "modules": [f"l.{i}.attn", f"l.{i}.mlp"]}
               for i in range(30)]
    lines = _report(buckets).summary().splitlines()
    assert len(lines) == 1 + 12 and lines[-1] == "  ... 19 more (report.to_json())"
    assert lines[1] == "  l.0.attn + l.0.mlp -> one all_reduce, summed  [a0 + b0 -> c0]"


@pytest.fixture
def gloo_group():
    """A real gloo group of one rank in this process (a graph's group "0" resolves to it)."""
    if dist.is_initialized():
        dist.destroy_process_group()
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_a_gloo_group_runs_its_own_all_reduce_not_nccl(gloo_group):
    _, report = run_pipeline(diamond(), Config(strict=True))
    assert report.backend == "gloo"
    lowered = [d for d in report.to_dict()["decisions"] if d["pass"] == "lower"]
    assert lowered and all(d["chose"] == "gloo all_reduce" for d in lowered)
    assert all(list(d["predicted_exposed_us"]) == ["gloo all_reduce"] for d in lowered)
    assert "\"nccl\"" not in report.to_json()  # (nccl_symm is named where ruled out)


def test_without_a_group_the_default_stays_nccl():
    if dist.is_initialized():
        dist.destroy_process_group()
    _, report = run_pipeline(diamond(), Config(strict=True))
    assert report.backend is None
    assert {d["chose"] for d in report.decisions if d["pass"] == "lower"} == {"nccl"}


class Half(torch.nn.Module):
    """A row-parallel linear: its partial sum all_reduced where the module returns it."""

    def __init__(self, group):
        super().__init__()
        self.proj, self.group = torch.nn.Linear(8, 8), group

    def forward(self, x):
        return funcol.all_reduce(self.proj(x), "sum", self.group)


class Block(torch.nn.Module):
    """Attention and MLP in parallel (GPT-J, Falcon): two independent all_reduces."""

    def __init__(self, group):
        super().__init__()
        self.attn, self.mlp = Half(group), Half(group)

    def forward(self, x):
        return x + self.attn(x) + self.mlp(x)


class Parallel(torch.nn.Module):
    def __init__(self, group, layers=2):
        super().__init__()
        self.blocks = torch.nn.ModuleList(Block(group) for _ in range(layers))

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x


def _compiled_report(model, cfg: Config) -> Report:
    fxcoalesce.clear_reports()
    torch._dynamo.reset()
    with torch.no_grad():
        torch.compile(model, backend=fxcoalesce.backend(cfg), fullgraph=True)(torch.ones(4, 8))
    (report,) = fxcoalesce.reports()
    return report


@pytest.mark.parametrize("passes, kind, word", [
    (("linearity",), "sum", "summed"),  # x + AR(a) + AR(b): one all_reduce of a + b
    (("bucket",), "cat", "bucketed"),  # the same pair concatenated instead
])
def test_a_compiled_modules_merges_are_named_by_module_path(passes, kind, word):
    report = _compiled_report(Parallel(init_fake_group(2)),
                              Config(passes=passes, codegen="eager", strict=True,
                                     run_checks=False))  # no pinned first all_reduce
    assert [(b["kind"], b["modules"]) for b in report.buckets] == [
        (kind, ["blocks.0.attn", "blocks.0.mlp"]), (kind, ["blocks.1.attn", "blocks.1.mlp"])]
    lines = report.summary().splitlines()
    assert lines[0].endswith(f"512 -> {512 if kind == 'cat' else 256} bytes, 2 {word}; "
                             "reached the lower bound")
    for i, (b, line) in enumerate(zip(report.buckets, lines[1:])):
        fx = f"{' + '.join(b['members'])} -> {b['collective']}"
        assert line == f"  blocks.{i}.attn + blocks.{i}.mlp -> one all_reduce, {word}  [{fx}]"
    # every decision names the module of each all_reduce it weighed; so does to_dict()
    data = report.to_dict()
    assert data["modules"] == {f"all_reduce{s}": f"blocks.{i // 2}.{('attn', 'mlp')[i % 2]}"
                               for i, s in enumerate(("", "_1", "_2", "_3"))}
    assert [d["modules"] for d in data["decisions"]] == [b["modules"] for b in data["buckets"]]


class RowParallel(torch.nn.Linear):
    """Like transformers' ``o_proj`` / ``down_proj`` under a TP plan without grad: an
    in-place ``dist.all_reduce`` of the output, in a forward hook."""

    def __init__(self):
        super().__init__(8, 8)
        self.register_forward_hook(lambda mod, args, out: dist.all_reduce(out) or out)


class HFLayer(torch.nn.Module):
    """A Cohere-style decoder layer: attention and MLP read the same normed input."""

    def __init__(self):
        super().__init__()
        self.self_attn, self.mlp = torch.nn.Module(), torch.nn.Module()
        self.self_attn.o_proj, self.mlp.down_proj = RowParallel(), RowParallel()

    def forward(self, x):
        return x + self.self_attn.o_proj(x) + self.mlp.down_proj(x)


class HFModel(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.model = torch.nn.Module()
        self.model.layers = torch.nn.ModuleList([HFLayer()])

    def forward(self, x):
        return self.model.layers[0](x)


def test_transformers_like_names_and_an_in_place_all_reduce():
    init_fake_group(2)
    report = _compiled_report(HFModel(), Config(codegen="eager", strict=True))
    (bucket,) = report.buckets
    assert bucket["modules"] == ["model.layers.0.self_attn.o_proj", "model.layers.0.mlp.down_proj"]
    assert report.summary().splitlines()[1].startswith(
        "  model.layers.0.self_attn.o_proj + model.layers.0.mlp.down_proj -> one all_reduce, "
        "summed  [")


class Mlp(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.up, self.down = torch.nn.Linear(8, 16), torch.nn.Linear(16, 8)

    def forward(self, x):
        return self.down(torch.relu(self.up(x)))


class DenseBlock(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.attn, self.mlp = Mlp(), Mlp()

    def forward(self, x):
        return x + self.attn(x) + self.mlp(x)


def test_parallelize_modules_all_reduce_made_inside_torch_is_named_by_its_module():
    """torch's own TP (``parallelize_module``): the all_reduce is made in DTensor's
    redistribute, inside an output hook of the row-parallel linear: named by that linear."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel,
                                                   parallelize_module)

    init_fake_group(2)
    plan = {f"{p}.{half}": style for p in ("attn", "mlp")
            for half, style in (("up", ColwiseParallel()), ("down", RowwiseParallel()))}
    model = parallelize_module(DenseBlock(), init_device_mesh("cpu", (2,)), plan)
    report = _compiled_report(model, Config(codegen="eager", strict=True))
    assert [b["modules"] for b in report.buckets] == [["attn.down", "mlp.down"]]
