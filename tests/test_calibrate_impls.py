"""calibrate's other implementations, on CPU: the profile they write and its reading back
(old profiles still NCCL-only), the fit of per-implementation points, the bf16 bounds of the
correctness check (on simulated sums), the sizes each implementation takes, and the CLI."""

from __future__ import annotations

import argparse
import json

import pytest
import torch
import torch.nn.functional as F

from fxcoalesce.apps import checks, cli
from fxcoalesce.apps.bench import calibrate
from fxcoalesce.apps.bench import calibrate_impls as ci
from fxcoalesce.apps.bench.fit import fit_rows
from fxcoalesce.config import CostModel

SIZES = calibrate.sizes(8, 64 << 20)
NCCL = {b: 16.0 + b / 25_000 for b in SIZES}  # µs: ~NVLink-like, 16 µs floor
CURVES = {  # what a two-H200 calibrate could measure: one-shot wins small, loses large
    "one_shot": lambda b: 5.0 + b / 8_000 if b <= 1 << 20 else -60.0 + b / 5_000,
    "two_shot": lambda b: 11.0 + b / 30_000,
    "fused_add_rms_norm": lambda b: 7.0 + b / 9_000,
}


def rank_facts(scale: float = 1.0, worst: float = 0.2) -> dict:
    """One rank's ``impls`` facts as ``calibrate_worker`` returns them."""
    points = {impl: {b: scale * f(b) for b in SIZES if ci.feasible(impl, b, 2)}
              for impl, f in CURVES.items()}
    return {"symm_mem": {"usable": True, "why": "ok", "checked_by": "test"},
            "left_out": {}, "points": points,
            "skipped_sizes": {i: [b for b in SIZES if b not in points[i]] for i in points},
            "checks": {i: {"sizes": len(p), "worst": worst, "same": True}
                       for i, p in points.items()},
            "captured": {i: [True] * len(p) for i, p in points.items()},
            "capture_errors": dict.fromkeys(points)}


def results(**kwargs) -> list[dict]:
    rank = {"points": NCCL, "cudagraphs": True, "compute": {"kernel_us": 5.0}, "overlap": []}
    return [{**rank, "impls": rank_facts(1.0, 0.1)}, {**rank, "impls": rank_facts(1.1, 0.3)}]


def make_profile(monkeypatch, ranks=None) -> dict:
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "NVIDIA H200")
    return calibrate.profile(ranks or results(), backend="nccl", device="cuda", world=2,
                             nccl_mode="nvlink", command="test")


def test_profile_round_trip_with_implementations(tmp_path, monkeypatch):
    data = make_profile(monkeypatch)
    calibrate.write_profile(data, tmp_path / "p.json")
    cost = CostModel.from_profile(tmp_path / "p.json")
    names = [name for name, _ in cost.profile.implementations]
    assert names == sorted(CURVES)
    for impl, f in CURVES.items():
        c = data["implementations"][impl]
        assert c["dtype"] == "bfloat16" and c["cudagraphs"] is True
        assert c["max_bytes"] == max(b for b in SIZES if ci.feasible(impl, b, 2))
        # each size's slowest rank (rank 1 here, 10% slower), within the fit's 10%
        assert cost.impl_us(impl, 65536, 2) == pytest.approx(1.1 * f(65536), rel=0.1)
        assert c["check"]["worst_error_over_bound"] == 0.3  # the worst rank's
    fused = data["implementations"]["fused_add_rms_norm"]
    assert fused["hidden"] == 4096 and fused["skipped_sizes"][0] == 8  # below one row
    assert cost.impl_us("fused_add_rms_norm", 4096, 2) == pytest.approx(
        CostModel.from_profile(tmp_path / "p.json").profile.curve(
            "fused_add_rms_norm").us(4096))
    assert cost.impl_us("one_shot", 128 << 20, 2) is None  # past the largest size measured
    assert "past the largest size calibrated" in cost.impl_missing("one_shot", 128 << 20)
    assert cost.impl_us("nccl", 1024, 2) == pytest.approx(NCCL[1024], rel=0.1)
    assert data["symm_mem"]["usable"] and data["implementations_left_out"] == {}


def test_an_implementation_left_out_is_no_curve(tmp_path, monkeypatch):
    ranks = results()
    for r in ranks:
        for key in ("points", "checks", "captured", "capture_errors"):
            r["impls"][key].pop("two_shot")
        r["impls"]["left_out"]["two_shot"] = "failed its correctness check: rank 1: ..."
    data = make_profile(monkeypatch, ranks)
    calibrate.write_profile(data, tmp_path / "p.json")
    cost = CostModel.from_profile(tmp_path / "p.json")
    assert cost.profile.curve("two_shot") is None and cost.profile.curve("one_shot")
    assert "has no two_shot curve" in cost.impl_missing("two_shot", 1024)
    assert data["implementations_left_out"]["two_shot"].startswith("failed its correctness")


def test_old_profiles_read_as_nccl_only(tmp_path):
    path = tmp_path / "old.json"
    path.write_text(json.dumps({"backend": "nccl", "device": "cuda", "world_size": 2,
                                "alpha_us": 12.5, "beta_us_per_byte": 4.8e-6}))
    cost = CostModel.from_profile(path)
    assert cost.profile.implementations == ()
    assert cost.impl_us("one_shot", 1024, 2) is None
    assert "has no one_shot curve" in cost.impl_missing("one_shot", 1024)
    assert cost.impl_us("nccl", 1024, 2) == pytest.approx(12.5 + 4.8e-6 * 1024)


def test_cpu_profiles_have_no_implementations(monkeypatch):
    rank = {"points": NCCL, "cudagraphs": False, "compute": {}, "overlap": []}
    data = calibrate.profile([rank, rank], backend="gloo", device="cpu", world=2,
                             nccl_mode=None, command="test")
    assert "implementations" not in data and "symm_mem" not in data


@pytest.mark.parametrize("impl", sorted(CURVES))
def test_fit_follows_each_implementation(impl):
    points = {b: CURVES[impl](b) for b in SIZES if ci.feasible(impl, b, 2)}
    segments, rows, worst = fit_rows(points)
    assert len(segments) <= 3 and worst < 0.10
    assert [r["bytes"] for r in rows] == sorted(points)
    assert segments[-1]["up_to_bytes"] == max(points)


def test_feasible_sizes():
    assert ci.feasible("one_shot", 8, 8) and not ci.feasible("one_shot", 6, 2)
    assert ci.feasible("two_shot", 16, 8) and not ci.feasible("two_shot", 8, 8)  # 4 elements
    assert ci.feasible("fused_add_rms_norm", 3 * 8192, 2)  # 3 rows of 4096 bf16
    assert not ci.feasible("fused_add_rms_norm", 12288, 2)  # 1.5 rows


def bf16_ring_sum(xs: list[torch.Tensor]) -> torch.Tensor:
    """NCCL's way: W - 1 adds, each rounded to bf16 (a ring starting at each chunk's owner)."""
    out = torch.empty_like(xs[0])
    chunks = torch.arange(xs[0].numel()) % len(xs)
    for start in range(len(xs)):
        acc = xs[start].clone()
        for k in range(1, len(xs)):
            acc = acc + xs[(start + k) % len(xs)]  # bf16 + bf16: rounded each time
        out[chunks == start] = acc[chunks == start]
    return out


@pytest.mark.parametrize("world", [1, 2, 4, 8])
def test_sum_bound_holds_for_two_correct_sums_and_catches_a_wrong_one(world):
    """bf16 inputs on ``world`` ranks: NCCL's ring sum and a one-rounding fp32 sum (one-shot
    style) differ by no more than ``sum_bound``; a sum that lost a rank's input is caught."""
    g = torch.Generator().manual_seed(world)
    xs = [torch.randn(20_000, generator=g).to(torch.bfloat16) for _ in range(world)]
    nccl = bf16_ring_sum(xs)
    once = sum(x.float() for x in xs).to(torch.bfloat16)
    S = sum(x.abs().float() for x in xs)
    bound = ci.sum_bound(S, world)
    worst, why = ci._exceed((once.float() - nccl.float()).abs(), bound)
    assert why is None and worst <= 1.0
    if world > 2:  # at 2 ranks both round the exact sum once: equal
        assert worst > 0.01  # the bound is not absurdly loose: real rounding uses some of it
    wrong = sum(x.float() for x in xs[1:]) if world > 1 else torch.zeros(20_000)  # rank 0 lost
    _, why = ci._exceed((wrong.float() - nccl.float()).abs(), bound)
    assert why is not None and "elements past the bf16 bound" in why


def test_fused_bounds_hold_for_the_fused_arithmetic():
    """The fused op's contract (fp32 sum + residual rounded once; normed = F.rms_norm of it)
    against the unfused graph (NCCL's bf16 sum, then a bf16 add, then F.rms_norm)."""
    world, rows, hidden = 4, 16, 4096
    g = torch.Generator().manual_seed(0)
    xs = [torch.randn(rows, hidden, generator=g).to(torch.bfloat16) for _ in range(world)]
    r = torch.randn(rows, hidden, generator=g).to(torch.bfloat16)
    w = (1 + 0.1 * torch.randn(hidden, generator=g)).to(torch.bfloat16)
    h = bf16_ring_sum([x.flatten() for x in xs]).view(rows, hidden) + r
    acc = sum(x.float() for x in xs) + r.float()
    res_out = acc.to(torch.bfloat16)
    S = sum(x.abs().float() for x in xs)
    _, why = ci._exceed((res_out.float() - h.float()).abs(),
                        ci.residual_bound(S, h, res_out, r, world))
    assert why is None
    # normed: the kernel's fp32 arithmetic, summed in another order than F.rms_norm's
    xf = res_out.float()
    inv = torch.rsqrt(xf.pow(2).flip(-1).mean(-1, keepdim=True) + ci.EPS)
    normed = (xf * inv * w.float()).to(torch.bfloat16)
    ref = F.rms_norm(res_out, (hidden,), w, ci.EPS)
    _, why = ci._exceed((normed.float() - ref.float()).abs(), ci.rounding_bound(normed, ref))
    assert why is None
    off = (normed.float() * 1.03).to(torch.bfloat16)
    assert ci._exceed((off.float() - ref.float()).abs(), ci.rounding_bound(off, ref))[1]


def test_run_calibrate_measures_the_implementations_on_nccl_only(monkeypatch):
    seen = []
    monkeypatch.setattr("fxcoalesce.apps.launch.spawn",
                        lambda fn, world, args, **kw: seen.append(args[4]) or [])
    monkeypatch.setattr(calibrate, "profile", lambda *a, **k: {})
    base = dict(tp=2, max_bytes=1024, no_cudagraphs=False, budget=0.1, nccl_mode="nvlink",
                command_line="")
    for backend, device, impls in [("nccl", "cuda", None), ("nccl", "cuda", ()),
                                   ("nccl", "cuda", ("one_shot",)), ("gloo", "cuda", None),
                                   ("gloo", "cpu", None)]:
        calibrate.run_calibrate(argparse.Namespace(backend=backend, device=device,
                                                   impls=impls, **base))
    assert seen == [calibrate.IMPLS, (), ("one_shot",), (), ()]


def refused(capsys, argv: list[str]) -> str:
    assert cli.main(["calibrate", *argv]) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1, err
    return err[0].removeprefix("fxcoalesce calibrate: error: ")


@pytest.mark.parametrize("argv, message", [
    (["--tp", "1"], "--tp 1 needs --backend nccl --device cuda (an NCCL group of one rank: "
     "what each implementation costs a call at world size 1); with gloo an all_reduce over "
     "one rank moves nothing"),
    (["--impls", "one_shot,fast"], "--impls: unknown implementation(s) 'fast'; choose from: "
     "nccl, one_shot, two_shot, fused_add_rms_norm, nccl_symm"),
    (["--impls", ","], "--impls names none; choose from: nccl, one_shot, two_shot, "
     "fused_add_rms_norm, nccl_symm"),
    (["--impls", "one_shot"], "--impls one_shot needs --backend nccl --device cuda "
     "(symmetric memory: CUDA ranks of an NCCL group)"),
])
def test_bad_calibrate_arguments(capsys, tmp_path, argv, message):
    assert refused(capsys, [*argv, "--out", str(tmp_path / "p.json")]) == message


def test_tp_1_with_nccl_passes_the_checks(monkeypatch, tmp_path):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda i=0: (100 << 30, 140 << 30))
    args = cli.parser().parse_args(["calibrate", "--tp", "1", "--backend", "nccl", "--device",
                                    "cuda", "--impls", "nccl,one_shot", "--out",
                                    str(tmp_path / "p.json")])
    checks.check_calibrate(args)
    assert args.impls == ("one_shot",)


def test_calibrate_prints_each_implementation(monkeypatch, capsys, tmp_path):
    data = make_profile(monkeypatch)
    data["implementations_left_out"] = {"two_shot": "failed its correctness check: ..."}
    data["implementations"].pop("two_shot")
    monkeypatch.setattr(calibrate, "run_calibrate", lambda args: data)
    out = tmp_path / "p.json"
    assert cli.main(["calibrate", "--max-bytes", "64K", "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert "symmetric memory: usable (ok; test)" in text
    assert "one_shot (bfloat16): " in text and "correct at 47 sizes" in text
    assert "two_shot: left out (failed its correctness check: ...)" in text
    assert any(line.split()[:1] == ["67108864"] for line in text.splitlines())  # the table
    assert CostModel.from_profile(out).profile.curve("one_shot") is not None


@pytest.fixture
def gloo_one_rank():
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_nccl_symm_gets_a_process_of_its_own(gloo_one_rank, monkeypatch):
    """torch's symmetric-memory backend is process-wide: asked with others, nccl_symm is
    left out (the backend is not touched); alone, the switch to NCCL's is voted on."""
    from fxcoalesce.kernels import nccl_symm

    switched = []
    monkeypatch.setattr(nccl_symm, "process_backend", lambda: "CUDA")
    monkeypatch.setattr(nccl_symm, "use_nccl_backend",
                        lambda: (switched.append(1), (True, "ok"))[1])
    dev = torch.device("cpu")
    backend, why = ci.choose_backend(["one_shot", "nccl_symm"], dev)
    assert backend == "CUDA" and "calibrate nccl_symm in a run of its own" in why
    assert "keeps CUDA's for one_shot" in why and switched == []
    assert ci.choose_backend(["nccl_symm"], dev) == ("NCCL", None) and switched == [1]
    monkeypatch.setattr(nccl_symm, "use_nccl_backend",
                        lambda: (False, "set_backend('NCCL'): RuntimeError: no"))
    assert ci.choose_backend(["nccl_symm"], dev) == (
        "CUDA", "NCCL's symmetric memory: rank 0: set_backend('NCCL'): RuntimeError: no")
    assert ci.choose_backend(["one_shot"], dev) == ("CUDA", None)


def test_the_profile_says_which_backend_ran(tmp_path, monkeypatch):
    ranks = results()
    for r in ranks:
        r["impls"]["symm_backend"] = ci.symm_backend_fact(["nccl_symm"]) | {"backend": "NCCL"}
    data = make_profile(monkeypatch, ranks)
    assert data["symm_backend"]["backend"] == "NCCL"
    assert data["symm_backend"]["rule"].startswith("one backend a process")
    calibrate.write_profile(data, tmp_path / "p.json")
    CostModel.from_profile(tmp_path / "p.json")  # still reads back


def test_nccl_symm_sizes_and_name():
    assert ci.feasible("nccl_symm", 4, 2)
    assert checks._impls("nccl_symm,nccl") == ("nccl_symm",)
