"""``fxcoalesce inspect --format dot|svg|png``, ``--timeline`` and ``--trace``: what they
write, and their bad input (one line, exit 2, before any trace)."""

from __future__ import annotations

import json
import re

import pytest
from torch.testing import FileCheck

from fxcoalesce.apps import cli
from fxcoalesce.viz.draw import has_matplotlib

PNG = b"\x89PNG\r\n\x1a\n"
needs_matplotlib = pytest.mark.skipif(not has_matplotlib(), reason="matplotlib not installed")


def refused(capsys, args: list[str]) -> str:
    assert cli.main(["inspect", *args]) == 2
    out, err = capsys.readouterr()
    assert out == ""
    return err.removeprefix("fxcoalesce inspect: error: ").removesuffix("\n")


@pytest.mark.parametrize("args, message", [
    (["--model", "neox-tiny", "--format", "png"], "--format png writes collectives.png: give "
                                                  "--out DIR"),
    (["--model", "neox-tiny", "--timeline"], "--timeline writes timeline.png: give --out DIR"),
    (["--trace", "t.json"], "--trace writes trace_timeline.png: give --out DIR"),
    (["--trace", "no-such.json", "--out", "{tmp}"], "--trace no-such.json: no such file"),
    (["--format", "png"], "--model or --hf is required (--list names the zoo's models)"),
])
def test_drawing_options_refused(capsys, tmp_path, args, message):
    assert refused(capsys, [a.format(tmp=tmp_path) for a in args]) == message


@needs_matplotlib
def test_trace_that_is_a_directory(capsys, tmp_path):
    """Regression: a directory was reported as "no such file"."""
    err = refused(capsys, ["--trace", str(tmp_path), "--out", str(tmp_path / "out")])
    assert err == f"--trace {tmp_path}: a directory, not a trace file"


def test_svg_without_any_renderer_is_refused(capsys, monkeypatch, tmp_path):
    from fxcoalesce.viz import draw

    monkeypatch.setattr(draw, "renderer", lambda: None)
    monkeypatch.setattr(draw, "has_matplotlib", lambda: False)
    err = refused(capsys, ["--model", "neox-tiny", "--format", "svg", "--out", str(tmp_path)])
    assert err == ("drawing svg needs Graphviz's `dot` on PATH or matplotlib (pip install "
                   "'fxcoalesce[plot]'); --format dot writes the DOT text without either")
    err = refused(capsys, ["--model", "neox-tiny", "--timeline", "--out", str(tmp_path)])
    assert err == "--timeline needs matplotlib (pip install 'fxcoalesce[plot]')"


def test_dot_without_out_goes_to_stdout(capsys):
    assert cli.main(["inspect", "--model", "neox-tiny", "--tp", "4", "--format", "dot"]) == 0
    out, err = capsys.readouterr()
    # stdout is the DOT text alone (it pipes into `dot`); the table went to stderr
    assert out.startswith("digraph fxcoalesce {\n") and out.endswith("}\n")
    assert "subgraph cluster_before" in out and "subgraph cluster_after" in out
    assert "all_reduce launches  9 -> 5  (lower bound 5)" in err


@needs_matplotlib
def test_png_and_timeline_are_written(capsys, tmp_path):
    assert cli.main(["inspect", "--model", "neox-tiny", "--tp", "4", "--format", "png",
                     "--timeline", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "after.txt", "before.txt", "collectives.dot", "collectives.png", "report.json",
        "timeline.png"]
    for name in ("collectives.png", "timeline.png"):
        assert (tmp_path / name).read_bytes()[:8] == PNG, name
    # each of the four buckets of neox-tiny (attention + MLP of a layer) is named in after.txt
    FileCheck().check_count("# fxcoalesce: replaces", 4, exactly=True).run(
        (tmp_path / "after.txt").read_text())
    assert "before, predicted: step" in out and "after, predicted: step" in out


@needs_matplotlib
def test_trace_alone_draws_its_lanes(capsys, tmp_path):
    trace = tmp_path / "trace.json"
    trace.write_text(json.dumps({"traceEvents": [
        {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 10, "tid": 1},
        {"ph": "X", "cat": "cpu_op", "name": "gloo:all_reduce", "ts": 5, "dur": 20, "tid": 2},
    ]}))
    assert cli.main(["inspect", "--trace", str(trace), "--out", str(tmp_path / "o")]) == 0
    assert "trace.json (CPU ops): step 25 µs, communication 20 µs (15 exposed)" in \
        capsys.readouterr().out
    assert (tmp_path / "o" / "trace_timeline.png").read_bytes()[:8] == PNG


@needs_matplotlib
def test_timeline_uses_the_reports_cost_profile(capsys, monkeypatch, tmp_path):
    profile = tmp_path / "profile.json"  # every all_reduce costs 1 ms, whatever its size
    profile.write_text(json.dumps({"backend": "gloo", "device": "cpu", "world_size": 4,
                                   "alpha_us": 1000.0, "beta_us_per_byte": 0.0}))
    monkeypatch.setenv("FXCOALESCE_PROFILE", str(profile))
    assert cli.main(["inspect", "--model", "neox-tiny", "--tp", "4", "--timeline", "-v",
                     "--out", str(tmp_path / "o")]) == 0
    out = capsys.readouterr().out
    # the report's prediction read it too: the first row, the one the rewrite was chosen with
    assert re.search(r"\n    your profile \(4 gloo ranks, CPU\)  9000\.0 -> 5000\.0 µs "
                     r"\(exposed [\d.]+ -> [\d.]+\)  \(the rewrite was chosen with it\)\n",
                     out), out
    assert f"your profile (4 gloo ranks, CPU): gloo, an eager loop; {profile}" in out
    assert f"predicted: all_reduce from the profile {profile}; compute a CPU roofline" in out
    assert "communication 9000 µs" in out and "communication 5000 µs" in out


@needs_matplotlib
def test_a_tall_drawing_has_no_blank_band_and_its_panel_titles_apart():
    """falcon-40b's 60 layers (one box each) drew 604 x 5754 px with ~560 px of blank space
    under the title and the two panel titles overlapping."""
    from fxcoalesce.viz.draw import picture_figure
    from fxcoalesce.viz.picture import Box, Panel

    def panel(name: str, title: str, lines: int) -> Panel:
        boxes = [Box(f"{name}/{i}", (f"layers.{i}",) + ("1 all_reduce",) * (lines - 1), None, i)
                 for i in range(62)]
        return Panel(name, title, boxes, [(a.id, b.id) for a, b in zip(boxes, boxes[1:])])

    fig = picture_figure([panel("before", "before: 121 all_reduce, 1 all_gather\none box per "
                                "layer", 3),
                          panel("after", "after: 61 all_reduce, 1 all_gather (lower bound "
                                "61)\none box per layer", 4)], "falcon-40b  step=forward")
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    canvas = FigureCanvasAgg(fig)
    canvas.draw()  # constrained layout places the titles
    renderer = canvas.get_renderer()
    titles = [ax.title.get_window_extent(renderer) for ax in fig.axes]
    assert titles[0].x1 < titles[1].x0  # side by side, apart
    top = fig._suptitle.get_window_extent(renderer)
    gap_px = top.y0 - max(t.y1 for t in titles)
    assert 0 <= gap_px < 30  # the panel titles right under the figure's
    first_box = min(ax.texts[0].get_window_extent(renderer).y1 for ax in fig.axes)
    assert max(t.y0 for t in titles) - first_box < 60  # and the first row under them
