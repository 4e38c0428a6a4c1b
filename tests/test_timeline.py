"""Tier 1: the predicted two-lane timeline on a hand-built graph with fixed costs, a chrome
trace read into the same lanes, and both drawn as PNG."""

from __future__ import annotations

import json

import pytest
from graphs import GraphBuilder

from fxcoalesce import CostModel
from fxcoalesce.viz.draw import (draw_timelines, has_matplotlib, read_chrome_trace,
                                 timeline_figure)
from fxcoalesce.viz.timeline import Span, Timeline, predict_timeline

# a matmul costs its launch, 4 µs (peaks too high to matter); an all_reduce 10 µs
COST = CostModel(base_us=10.0, hop_us=0.0, bandwidth_gbps=1e9, peak_tflops=1e9,
                 memory_gbps=1e9, kernel_us=4.0)


def two_in_flight():
    """mm1, AR1(mm1), mm2, AR2(mm2), mm3, then add(AR1, AR2) and add(.., mm3): both
    all_reduces are in flight while the later matmuls run."""
    b = GraphBuilder()
    x, w = b.input("x"), b.input("w")
    w1 = b.all_reduce(b.mm(x, w))
    w2 = b.all_reduce(b.mm(x, w))
    m3 = b.mm(x, w)
    return b.build(b.add(b.add(w1, w2), m3))


def ends(spans) -> list[float]:
    return [t for s in spans for t in (s.start_us, s.end_us)]


def test_predicted_lanes():
    tl = predict_timeline(two_in_flight(), COST, world=2, title="t")
    mms = [s for s in tl.compute if s.name.startswith("mm")]
    assert ends(mms) == pytest.approx([0, 4, 4, 8, 8, 12])  # end to end
    # AR1 is issued when mm1 ends; AR2 is ready at 8 but queues behind AR1 until 14
    assert ends(tl.comm) == pytest.approx([4, 14, 14, 24])
    # the adds wait for AR2: the compute lane stalls from 12 to 24
    adds = [s for s in tl.compute if s.name.startswith("add")]
    assert adds[0].start_us == pytest.approx(24)
    # hidden: AR1 under mm2 and mm3 (4..12); everything after 12 is exposed
    assert tl.hidden_us == pytest.approx(8) and tl.comm_us == pytest.approx(20)
    assert tl.end_us == pytest.approx(24, abs=0.01)
    assert tl.summary() == "t: step 24 µs, communication 20 µs (12 exposed)"


def write_trace(path, events):
    path.write_text(json.dumps({"traceEvents": [{"ph": "X", "pid": 1, **e} for e in events]}))
    return path


def test_chrome_trace_cpu_ops(tmp_path):
    trace = write_trace(tmp_path / "cpu.json", [
        {"cat": "cpu_op", "name": "Torch-Compiled Region", "ts": 100, "dur": 100, "tid": 1},
        {"cat": "cpu_op", "name": "aten::mm", "ts": 100, "dur": 10, "tid": 1},
        {"cat": "cpu_op", "name": "_c10d_functional::all_reduce", "ts": 110, "dur": 2, "tid": 1},
        {"cat": "user_annotation", "name": "gloo:all_reduce", "ts": 111, "dur": 30, "tid": 2},
        {"cat": "cpu_op", "name": "aten::add", "ts": 120, "dur": 5, "tid": 1},
    ])
    tl = read_chrome_trace(trace)
    # compute: the innermost ops that are not collectives (not the region around them)
    assert [(s.name, s.start_us, s.end_us) for s in tl.compute] == [
        ("aten::mm", 0, 10), ("aten::add", 20, 25)]
    # collectives: the union of the c10d op and gloo's own span; add runs under it
    assert [(s.start_us, s.end_us) for s in tl.comm] == [(10, 41)]
    assert [(s.start_us, s.end_us) for s in tl.hidden] == [(20, 25)]
    assert tl.title == "cpu.json (CPU ops)"


def test_chrome_trace_gpu_kernels(tmp_path):
    trace = write_trace(tmp_path / "gpu.json", [
        {"cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 3, "tid": 1},
        {"cat": "kernel", "name": "sm90_gemm", "ts": 10, "dur": 10, "tid": 7},
        {"cat": "kernel", "name": "ncclDevKernel_AllReduce_Sum_bf16_RING_LL", "ts": 15,
         "dur": 20, "tid": 8},
    ])
    tl = read_chrome_trace(trace)  # GPU kernels only: the CPU op is not on the lanes
    assert [(s.start_us, s.end_us) for s in tl.compute] == [(0, 10)]
    assert [(s.start_us, s.end_us) for s in tl.comm] == [(5, 25)]
    assert tl.hidden_us == 5 and tl.title == "gpu.json (GPU kernels)"


def test_chrome_trace_refuses_other_json(tmp_path):
    (tmp_path / "x.json").write_text('{"traceEvents": [{"ph": "i", "name": "mark"}]}')
    with pytest.raises(ValueError, match="no complete .* events"):
        read_chrome_trace(tmp_path / "x.json")
    (tmp_path / "y.json").write_text("not json")
    with pytest.raises(ValueError, match="not a readable JSON file"):
        read_chrome_trace(tmp_path / "y.json")


@pytest.mark.skipif(not has_matplotlib(), reason="matplotlib not installed")
def test_timeline_png_is_written(tmp_path):
    gm = two_in_flight()
    draw_timelines([predict_timeline(gm, COST, 2, name) for name in ("before", "after")],
                   tmp_path / "timeline.png")
    data = (tmp_path / "timeline.png").read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000


COMPUTE = "compute (one bar per node, shades alternate)"


@pytest.mark.skipif(not has_matplotlib(), reason="matplotlib not installed")
@pytest.mark.parametrize("comm, hidden, labels", [
    ([Span("ar", 4, 14)], [Span("ar", 4, 8)],
     [COMPUTE, "collective, exposed", "collective, hidden under compute"]),
    # regression: "hidden under compute" was named when nothing was hidden
    ([Span("ar", 8, 14)], [], [COMPUTE, "collective, exposed"]),
    ([Span("ar", 0, 8)], [Span("ar", 0, 8)], [COMPUTE, "collective, hidden under compute"]),
    ([], [], [COMPUTE]),
])
def test_timeline_legend_names_what_is_drawn(comm, hidden, labels):
    """One entry per colour drawn: the two compute shades together, then the collectives'
    exposed and hidden parts only where there are some."""
    tl = Timeline("t", compute=[Span("mm1", 0, 4), Span("mm2", 4, 8)], comm=comm, hidden=hidden)
    legend = timeline_figure([tl]).legends[0]
    assert [t.get_text() for t in legend.get_texts()] == labels


def test_a_prediction_says_what_it_assumes():
    """inspect's falcon-40b timeline showed a 1.08 s step from a CPU roofline without saying
    which device, or that the cost model was not calibrated."""
    from fxcoalesce.cost import DEVICE_DEFAULTS

    tl = predict_timeline(two_in_flight(), CostModel(), world=2)
    peak, mem, kernel = DEVICE_DEFAULTS["cpu"]  # the graph's tensors are on the CPU
    assert tl.assumes == ("uncalibrated default cost model: all_reduce a ring over PCIe "
                          f"({CostModel().bandwidth_gbps:g} GB/s); compute a CPU roofline "
                          f"({peak:g} TFLOP/s, {mem:g} GB/s, {kernel:g} µs a kernel, defaults)")
    assert predict_timeline(two_in_flight(), COST, world=2).assumes.endswith(
        "compute a CPU roofline (1e+09 TFLOP/s, 1e+09 GB/s, 4 µs a kernel)")  # COST's own
    fig = timeline_figure([tl]) if has_matplotlib() else None
    if fig is not None:
        assert fig._suptitle.get_text() == f"Predicted, not measured: {tl.assumes}"
