"""The README's torchrun example runs as written: two gloo ranks on CPU, exit 0, its lines."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "tp_parallel_block.py"


def run_torchrun(script: Path, *args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    """``torchrun --standalone --nproc-per-node 2 script`` (torchrun is ``torch.distributed.run``;
    ``--standalone`` takes a free port, so parallel runs do not meet on 29500)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           "--nproc-per-node", "2", str(script), *args]
    try:
        return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout,
                              env={**os.environ, "OMP_NUM_THREADS": "1"})
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"{' '.join(cmd)} ran past {timeout} s; its output:\n{e.stdout}\n{e.stderr}")


@pytest.mark.other_torch  # 52 s: CI runs it under the newest torch (.ci/tests-newest.txt)
def test_tp_parallel_block_example():
    proc = run_torchrun(EXAMPLE)
    assert proc.returncode == 0, f"exit {proc.returncode}:\n{proc.stdout}\n{proc.stderr}"
    lines = proc.stdout.splitlines()
    # rank 0 alone prints: one report summary per model, then one result line
    assert len([ln for ln in lines if ln.startswith("parallel blocks: ")]) == 1, proc.stdout
    assert len([ln for ln in lines if ln.startswith("sequential blocks: ")]) == 1, proc.stdout
    result = [ln for ln in lines if ln.startswith("result: ")]
    assert len(result) == 1, proc.stdout
    # 4 parallel blocks: two all_reduces each, summed into one; 4 sequential ones: a chain
    assert re.search(r"parallel blocks 8 -> 4, sequential blocks 8 -> 8;", result[0]), result[0]
    assert "output equal to plain torch.compile's on all 2 ranks" in result[0], result[0]
    # the README shows this run's output (the summaries may change wording: refresh them)
    shown = readme_example_output()
    mask = lambda line: re.sub(r"max abs diff [\d.e+-]+", "max abs diff X", line)  # noqa: E731
    assert [mask(ln) for ln in shown if ln.startswith("result: ")] == [mask(result[0])], \
        "README.md's example output is stale; paste the run's output:\n" + proc.stdout
    assert [ln.split(":")[0] for ln in shown] == [ln.split(":")[0] for ln in lines if ln], shown


def readme_example_output(marker: str = "<!-- example output") -> list[str]:
    """The fenced block after the README's ``marker``."""
    text = (ROOT / "README.md").read_text().split(marker, 1)[1]
    return text.split("```\n", 2)[1].splitlines()


HF_EXAMPLE = ROOT / "examples" / "hf_generate.py"


@pytest.mark.slow  # 2-4 min on 2 loaded cores; tests/test_hf_tp.py runs transformers' TP on
def test_hf_generate_example():  # 2 gloo ranks through fxcoalesce in the default run
    """transformers' generate() on 2 gloo ranks, model.forward compiled by fxcoalesce: the
    tokens equal eager's and plain torch.compile's on every rank (the example exits 1
    otherwise), each graph's parallel blocks summed, and the README shows this output."""
    pytest.importorskip("transformers")
    import importlib.util

    spec = importlib.util.spec_from_file_location("hf_generate", HF_EXAMPLE)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    layers = example.TINY["num_hidden_layers"]
    proc = run_torchrun(HF_EXAMPLE, "--rounds", "3", timeout=480)
    assert proc.returncode == 0, f"exit {proc.returncode}:\n{proc.stdout}\n{proc.stderr}"
    lines = proc.stdout.splitlines()
    graphs = [ln for ln in lines if ln.startswith("fxcoalesce[graph ")]
    # the prefill, the first decode step, and the decode step of dynamic length
    assert len(graphs) == 3, proc.stdout
    for line in graphs:  # the embedding's all_reduce, then attention + MLP summed per layer
        assert (f"all_reduce {1 + 2 * layers} -> {1 + layers} launches (lower bound "
                f"{1 + layers})") in line, line
        assert f"{layers} summed; reached the lower bound" in line, line
    result = [ln for ln in lines if ln.startswith("result: ")]
    assert len(result) == 1 and "tokens equal to eager and to plain torch.compile on all 2 " \
        "ranks" in result[0], proc.stdout
    assert re.search(r"^ms per token, median of 3 generate\(\) calls \(p10-p90\): torch.compile "
                     r"[\d.]+ ms \([\d.]+-[\d.]+\), fxcoalesce [\d.]+ ms", proc.stdout, re.M)
    shown = readme_example_output("<!-- hf example output")
    prefix = lambda line: " ".join(line.split()[:2])  # noqa: E731
    assert [prefix(ln) for ln in shown] == [prefix(ln) for ln in lines if ln], \
        "README.md's HF example output is stale; paste the run's output:\n" + proc.stdout
    assert [ln for ln in shown if ln.startswith("fxcoalesce[")] == graphs
