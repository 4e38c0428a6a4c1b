"""The cost model: profiles from ``fxcoalesce calibrate``, their errors, the fit, the
roofline, and the report's predictions."""

from __future__ import annotations

import json
import logging

import pytest
import torch
from graphs import GraphBuilder

import fxcoalesce
from fxcoalesce import Config, run_pipeline
from fxcoalesce.apps.bench.calibrate import fit, sizes
from fxcoalesce.apps.launch import init_fake_group
from fxcoalesce.config import CostModel, ProfileError


def write(tmp_path, data, name="p.json"):
    path = tmp_path / name
    path.write_text(data if isinstance(data, str) else json.dumps(data))
    return path


PROFILE = {"backend": "gloo", "device": "cpu", "world_size": 2, "alpha_us": 500.0,
           "beta_us_per_byte": 0.001,
           "segments": [{"up_to_bytes": 65536, "alpha_us": 700.0, "beta_us_per_byte": 0.0},
                        {"up_to_bytes": 1 << 26, "alpha_us": 100.0, "beta_us_per_byte": 0.002}],
           "compute": {"peak_tflops": 0.05, "memory_gbps": 20.0, "kernel_us": 3.0}}


def test_profile_round_trip(tmp_path):
    cost = CostModel.from_profile(write(tmp_path, PROFILE))
    # the piecewise fit decides, by size; the compute constants come along
    assert cost.all_reduce_us(1024, 2) == 700.0
    assert cost.all_reduce_us(1 << 20, 2) == pytest.approx(100.0 + 0.002 * (1 << 20))
    assert (cost.peak_tflops, cost.memory_gbps, cost.kernel_us) == (0.05, 20.0, 3.0)


@pytest.mark.parametrize("content, message", [
    (None, "no such file"),
    ("{not json", "not valid JSON"),
    ({"backend": "gloo"}, "missing \\['alpha_us', 'beta_us_per_byte', 'device', 'world_size'\\]"),
    ({**PROFILE, "alpha_us": "fast"}, "bad value"),
    ({**PROFILE, "alpha_us": -1.0}, "finite and >= 0"),
])
def test_bad_profiles_are_named(tmp_path, content, message):
    path = tmp_path / "missing.json" if content is None else write(tmp_path, content)
    with pytest.raises(ProfileError, match=f"cost profile .*{message}.*fxcoalesce calibrate"):
        CostModel.from_profile(path)


def four_rank_graph():
    init_fake_group(4)
    b = GraphBuilder()
    x = b.input("x")
    group = torch.distributed.group.WORLD.group_name
    return b.build(b.all_reduce(b.add(x, x), group=group), b.all_reduce(x, group=group))


def test_profile_for_another_world_size_is_an_error(tmp_path):
    cfg = Config(cost=CostModel.from_profile(write(tmp_path, PROFILE)))
    with pytest.raises(ProfileError, match="world size 2, but this graph runs on 4 ranks"):
        run_pipeline(four_rank_graph(), cfg)  # not a fallback: the user asked for it


def test_profile_from_the_environment_is_a_warning(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("FXCOALESCE_PROFILE", str(tmp_path / "nope.json"))
    with caplog.at_level(logging.WARNING, logger="fxcoalesce"):
        fxcoalesce.backend()  # not asked for in code: warn, keep the default model
    assert "FXCOALESCE_PROFILE" in caplog.text and "no such file" in caplog.text


def test_fit_within_a_quarter_on_a_two_regime_curve():
    """gloo-like: a flat latency up to 64 KiB, then bandwidth-bound."""
    points = {b: (700.0 if b <= 65536 else 200.0 + 0.003 * b) for b in sizes(8, 1 << 24)}
    segments = fit(points)
    worst = max(abs(_predict(segments, b) - m) / m for b, m in points.items())
    assert len(segments) <= 3 and worst < 0.10


def _predict(segments, nbytes):
    seg = next((s for s in segments if nbytes <= s["up_to_bytes"]), segments[-1])
    return seg["alpha_us"] + seg["beta_us_per_byte"] * nbytes


def test_report_predicts_exposed_and_hidden():
    b = GraphBuilder()
    x, w = b.input("x", (64, 64)), b.input("w", (64, 64))
    r = b.all_reduce(b.mm(x, w))
    m = x
    for _ in range(8):                                  # compute the all_reduce can hide
        m = b.mm(m, w)
    _, report = run_pipeline(b.build(b.add(r, m)), Config(cost=CostModel(kernel_us=10.0)))
    before = report.predicted_comm_us["before"]
    # eight 10-µs matmuls hide more than one ~20-µs ring all_reduce
    assert before["total"] > 0 and before["exposed"] == 0.0
    assert before["hidden"] == before["total"]


def test_overlap_efficiency_scales_what_compute_hides():
    """With a measured efficiency e, a window of compute hides e·min(T, window), not all."""
    b = GraphBuilder()
    x, w = b.input("x", (64, 64)), b.input("w", (64, 64))
    r = b.all_reduce(b.mm(x, w))
    m = x
    for _ in range(8):
        m = b.mm(m, w)
    gm = b.build(b.add(r, m))
    half = CostModel(kernel_us=10.0, overlap_efficiency=0.5)
    _, report = run_pipeline(gm, Config(cost=half))
    before = report.predicted_comm_us["before"]
    assert before["hidden"] == pytest.approx(before["total"] / 2, abs=0.1)
    assert half.hidden_us(40.0, 100.0) == 20.0 and half.hidden_us(40.0, 10.0) == 5.0
    with pytest.raises(ValueError, match="overlap_efficiency must be between 0 and 1"):
        CostModel(overlap_efficiency=1.5)


def test_profile_overlap_section(tmp_path):
    cost = CostModel.from_profile(write(tmp_path, {**PROFILE, "overlap": {"efficiency": 0.4}}))
    assert cost.overlap_efficiency == 0.4
    assert CostModel.from_profile(write(tmp_path, PROFILE, "old.json")).overlap_efficiency == 1.0
    with pytest.raises(ProfileError, match="overlap.efficiency must be between 0 and 1"):
        CostModel.from_profile(write(tmp_path, {**PROFILE, "overlap": {"efficiency": 2}}, "b"))


def test_the_overlap_curve_gives_each_size_its_own_efficiency(tmp_path):
    """A profile's overlap points become a per-size curve: a collective's own size reads it
    (log-linear between points, the end points beyond); no size: the median efficiency."""
    points = [{"bytes": 1 << 20, "efficiency": 0.2}, {"bytes": 4 << 20, "efficiency": 0.6}]
    cost = CostModel.from_profile(write(tmp_path, {**PROFILE, "overlap": {
        "efficiency": 0.4, "points": points[::-1]}}))
    assert cost.overlap_curve == ((1 << 20, 0.2), (4 << 20, 0.6))
    assert cost.efficiency(1 << 10) == 0.2 and cost.efficiency(64 << 20) == 0.6
    assert cost.efficiency(2 << 20) == pytest.approx(0.4)  # halfway in log2(bytes)
    assert cost.efficiency() == 0.4
    assert cost.hidden_us(100.0, 50.0, 4 << 20) == pytest.approx(30.0)
    assert cost.hidden_us(100.0, 50.0) == pytest.approx(20.0)
    with pytest.raises(ValueError, match="overlap_curve"):
        CostModel(overlap_curve=((2, 0.5), (1, 0.5)))
    with pytest.raises(ProfileError, match="between 0 and 1"):
        CostModel.from_profile(write(tmp_path, {**PROFILE, "overlap": {
            "efficiency": 0.4, "points": [{"bytes": 8, "efficiency": 1.5}]}}, "bad.json"))


def test_the_split_prices_each_part_at_its_own_size():
    """Parts of half the size read the curve there: a curve that hides nothing below 1 MiB
    and everything above prices a 4 MiB all_reduce's 2 MiB parts as fully hidden, its 512 KiB
    parts as not at all."""
    from fxcoalesce.cost import split_exposed_us

    cost = CostModel(overlap_curve=((1 << 20, 0.0), (2 << 20, 1.0)))
    big = split_exposed_us(cost, 2, 4 << 20, (0.5, 0.5), (1e9, 1e9))
    small = split_exposed_us(cost, 2, 1 << 20, (0.5, 0.5), (1e9, 1e9))
    assert big == 0.0
    assert small == pytest.approx(2 * cost.all_reduce_us(512 << 10, 2))


def test_overlap_summary_takes_each_sizes_slowest_rank():
    from fxcoalesce.apps.bench.calibrate import overlap_summary

    point = lambda nbytes, both, eff: {"bytes": nbytes, "comm_us": 40.0,  # noqa: E731
                                       "compute_us": 50.0, "matmuls": 2, "both_us": both,
                                       "efficiency": eff}
    ranks = [{"overlap": [point(1, 60.0, 0.75), point(2, 90.0, 0.0)]},
             {"overlap": [point(1, 70.0, 0.5), point(2, 80.0, 0.25)]}]
    summary = overlap_summary(ranks)["overlap"]
    assert [p["both_us"] for p in summary["points"]] == [70.0, 90.0]
    assert summary["efficiency"] == 0.25  # median of 0.5 and 0.0
    assert overlap_summary([{"overlap": []}]) == {}


def test_calibrate_on_two_gloo_ranks_measures_overlap(tmp_path, capsys):
    """A real, small run (~5 s): latency points, the fit, and the overlap section."""
    from fxcoalesce.apps import cli

    out = tmp_path / "p.json"
    assert cli.main(["calibrate", "--tp", "2", "--max-bytes", "64K", "--budget", "0.05",
                     "--out", str(out)]) == 0
    data = json.loads(out.read_text())
    assert [p["bytes"] for p in data["overlap"]["points"]] == [65536]
    assert 0.0 <= data["overlap"]["efficiency"] <= 1.0
    assert "overlap efficiency" in capsys.readouterr().out
    assert CostModel.from_profile(out).overlap_efficiency == data["overlap"]["efficiency"]
