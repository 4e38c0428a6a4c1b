"""bench's anchors: ``inductor-one-shot`` (skipped off CUDA + NCCL, with the reason) and
``no-comm`` (all_reduces replaced by a local scale: flagged wrong by design everywhere, the
floor of ``exposed_comm_ms``), and the provenance every record carries."""

from __future__ import annotations

import io
import json

import pytest
import torch
from torch.fx import Graph, GraphModule

from fxcoalesce.apps import cli
from fxcoalesce.apps.bench import records
from fxcoalesce.apps.bench import report as bench_report
from fxcoalesce.apps.bench.run import BenchOptions
from fxcoalesce.apps.bench.variants import (DEFAULT_VARIANTS, VARIANTS, NoComm,
                                            parse_variants, unavailable)


def test_variant_names_and_defaults():
    assert parse_variants("no-comm,inductor-one-shot") == ("no-comm", "inductor-one-shot")
    assert "no-comm" in VARIANTS and "no-comm" not in DEFAULT_VARIANTS  # never a default
    assert "inductor-one-shot" in DEFAULT_VARIANTS
    assert BenchOptions().variants == DEFAULT_VARIANTS
    assert cli.parser().parse_args(["bench"]).variants == ",".join(DEFAULT_VARIANTS)


@pytest.mark.parametrize("device, backend", [("cpu", "gloo"), ("cuda", "gloo")])
def test_inductor_one_shot_is_skipped_off_cuda_nccl(device, backend):
    assert unavailable("inductor-one-shot", device, backend) == (
        "PyTorch's one-shot lowering needs symmetric memory: CUDA ranks of an NCCL group, "
        f"not {backend} on {device}")
    assert unavailable("no-comm", device, backend) is None
    assert unavailable("inductor-one-shot", "cuda", "nccl") is None  # this torch has it


def test_inductor_one_shot_skip_note_in_a_real_run(capsys):
    """Two gloo ranks, nothing compiled (fast): the skip note in the table."""
    assert cli.main(["bench", "--variants", "eager,inductor-one-shot", "--steps", "2",
                     "--warmup", "1"]) == 0
    out = capsys.readouterr().out
    assert "note: inductor-one-shot: skipped (PyTorch's one-shot lowering needs symmetric " \
           "memory: CUDA ranks of an NCCL group, not gloo on cpu)" in out


def ar_graph() -> GraphModule:
    """x -> wait(all_reduce(x, sum)) + 1, and a max all_reduce: the ATen form bench's
    compiled variants see."""
    c10d = torch.ops._c10d_functional
    g = Graph()
    x = g.placeholder("x")
    w = g.call_function(c10d.wait_tensor.default,
                        (g.call_function(c10d.all_reduce.default, (x, "sum", "0")),))
    m = g.call_function(c10d.wait_tensor.default,
                        (g.call_function(c10d.all_reduce.default, (x, "max", "0")),))
    g.output(g.call_function(torch.ops.aten.add.Tensor, (w, m)))
    return GraphModule(torch.nn.Module(), g)


def test_no_comm_pass_replaces_every_all_reduce_by_a_local_scale():
    gm = ar_graph()
    NoComm(4)(gm.graph)
    gm.recompile()
    targets = [n.target for n in gm.graph.nodes if n.op == "call_function"]
    assert not any("_c10d_functional" in str(t) for t in targets), targets
    x = torch.arange(3.0)
    assert torch.equal(gm(x), x * 4 + x)  # sum: x * world; max: x
    assert NoComm(4).uuid() != NoComm(2).uuid()  # the scale is in Inductor's cache key


def facts(times_ms: list[float], launches: int = 9, **extra) -> dict:
    return {"times_us": [t * 1e3 for t in times_ms], "all_reduce_launches": launches,
            "bytes": launches * 768, "max_abs_err": 1e-6, "other_collectives": {},
            "compile_s": 1.0, "options": None, "failed_tiers": [], "reports": [],
            "predicted_comm_us": [], "cudagraph_skips": 0, "graphs": 1, "recompiled": False,
            "lowered": {}, **extra}


def merged(env: dict | None = None) -> dict:
    rank = lambda scale: [{"tokens": 3, "skipped": {}, "notes": [], "variants": {  # noqa: E731
        "inductor": facts([scale * t for t in (10.0, 11.0, 12.0)]),
        "inductor-one-shot": facts([9.0, 9.0, 9.0], lowered={"one_shot": 9}),
        "no-comm": facts([scale * t for t in (6.0, 7.0, 8.0)], launches=0, max_abs_err=3.0),
    }}]
    opt = BenchOptions(variants=("inductor", "inductor-one-shot", "no-comm"), steps=3)
    [rec] = records.merge_ranks([rank(1.0), rank(1.5)], opt, env or {"torch": "t",
                                                                     "date": "d"})
    return rec


def test_exposed_comm_is_the_median_minus_the_floors():
    rec = merged()
    v = rec["variants"]
    # each step is its slowest rank's (rank 1: x1.5): medians 16.5 and 10.5 ms
    assert v["inductor"]["median_ms"] == pytest.approx(16.5)
    assert v["no-comm"]["median_ms"] == pytest.approx(10.5)
    assert v["inductor"]["exposed_comm_ms"] == pytest.approx(6.0)
    assert v["inductor-one-shot"]["exposed_comm_ms"] == pytest.approx(9.0 - 10.5)
    assert v["no-comm"]["exposed_comm_ms"] == 0.0
    assert v["no-comm"]["wrong_by_design"] is True
    assert not any(x.get("wrong_by_design") for n, x in v.items() if n != "no-comm")
    assert v["inductor-one-shot"]["lowered"] == {"one_shot": 9}
    assert any(n.startswith("no-comm: WRONG RESULTS BY DESIGN") for n in rec["notes"])


def test_without_the_floor_there_is_no_exposed_comm():
    variants = {"inductor": {"median_ms": 2.0}}
    records.add_exposed_comm(variants)
    assert "exposed_comm_ms" not in variants["inductor"]


def test_notes_when_an_anchor_does_not_do_what_it_stands_for():
    assert "it measured plain Inductor" in records.variant_notes(
        "inductor-one-shot", facts([1.0]))[0]
    assert "yet it issued 3 all_reduce(s): not the floor" in records.variant_notes(
        "no-comm", facts([1.0], launches=3))[0]


def test_no_comm_is_flagged_in_every_output(tmp_path):
    rec = {**merged(), "torch": "2.11", "gpu": "NVIDIA H200", "gpus": 2, "driver": "580.1",
           "nccl": "2.28.9", "profile": "p.json", "date": "2026-12-01T00:00:00Z"}
    text = bench_report.text_table(rec)
    assert "exposed comm ms" in text and "3 (wrong by design)" in text
    assert "9 (9 one_shot)" in text  # launches, and what ran them
    bench_report.write_all([rec], tmp_path)
    md = (tmp_path / "bench.md").read_text()
    assert "| no-comm | 10.500 |" in md and "| 3 (wrong by design) | 0.000 |" in md
    assert "| inductor | 16.500 |" in md and "| 6.000 | 1.0 |" in md
    assert "- no-comm: WRONG RESULTS BY DESIGN" in md
    assert "torch 2.11, 2x NVIDIA H200, driver 580.1, NCCL 2.28.9, cost profile p.json" in md
    [back] = json.loads((tmp_path / "bench.json").read_text())
    assert back["variants"]["no-comm"]["wrong_by_design"] is True
    assert (tmp_path / "bench.png").read_bytes().startswith(b"\x89PNG")


def test_every_record_carries_its_provenance(monkeypatch, tmp_path):
    monkeypatch.delenv("FXCOALESCE_PROFILE", raising=False)
    env = records.environment("cpu")
    for key in ("torch", "date", "gpu", "driver", "nccl", "profile"):
        assert key in env
    assert (env["gpu"], env["driver"], env["nccl"], env["profile"]) == (None, None, None,
                                                                         "default")
    rec = merged(env)
    assert rec["profile"] == "default" and rec["nccl_mode"] is None and rec["torch"]
    good = tmp_path / "p.json"
    good.write_text(json.dumps({"backend": "gloo", "device": "cpu", "world_size": 2,
                                "alpha_us": 1.0, "beta_us_per_byte": 0.0}))
    monkeypatch.setenv("FXCOALESCE_PROFILE", str(good))
    used = records.profile_used()
    assert used["profile"] == str(good) and len(used["profile_sha256"]) == 64
    monkeypatch.setenv("FXCOALESCE_PROFILE", str(tmp_path / "nope.json"))
    assert records.profile_used()["profile"].startswith(
        f"default (FXCOALESCE_PROFILE={tmp_path / 'nope.json'} unusable: cost profile")


def test_driver_version_without_nvidia_smi(monkeypatch):
    import builtins
    import subprocess

    def no_smi(*a, **k):
        raise OSError("no nvidia-smi")

    real_open = builtins.open
    line = "NVRM version: NVIDIA UNIX x86_64 Kernel Module  580.159.04  Thu Oct 30 2025\n"
    monkeypatch.setattr(subprocess, "run", no_smi)
    monkeypatch.setattr(builtins, "open", lambda path, *a, **k: io.StringIO(line) if str(
        path) == "/proc/driver/nvidia/version" else real_open(path, *a, **k))
    assert records.driver_version() == "580.159.04"
