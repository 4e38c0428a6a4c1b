"""What the pipeline leaves to look at: notes in after.txt, ``FXCOALESCE_DUMP`` directories
and structured-trace artifacts for tlparse (the environment variables in a subprocess)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from graphs import diamond
from torch.testing import FileCheck

import fxcoalesce.pipeline as pipeline
from fxcoalesce import Config, run_pipeline
from fxcoalesce.pipeline import graph_text
from fxcoalesce.viz.draw import renderer

ARTIFACTS = ("fxcoalesce_before", "fxcoalesce_after", "fxcoalesce_report",
             "fxcoalesce_collectives")



def test_after_text_names_what_each_new_collective_replaces():
    before = diamond()
    after, report = run_pipeline(before, Config(passes=("bucket",), strict=True))
    (bucket,) = report.buckets
    lines = graph_text(after).splitlines()
    notes = [i for i, line in enumerate(lines) if "# fxcoalesce: replaces" in line]
    assert len(notes) == 1
    note, node = lines[notes[0]], lines[notes[0] + 1]
    assert note.strip() == f"# fxcoalesce: replaces {', '.join(bucket['members'])}"
    # right above the new collective's own line, at its indentation
    assert node.lstrip().startswith(f"{bucket['collective']}: ")
    assert len(note) - len(note.lstrip()) == len(node) - len(node.lstrip())
    assert "# fxcoalesce" not in graph_text(before)


def test_a_picture_that_cannot_be_drawn_is_a_warning(tmp_path, monkeypatch, caplog):
    """The dump is a debugging aid: a renderer that fails must not fail the compile; the DOT
    text is written whatever draws it."""
    import fxcoalesce.viz.draw as draw

    def broken(*args, **kwargs):
        raise RuntimeError("no fonts")

    monkeypatch.setattr(draw, "renderer", lambda: "matplotlib")
    monkeypatch.setattr(draw, "render_picture", broken)
    run_pipeline(diamond(), Config(dump_dir=str(tmp_path)), name="g")
    assert sorted(p.name for p in (tmp_path / "g").iterdir()) == [
        "after.txt", "before.txt", "collectives.dot", "report.json"]
    assert "collectives.png not drawn: RuntimeError: no fonts" in caplog.text
    monkeypatch.setattr(draw, "renderer", lambda: None)  # nothing to draw with: DOT alone
    run_pipeline(diamond(), Config(dump_dir=str(tmp_path)), name="h")
    assert not (tmp_path / "h" / "collectives.png").exists()
    assert (tmp_path / "h" / "collectives.dot").read_text().startswith("digraph fxcoalesce {")


def test_trace_payloads_are_not_built_when_tracing_is_off(monkeypatch):
    from torch._logging._internal import trace_log

    # tracing off: the trace logger has no handlers (pytest's log capture adds some)
    monkeypatch.setattr(trace_log, "handlers", [])
    built = []
    monkeypatch.setattr(pipeline, "graph_text", lambda gm: built.append(gm) or "")
    run_pipeline(diamond(), Config())
    assert built == []


COMPILE_SCRIPT = textwrap.dedent("""
    import torch
    import torch.distributed._functional_collectives as funcol
    import fxcoalesce
    from fxcoalesce.apps.launch import init_fake_group

    group = init_fake_group(2)

    class Half(torch.nn.Module):  # a row-parallel half: its partial sum all_reduced
        def __init__(self):
            super().__init__()
            self.proj = torch.nn.Linear(4, 4)

        def forward(self, x):
            return funcol.all_reduce(self.proj(x), "sum", group)

    class Block(torch.nn.Module):  # attention and MLP in parallel: one summed all_reduce
        def __init__(self):
            super().__init__()
            self.attn, self.mlp = Half(), Half()

        def forward(self, x):
            return x + self.attn(x) + self.mlp(x)

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = torch.nn.ModuleList([Block()])

        def forward(self, x):
            return self.blocks[0](x)

    model = Model()
    be = fxcoalesce.backend(fxcoalesce.Config(codegen="eager"))
    with torch.no_grad():
        torch.compile(model, backend=be, fullgraph=True)(torch.ones(4, 4))
    print(fxcoalesce.reports()[-1].summary())
""")


@pytest.fixture(scope="module")
def compiled_with_env(tmp_path_factory):
    """One compile of a user's script in a fresh process with FXCOALESCE_DUMP and
    TORCH_TRACE set; returns (the directory, the script, what it printed)."""
    tmp = tmp_path_factory.mktemp("env")
    script = tmp / "user_model.py"
    script.write_text(COMPILE_SCRIPT)
    env = {**os.environ, "FXCOALESCE_DUMP": str(tmp / "dump"), "TORCH_TRACE": str(tmp / "trace")}
    proc = subprocess.run([sys.executable, "-W", "ignore:Failed to initialize NumPy",
                           str(script)], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "all_reduce 2 -> 1 launches" in proc.stdout
    return tmp, script, proc.stdout


def test_fxcoalesce_dump_writes_every_graph(compiled_with_env):
    tmp, _, printed = compiled_with_env
    # a process group of two ranks is up: each rank dumps under rank<R>/
    graphs = sorted((tmp / "dump" / "rank0").iterdir())
    assert [g.name for g in graphs] == ["graph_0"]
    drawn = ["collectives.png"] if renderer() else []
    assert sorted(p.name for p in graphs[0].iterdir()) == sorted(
        ["after.txt", "before.txt", "collectives.dot", "report.json", *drawn])
    report = json.loads((graphs[0] / "report.json").read_text())
    assert (report["all_reduce"]["before"], report["all_reduce"]["after"]) == (2, 1)
    # the merge in the user's module names, FX names beside them, in every place it is told
    (bucket,) = report["buckets"]
    assert bucket["kind"] == "sum" and bucket["modules"] == ["blocks.0.attn", "blocks.0.mlp"]
    assert report["modules"] == {o: m for o, m in zip(bucket["originals"], bucket["modules"])}
    assert (f"blocks.0.attn + blocks.0.mlp -> one all_reduce, summed  [all_reduce + "
            f"all_reduce_1 -> {bucket['collective']}]") in printed
    # the one new all_reduce, named as what it replaces, right above it
    FileCheck().check_count(
        "# fxcoalesce: replaces all_reduce (blocks.0.attn), all_reduce_1 (blocks.0.mlp)", 1,
        exactly=True).check_next("all_reduce").run((graphs[0] / "after.txt").read_text())
    # the picture of the user's graph: its boxes carry the module paths
    dot = (graphs[0] / "collectives.dot").read_text()
    assert "blocks.0.attn" in dot and "replaces all_reduce, all_reduce_1" in dot


def test_before_txt_locations_point_at_the_users_line(compiled_with_env):
    """Regression: the comment above each all_reduce named torch's
    ``_functional_collectives.py``, where every funcol collective is made."""
    tmp, script, _ = compiled_with_env
    text = (tmp / "dump" / "rank0" / "graph_0" / "before.txt").read_text()
    locations = [line for line in text.splitlines() if "# File:" in line]
    assert locations and not any("_functional_collectives" in line for line in locations)
    # the comment in force at each all_reduce: the user's call of funcol.all_reduce
    where = None
    seen = 0
    for line in text.splitlines():
        if "# File:" in line:
            where = line
        elif "_c10d_functional.all_reduce" in line:
            seen += 1
            assert f"File: {script}:" in where and "code: return funcol.all_reduce(" in where
    assert seen == 2


def test_torch_trace_holds_the_artifacts(compiled_with_env):
    logs = list((compiled_with_env[0] / "trace").glob("*.log"))
    assert logs, "TORCH_TRACE wrote no log"
    names = []
    for line in Path(logs[0]).read_text().splitlines():
        if line.startswith("{") or '"artifact"' in line:
            record = json.loads(line[line.index("{"):])
            if "artifact" in record:
                names.append(record["artifact"]["name"])
    assert [n for n in names if n.startswith("fxcoalesce")] == list(ARTIFACTS)
