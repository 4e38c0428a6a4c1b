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
from fxcoalesce.apps.calibrate import fit, sizes
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
