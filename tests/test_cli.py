"""The ``fxcoalesce`` command: bad input is refused in one line with exit status 2 before any
trace, model build or rank starts; a rank failing at run time is one line and status 1."""

import argparse
import json
import subprocess
import sys
import textwrap
import time

import pytest
import torch
from torch.testing import FileCheck

from fxcoalesce.apps import checks, cli, launch
from fxcoalesce.models import transformer

L = transformer.CONFIGS["neox-tiny"].n_layers
NO_CUDA = not torch.cuda.is_available()


def run_cli(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    # torch without numpy warns on import: the environment's noise, not the CLI's
    return subprocess.run([sys.executable, "-W", "ignore:Failed to initialize NumPy", "-m",
                           "fxcoalesce.apps.cli", *args],
                          capture_output=True, text=True, timeout=timeout)


BAD_INPUT = [  # (arguments, the one stderr line after "fxcoalesce <cmd>: error: ")
    (["inspect"], "--model is required (--list names the models)"),
    (["inspect", "--model", "no-such-model"], "unknown model 'no-such-model'; choose one of: "
     "llama-tiny, neox-tiny, llama-3-70b, falcon-40b, kimi-k2, deepseek-v3, kimi-k2-tiny, "
     "smollm2-135m"),
    (["inspect", "--model", "neox-tiny", "--tp", "0"], "--tp must be at least 1, not 0"),
    (["inspect", "--model", "neox-tiny", "--tp", "3"], "neox-tiny: tensor parallelism 3 does "
     "not divide the key/value heads (4); choose a TP degree that divides 4"),
    (["inspect", "--model", "neox-tiny", "--tokens", "0"], "--tokens must be at least 1, not 0"),
    (["inspect", "--model", "neox-tiny", "--layers", "0"], "--layers must be at least 1, not 0"),
    (["inspect", "--model", "neox-tiny", "--tp", "4", "--step", "verify"], "neox-tiny has no "
     "'verify' step (it needs a KV-cached model: kimi-k2, deepseek-v3, kimi-k2-tiny, "
     "smollm2-135m)"),
    (["inspect", "--model", "neox-tiny", "--bucket-cap-mb", "inf"],
     "--bucket-cap-mb: bucket_cap_mb must be a finite number > 0, not inf"),
    (["bench", "--model", "no-such-model"], "unknown model 'no-such-model'; choose one of: "
     "llama-tiny, neox-tiny, llama-3-70b, falcon-40b, kimi-k2, deepseek-v3, kimi-k2-tiny, "
     "smollm2-135m"),
    (["bench", "--tp", "0"], "--tp must be at least 1, not 0"),
    (["bench", "--tp", "3"], "neox-tiny: tensor parallelism 3 does not divide the key/value "
     "heads (4); choose a TP degree that divides 4"),
    (["bench", "--tokens", "0"], "--tokens must be at least 1, not 0"),
    (["bench", "--steps", "0"], "--steps must be at least 1, not 0"),
    (["bench", "--warmup", "-1"], "--warmup must be at least 0, not -1"),
    (["demo", "--tp", "3"], "kimi-k2-tiny: tensor parallelism 3 does not divide the attention "
     "heads (n_heads) (8); choose a TP degree that divides 8"),
    (["demo", "--tp", "0"], "--tp must be at least 1, not 0"),
    (["demo", "--tokens", "0"], "--tokens must be at least 2, not 0 (the first new token comes "
     "from the prefill, the others from verify steps)"),
    (["demo", "--model", "neox-tiny"], "neox-tiny has no 'verify' step (it needs a KV-cached "
     "model: kimi-k2, deepseek-v3, kimi-k2-tiny, smollm2-135m)"),
]
NEEDS_NO_CUDA = [
    (["bench", "--device", "cuda"], "--device cuda: torch sees no CUDA GPU (use --device cpu)"),
    (["demo", "--device", "cuda"], "--device cuda: torch sees no CUDA GPU (use --device cpu)"),
    (["bench", "--backend", "nccl"], "--backend nccl: torch sees no CUDA GPU, and NCCL needs "
     "one per rank (use --backend gloo)"),
    (["demo", "--backend", "nccl"], "--backend nccl: torch sees no CUDA GPU, and NCCL needs "
     "one per rank (use --backend gloo)"),
]


def assert_refused(proc: subprocess.CompletedProcess, cmd: str, message: str) -> None:
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.splitlines() == [f"fxcoalesce {cmd}: error: {message}"]
    assert proc.stdout == ""  # no table, no "starting N ranks", no trace output


@pytest.mark.parametrize("args, message", BAD_INPUT + [
    pytest.param(*case, marks=pytest.mark.skipif(not NO_CUDA, reason="CUDA is available"))
    for case in NEEDS_NO_CUDA], ids=lambda v: " ".join(v) if isinstance(v, list) else "")
def test_bad_input_is_one_line_and_exit_2(args, message):
    t0 = time.monotonic()
    proc = run_cli(*args)
    assert_refused(proc, args[0], message)
    assert "starting" not in proc.stderr
    assert time.monotonic() - t0 < 15  # only the checks ran: no rank, no trace


@pytest.mark.parametrize("make, args, message", [
    ("file", ["inspect", "--model", "neox-tiny", "--out", "{p}"],
     "--out {p} is a file; inspect writes a directory (report.json, before.txt, after.txt)"),
    ("file", ["inspect", "--model", "neox-tiny", "--out", "{p}/sub"],
     "--out {p}/sub: {p} is a file, not a directory"),
    ("file", ["bench", "--out", "{p}"],
     "--out {p} is a file; bench writes a directory (bench.json, bench.md, bench.png)"),
    ("file", ["demo", "--out", "{p}"], "--out {p} is a file; demo writes a directory (demo.json)"),
])
def test_out_in_the_way_is_refused_before_the_work(tmp_path, make, args, message):
    """Regression: inspect --out naming a file failed only after the whole trace."""
    p = tmp_path / "taken"
    p.write_text("") if make == "file" else p.mkdir()
    proc = run_cli(*(a.format(p=p) for a in args))
    assert_refused(proc, args[0], message.format(p=p))


@pytest.mark.parametrize("args, gpus, message", [
    (["--backend", "nccl", "--device", "cuda", "--tp", "4"], 2,
     "--backend nccl needs a GPU per rank: --tp 4, but torch sees 2 (use --backend gloo to "
     "share them)"),
    (["--backend", "nccl", "--tp", "2"], 2,
     "--backend nccl needs --device cuda (NCCL reduces GPU tensors only)"),
])
@pytest.mark.parametrize("cmd", ["bench", "demo"])
def test_nccl_needs_a_gpu_per_rank(monkeypatch, capsys, cmd, args, gpus, message):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
    assert cli.main([cmd, *args]) == 2
    assert capsys.readouterr().err == f"fxcoalesce {cmd}: error: {message}\n"


def test_default_backend_is_nccl_only_with_a_gpu_per_rank(monkeypatch):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert launch.default_backend("cuda", 2) == "nccl"
    assert launch.default_backend("cuda", 4) == "gloo"  # ranks share GPUs through the host
    assert launch.default_backend("cpu", 2) == "gloo"


def test_help_and_argument_errors_do_not_import_torch():
    """Regression: --help took 11-25 s because it imported torch first."""
    script = textwrap.dedent("""
        import contextlib, io, sys
        from fxcoalesce.apps import cli
        for cmd in ("inspect", "bench", "demo"):
            with contextlib.redirect_stdout(io.StringIO()):
                try:
                    cli.parser().parse_args([cmd, "--help"])
                except SystemExit as e:
                    assert e.code == 0, (cmd, e.code)
        with contextlib.redirect_stderr(io.StringIO()):
            assert cli.main(["bench", "--tp", "0"]) == 2
        print(sorted(m for m in sys.modules if m.split(".")[0] == "torch"))
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == "[]\n"


@pytest.mark.parametrize("cmd", ["inspect", "bench", "demo"])
def test_every_option_has_help(cmd):
    sub = next(a for a in cli.parser()._actions if isinstance(a, argparse._SubParsersAction))
    assert all(a.help for a in sub.choices[cmd]._actions), cmd


def test_failed_rank_is_one_line_and_exit_1(monkeypatch, capsys):
    """A rank's exception comes back as its type and first line; -v adds its traceback."""
    tb = "Traceback (most recent call last):\n  File \"x.py\", line 1\nValueError: boom\n"

    def spawn(*args, **kwargs):
        raise launch.RankError(1, "ValueError", "boom\nmore detail", tb)

    monkeypatch.setattr(launch, "spawn", spawn)
    assert cli.main(["bench"]) == 1
    assert capsys.readouterr().err.splitlines()[-1:] == [
        "fxcoalesce bench: error: rank 1: ValueError: boom "
        "(fxcoalesce -v bench ... shows its traceback)"]
    assert cli.main(["-v", "bench"]) == 1
    err = capsys.readouterr().err
    assert tb in err and err.endswith("fxcoalesce bench: error: rank 1: ValueError: boom\n")


def test_inspect_writes_report(tmp_path):
    proc = run_cli("inspect", "--model", "neox-tiny", "--tp", "4", "--out", str(tmp_path),
                   timeout=300)
    assert proc.returncode == 0, proc.stderr
    rep = json.loads((tmp_path / "report.json").read_text())
    assert (rep["model"], rep["world_size"], rep["tokens"]) == ("neox-tiny", 4, 3)
    assert rep["all_reduce"]["after"] == rep["all_reduce"]["lower_bound"] == 1 + L
    assert {"name", "ms"} <= rep["passes"][0].keys()
    # before: the 1 + 2L all_reduces of the traced graph; after: one per layer + the embedding's
    FileCheck().check_count("all_reduce.default(", 1 + 2 * L, exactly=True).run(
        (tmp_path / "before.txt").read_text())
    FileCheck().check_count("all_reduce.default(", 1 + L, exactly=True).run(
        (tmp_path / "after.txt").read_text())
