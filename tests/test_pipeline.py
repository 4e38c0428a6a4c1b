"""Tier 1: pipeline fallback, config, the Inductor custom pass, determinism, reports."""

from __future__ import annotations

import dataclasses
import importlib
import json
import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from graphs import all_reduces, diamond, real_inputs, run
from torch.testing import FileCheck

import fxcoalesce
from fxcoalesce import Config, CostModel, inductor_pass, run_pipeline
from fxcoalesce.compiler import source_files, source_fingerprint
from fxcoalesce.passes import PASSES
from fxcoalesce.viz.draw import renderer

TESTS = Path(__file__).parent
DUMPED = sorted(["after.txt", "before.txt", "collectives.dot", "report.json",
                 *(["collectives.png"] if renderer() else [])])
"""What a dump directory holds: the graphs, the report, the collectives picture (its PNG when
Graphviz or matplotlib can draw it)."""
compile_cache = importlib.import_module("fxcoalesce.compile_cache")



def boom(gm, *, cfg, pinned=frozenset()):
    raise RuntimeError("boom in bucket")


def test_failing_pass_falls_back(monkeypatch, caplog):
    monkeypatch.setitem(PASSES, "bucket", boom)
    gm = diamond()
    code = gm.code
    with caplog.at_level(logging.WARNING, logger="fxcoalesce"):
        out, report = run_pipeline(gm, Config())
    # the very module that came in, untouched
    assert out is gm and gm.code == code
    assert report.fell_back
    assert report.all_reduce["after"] == 4
    # the report and the log both name the pass and the exception
    assert any("pass 'bucket' failed" in w and "RuntimeError: boom in bucket" in w
               for w in report.warnings)
    assert any("pass 'bucket' failed" in r.getMessage() and "boom in bucket" in r.getMessage()
               for r in caplog.records)


def test_a_rank_that_fell_back_compares_equal_to_one_that_kept_its_program(monkeypatch):
    """Ranks compare what the pipeline left: a rank whose pass failed (the unmodified graph)
    and a rank that ran no pass (the program, numbered) must describe the same sequence."""
    from fxcoalesce.collectives import sequence_after

    gm = diamond()
    kept, kept_report = run_pipeline(gm, Config(passes=()))
    monkeypatch.setitem(PASSES, "bucket", boom)
    out, report = run_pipeline(gm, Config())
    assert report.fell_back and not kept_report.fell_back
    assert sequence_after(gm, out, report) == sequence_after(gm, kept, kept_report)
    assert len(sequence_after(gm, out, report)) == 4


def test_a_pass_that_breaks_the_graph_is_named(monkeypatch):
    """The graph is linted after every pass, so the pass that broke it is named, not a later
    one (here: a node whose input is defined after it)."""
    def breaks(gm, *, cfg, pinned=frozenset()):
        from fxcoalesce.passes import PassResult

        first = next(n for n in gm.graph.nodes if n.op == "call_function")
        gm.graph.output_node().prepend(first)  # moves it after its users
        return PassResult(changed=True)

    monkeypatch.setitem(PASSES, "linearity", breaks)
    _, report = run_pipeline(diamond(), Config())
    assert report.fell_back and any("pass 'linearity' failed" in w for w in report.warnings)


def test_dump_dir_writes_each_changing_pass(tmp_path):
    cfg = Config(strict=True, dump_dir=str(tmp_path), dump_passes=True)
    _, report = run_pipeline(diamond(), cfg, name="graph d")
    files = sorted(p.name for p in (tmp_path / "graph_d").iterdir())
    # one file per pass that changed the graph (the diamond: linearity sums two of its four)
    changed = [f"after_{p['name']}.txt" for p in report.passes if p["changed"]]
    assert changed == ["after_linearity.txt"]
    assert files == sorted([*DUMPED, *changed])


def test_failing_pass_reraises_when_strict(monkeypatch):
    monkeypatch.setitem(PASSES, "bucket", boom)
    with pytest.raises(RuntimeError, match="boom in bucket"):
        run_pipeline(diamond(), Config(strict=True))


def test_input_module_is_never_modified():
    gm = diamond()
    code = gm.code
    meta = {n.name: dict(n.meta) for n in gm.graph.nodes}
    out, _ = run_pipeline(gm, Config(strict=True))
    # a new module comes back; the input keeps its 4 all_reduces
    assert out is not gm and gm.code == code and len(all_reduces(gm)) == 4
    # and its nodes' meta as it was (cost estimates were once cached there)
    assert {n.name: dict(n.meta) for n in gm.graph.nodes} == meta


@pytest.mark.parametrize("kwargs", [
    {"bucket_cap_mb": 0},                                # cap must be positive
    {"bucket_cap_mb": -1.0},
    {"bucket_cap_mb": float("inf")},                     # and finite: inf made every
    {"bucket_cap_mb": float("nan")},                     # compile fall back
    {"codegen": "tvm"},                                  # only inductor or eager
    {"passes": "bucket"},                                # a string, not a tuple of names
])
def test_config_rejects(kwargs):
    with pytest.raises(ValueError):
        Config(**kwargs)


@pytest.mark.parametrize("entry", [fxcoalesce.backend, inductor_pass,
                                   lambda cfg: run_pipeline(diamond(), cfg)])
def test_pass_names_missing_from_the_registry_fail_at_every_entry(entry, monkeypatch):
    """``Config`` checks names against ``DEFAULT_PASSES``; every entry point also checks them
    against the registry itself (``passes.check_config``)."""
    cfg = Config(passes=("bucket", "slice"))
    registry = importlib.import_module("fxcoalesce.passes")
    monkeypatch.setattr(registry, "PASSES", {k: v for k, v in PASSES.items() if k != "slice"})
    with pytest.raises(ValueError, match=r"unknown pass name\(s\) \['slice'\]"):
        entry(cfg)


def test_cost_model_rejects_zero_bandwidth():
    with pytest.raises(ValueError):
        CostModel(bandwidth_gbps=0)


def test_config_is_frozen():
    cfg = Config()
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.strict = True


def test_disabled_pass_does_not_run():
    cfg = Config(disable=("slice", "linearity", "bucket", "split", "fuse_norm", "lower"))
    assert cfg.enabled_passes == ("schedule",)
    out, report = run_pipeline(diamond(), cfg)
    # only the schedule pass ran, so nothing merged
    assert [p["name"] for p in report.passes] == ["schedule"]
    assert len(all_reduces(out)) == 4


def test_uuid_stable_and_config_sensitive():
    a, b = inductor_pass(Config()), inductor_pass(Config())
    # stable across calls and across equal instances
    assert a.uuid() == a.uuid() == b.uuid()
    # any config change changes the key
    assert inductor_pass(Config(bucket_cap_mb=64)).uuid() != a.uuid()
    assert inductor_pass(Config(cost=CostModel(base_us=1.0))).uuid() != a.uuid()
    # so does compiling for CUDA graphs (the lowering rewrites differently then)
    plain = a.uuid()
    with torch._inductor.config.patch({"triton.cudagraphs": True}):
        assert inductor_pass(Config()).uuid() != plain


def copy_sources(tmp: Path) -> list[Path]:
    """The pass sources copied under ``tmp``, keeping core and passes apart."""
    out = []
    for p in source_files():
        dst = tmp / p.parent.name / p.name
        dst.parent.mkdir(exist_ok=True)
        shutil.copy(p, dst)
        out.append(dst)
    return out


def test_uuid_changes_with_pass_source(tmp_path, monkeypatch):
    real = source_fingerprint()
    files = copy_sources(tmp_path)
    # the fingerprint covers the core and the passes, by name and text
    assert {"analysis.py", "bucket.py", "schedule.py", "one_shot.py"} <= {p.name for p in files}
    assert source_fingerprint(files) == real
    monkeypatch.setattr(compile_cache, "source_files", lambda: files)
    before = inductor_pass(Config()).uuid()
    bucket = next(p for p in files if p.name == "bucket.py")
    bucket.write_text(bucket.read_text() + "\n# changed\n")
    # an edited pass invalidates the FX graph cache key
    assert source_fingerprint(files) != real
    assert inductor_pass(Config()).uuid() != before


def test_custom_pass_mutates_graph_in_place():
    gm, want = diamond(), diamond()
    graph = gm.graph
    inductor_pass(Config(strict=True))(graph)
    graph.lint()
    gm.recompile()
    # the same Graph object now holds the bucketed form
    assert gm.graph is graph and len(all_reduces(gm)) == 3
    inputs = real_inputs(want)
    assert all(torch.equal(a, b) for a, b in zip(run(want, inputs), run(gm, inputs)))


def test_pipeline_keeps_output_node_meta():
    gm = diamond()
    out_node = gm.graph.output_node()
    out_node.meta["user_visible_output_idxs"] = [0]
    new, _ = run_pipeline(gm, Config(strict=True))
    # Inductor reads this to keep user-visible output strides
    assert new.graph.output_node().meta.get("user_visible_output_idxs") == [0]


def test_custom_pass_keeps_output_node_meta():
    gm = diamond()
    gm.graph.output_node().meta["original_output_strides"] = [(4, 1)]
    inductor_pass(Config(strict=True))(gm.graph)
    assert gm.graph.output_node().meta.get("original_output_strides") == [(4, 1)]


DETERMINISM_SCRIPT = """
import json, sys
sys.path.insert(0, sys.argv[1])
import torch
from graphs import GraphBuilder
from fxcoalesce import Config, run_pipeline

b = GraphBuilder()
outs = []
for i, dtype in enumerate((torch.float32, torch.bfloat16)):  # 2 keys x 3 levels x 2
    x0, x1 = b.input(f"x0_{i}", dtype=dtype), b.input(f"x1_{i}", dtype=dtype)
    l1 = [b.all_reduce(b.add(x0, x0)), b.all_reduce(b.add(x1, x1))]
    l2 = [b.all_reduce(b.add(l1[0], l1[1])), b.all_reduce(b.mm(l1[0], l1[1]))]
    outs += [b.all_reduce(b.add(l2[0], l2[1])), b.all_reduce(b.mm(l2[1], l2[0]))]
out, report = run_pipeline(b.build(*outs), Config(strict=True))
print(json.dumps(report.all_reduce, sort_keys=True))
print(json.dumps(report.buckets, sort_keys=True))
print(out.code)
"""


def test_same_plan_and_code_under_any_hash_seed():
    procs = [subprocess.Popen(
        [sys.executable, "-c", DETERMINISM_SCRIPT, str(TESTS)],
        env={**os.environ, "PYTHONHASHSEED": seed}, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True) for seed in ("0", "12345")]
    (out0, err0), (out1, err1) = (p.communicate(timeout=120) for p in procs)
    assert procs[0].returncode == 0, err0
    assert procs[1].returncode == 0, err1
    counts = json.loads(out0.splitlines()[0])
    # 12 all_reduces, 6 launches (3 levels x 2 dtypes), and a real plan to compare
    assert (counts["before"], counts["after"], counts["lower_bound"]) == (12, 6, 6)
    assert len(json.loads(out0.splitlines()[1])) == 6
    assert out0 == out1


def test_reports_accumulate_and_serialise():
    fxcoalesce.clear_reports()
    run_pipeline(diamond(), Config(), name="first")
    _, report = run_pipeline(diamond(), Config(), name="second")
    # one report per run, oldest first
    assert [r.graph for r in fxcoalesce.reports()] == ["first", "second"]
    assert fxcoalesce.reports()[-1] is report
    data = json.loads(report.to_json())
    assert {"before", "after", "lower_bound", "bytes_before", "bytes_after"} <= set(
        data["all_reduce"])
    # four 4x4 f32 all_reduces; AR2 + AR3 become one reduction of their sum (linearity)
    assert (data["all_reduce"]["bytes_before"], data["all_reduce"]["bytes_after"]) == (256, 192)
    assert [p["name"] for p in data["passes"]] == ["slice", "linearity", "bucket", "split",
                                                   "fuse_norm", "lower", "schedule"]
    assert all(isinstance(p["ms"], float) for p in data["passes"])
    assert set(data["nodes"]) == {"before", "after"}
    assert data["warnings"] == [] and [b["kind"] for b in data["buckets"]] == ["sum"]


def test_dump_dir_writes_before_after_and_report(tmp_path):
    run_pipeline(diamond(), Config(dump_dir=str(tmp_path)), name="dumped graph")
    out = tmp_path / "dumped_graph"
    assert sorted(p.name for p in out.iterdir()) == DUMPED
    # the dumps differ by the rewrite: three all_reduces after, four before
    after, before = (out / "after.txt").read_text(), (out / "before.txt").read_text()
    FileCheck().check_count("all_reduce.default(", 3, exactly=True).run(after)
    FileCheck().check_count("all_reduce.default(", 4, exactly=True).run(before)
    assert json.loads((out / "report.json").read_text())["graph"] == "dumped graph"
