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

    def f(x, w):  # two independent all_reduces: one bucket
        return funcol.all_reduce(x @ w, "sum", group) + funcol.all_reduce(x + 1, "sum", group)

    be = fxcoalesce.backend(fxcoalesce.Config(codegen="eager"))
    torch.compile(f, backend=be, fullgraph=True)(torch.ones(4, 4), torch.ones(4, 4))
    print(fxcoalesce.reports()[-1].summary())
""")


@pytest.fixture(scope="module")
def compiled_with_env(tmp_path_factory):
    """One compile in a fresh process with FXCOALESCE_DUMP and TORCH_TRACE set."""
    tmp = tmp_path_factory.mktemp("env")
    env = {**os.environ, "FXCOALESCE_DUMP": str(tmp / "dump"), "TORCH_TRACE": str(tmp / "trace")}
    proc = subprocess.run([sys.executable, "-W", "ignore:Failed to initialize NumPy", "-c",
                           COMPILE_SCRIPT], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "all_reduce 2 -> 1 launches" in proc.stdout
    return tmp


def test_fxcoalesce_dump_writes_every_graph(compiled_with_env):
    # a process group of two ranks is up: each rank dumps under rank<R>/
    graphs = sorted((compiled_with_env / "dump" / "rank0").iterdir())
    assert [g.name for g in graphs] == ["graph_0"]
    assert sorted(p.name for p in graphs[0].iterdir()) == ["after.txt", "before.txt",
                                                           "report.json"]
    report = json.loads((graphs[0] / "report.json").read_text())
    assert (report["all_reduce"]["before"], report["all_reduce"]["after"]) == (2, 1)
    # the one new all_reduce, named as what it replaces, right above it
    FileCheck().check_count("# fxcoalesce: replaces", 1, exactly=True).check_next(
        "all_reduce").run((graphs[0] / "after.txt").read_text())


def test_torch_trace_holds_the_artifacts(compiled_with_env):
    logs = list((compiled_with_env / "trace").glob("*.log"))
    assert logs, "TORCH_TRACE wrote no log"
    names = []
    for line in Path(logs[0]).read_text().splitlines():
        if line.startswith("{") or '"artifact"' in line:
            record = json.loads(line[line.index("{"):])
            if "artifact" in record:
                names.append(record["artifact"]["name"])
    assert [n for n in names if n.startswith("fxcoalesce")] == list(ARTIFACTS)
