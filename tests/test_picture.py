"""Tier 1: the collective DAG, its picture (boxes, colours, collapsing) and the DOT text,
on hand-built graphs; rendering to PNG and SVG."""

from __future__ import annotations

import re
import shutil

import pytest
from graphs import GraphBuilder, diamond

from fxcoalesce import Config, run_pipeline
from fxcoalesce.viz.draw import has_matplotlib, render_picture
from fxcoalesce.viz.dag import find_collective_dag, layer_of, module_path
from fxcoalesce.viz.picture import collective_picture, to_dot

needs_matplotlib = pytest.mark.skipif(not has_matplotlib(), reason="matplotlib not installed")


AR0, AR1, AR2, AR3 = "all_reduce_default", *(f"all_reduce_default_{i}" for i in (1, 2, 3))



def bucketed():
    """The diamond and its rewrite by the bucket pass alone: AR1 and AR2 become one."""
    before = diamond()
    after, _ = run_pipeline(before, Config(passes=("bucket",), strict=True))
    dag = find_collective_dag(before)
    return dag, find_collective_dag(after, origins=dag)


def layered(n_layers: int):
    """``n_layers`` parallel blocks, two independent all_reduces each, with module stacks."""
    b = GraphBuilder()
    h, w = b.input("x"), b.input("w")
    for i in range(n_layers):
        parts = []
        for sub in ("attn", "mlp"):
            c = b.collective(b.mm(h, w))
            c.meta["nn_module_stack"] = {
                f"layer{i}": (f"L['self'].layers.{i}", object),
                f"{sub}{i}": (f"L['self'].layers.{i}.{sub}", object)}
            parts.append(b.wait(c))
        h = b.add(b.add(h, parts[0]), parts[1])
    return b.build(h)


def test_dag_keeps_direct_dependencies_only():
    before, _ = bucketed()
    assert [(n.name, n.depth, n.level) for n in before.nodes] == [
        (AR0, 1, 1), (AR1, 2, 2), (AR2, 2, 2), (AR3, 3, 3)]
    # AR0 -> AR3 is implied by AR0 -> AR1 -> AR3: not an edge of its own
    assert sorted(before.edges) == [(AR0, AR1), (AR0, AR2), (AR1, AR3), (AR2, AR3)]


def test_new_collective_records_what_it_replaces():
    _, after = bucketed()
    new = [n for n in after.nodes if n.replaces]
    assert len(after.nodes) == 3 and len(new) == 1
    assert new[0].replaces == (AR1, AR2) and new[0].depth == 2
    assert sorted(after.edges) == sorted([(AR0, new[0].name), (new[0].name, AR3)])


def test_dot_text_of_a_bucket():
    before, after = bucketed()
    fused = next(n.name for n in after.nodes if n.replaces)
    dot = to_dot(collective_picture(before, after, bound=3), title="diamond")
    lines = [line.strip() for line in dot.splitlines()]
    assert lines[0] == "digraph fxcoalesce {" and lines[-1] == "}"
    assert 'label="before: 4 all_reduce";' in lines
    assert 'label="after: 3 all_reduce (lower bound 3)";' in lines
    # the fused all_reduce and the two it replaces share a fill colour; the others have none
    fills = dict(re.findall(r'^"(\w+/\w+)" \[label=.*?(?:fillcolor="(#\w+)")?\];$', line)[0]
                 for line in lines if line.startswith('"') and "[label=" in line)
    assert fills[f"after/{fused}"] == fills[f"before/{AR1}"] == fills[f"before/{AR2}"] != ""
    assert fills[f"before/{AR0}"] == fills[f"after/{AR0}"] == fills[f"after/{AR3}"] == ""
    assert (f'"after/{fused}" [label="{fused} · level 2\\n128 B\\nreplaces {AR1}, {AR2}", '
            f'fillcolor="{fills[f"after/{fused}"]}"];') in lines
    # edges: four before (no transitive AR0 -> AR3), two after
    assert sum(line.startswith('"before/') and "->" in line for line in lines) == 4
    assert sum(line.startswith('"after/') and "->" in line for line in lines) == 2
    assert f'"after/{AR0}" -> "after/{fused}";' in lines
    assert f'"after/{fused}" -> "after/{AR3}";' in lines


def test_module_paths_and_layers():
    gm = layered(1)
    first = next(n for n in gm.graph.nodes if n.name == AR0)
    assert module_path(first) == "layers.0.attn" and layer_of("layers.0.attn") == "layers.0"
    first.meta["nn_module_stack"] = {"m": ("L['model']._modules['layers']._modules['3'].mlp", 0)}
    assert module_path(first) == "layers.3.mlp"
    assert layer_of("embed") == "embed" and layer_of("") == ""
    assert module_path(next(iter(gm.graph.nodes))) == ""  # a placeholder: no stack


def test_large_graph_collapses_per_layer():
    before_gm = layered(3)
    after_gm, _ = run_pipeline(before_gm, Config(strict=True))
    before = find_collective_dag(before_gm)
    after = find_collective_dag(after_gm, origins=before)
    # the fused all_reduces have no module stack: they take their originals' layer
    assert [n.layer for n in after.nodes] == ["layers.0", "layers.1", "layers.2"]
    panels = collective_picture(before, after, max_boxes=4)
    for p in panels:
        assert [b.id for b in p.boxes] == ["layers.0", "layers.1", "layers.2"]
        assert p.edges == [("layers.0", "layers.1"), ("layers.1", "layers.2")]
        assert p.title.endswith("one box per layer")
    before_boxes, after_boxes = (p.boxes for p in panels)
    assert before_boxes[0].lines == ("layers.0", "2 all_reduce", "128 B")
    assert after_boxes[0].lines == ("layers.0", "1 all_reduce", "64 B", "1 new, replacing 2")
    assert [b.colour for b in before_boxes] == [b.colour for b in after_boxes]
    assert len({b.colour for b in after_boxes}) == 3
    # below the threshold: one box per collective
    assert len(collective_picture(before, after)[0].boxes) == 6


def test_without_module_stacks_collapse_by_depth_ranges():
    b = GraphBuilder()
    h, w = b.input("x"), b.input("w")
    for _ in range(8):
        h = b.all_reduce(b.mm(h, w))
    dag = find_collective_dag(b.build(h))
    panel, _ = collective_picture(dag, dag, max_boxes=6)  # ranges of ceil(8 / (6 // 2)) = 3
    assert [x.id for x in panel.boxes] == ["depths 1–3", "depths 4–6", "depths 7–8"]
    assert [x.lines[1] for x in panel.boxes] == ["3 all_reduce", "3 all_reduce", "2 all_reduce"]
    assert panel.edges == [("depths 1–3", "depths 4–6"), ("depths 4–6", "depths 7–8")]
    with pytest.raises(ValueError, match="collapse must be one of"):
        collective_picture(dag, dag, collapse="per-module")


def _is_png(path) -> bool:
    return path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 1000


@needs_matplotlib
def test_matplotlib_draws_png_and_svg(tmp_path):
    panels = collective_picture(*bucketed())
    assert render_picture(panels, tmp_path / "c.png", "png", engine="matplotlib") == "matplotlib"
    assert _is_png(tmp_path / "c.png")
    render_picture(panels, tmp_path / "c.svg", "svg", title="diamond", engine="matplotlib")
    assert "<svg" in (tmp_path / "c.svg").read_text()[:1000]


@pytest.mark.skipif(shutil.which("dot") is None, reason="Graphviz dot not installed")
def test_graphviz_reads_the_dot_text(tmp_path):
    panels = collective_picture(*bucketed())
    assert render_picture(panels, tmp_path / "c.png", "png", engine="dot") == "dot"
    assert _is_png(tmp_path / "c.png")
