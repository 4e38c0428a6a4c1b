"""The ``fxcoalesce`` command: bad input is refused in one line with exit status 2 before any
trace, model build or rank starts; a rank failing at run time is one line and status 1."""

import argparse
import json
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from torch.testing import FileCheck

from fxcoalesce.apps import checks, cli, launch
from fxcoalesce.models import transformer

L = transformer.CONFIGS["neox-tiny"].n_layers
NO_CUDA = not torch.cuda.is_available()
GiB = checks.GiB


def run_cli(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    # torch without numpy warns on import: the environment's noise, not the CLI's
    return subprocess.run([sys.executable, "-W", "ignore:Failed to initialize NumPy", "-m",
                           "fxcoalesce.apps.cli", *args],
                          capture_output=True, text=True, timeout=timeout)


BAD_INPUT = [  # (arguments, the one stderr line after "fxcoalesce <cmd>: error: ")
    (["inspect"], "--model or --hf is required (--list names the zoo's models)"),
    (["inspect", "--model", "no-such-model"], "unknown model 'no-such-model'; choose one of: "
     "llama-tiny, neox-tiny, llama-3-70b, falcon-40b, kimi-k2, deepseek-v3, kimi-k2-tiny, "
     "smollm2-135m, llama-3-8b"),
    (["inspect", "--model", "neox-tiny", "--tp", "0"], "--tp must be at least 1, not 0"),
    (["inspect", "--model", "neox-tiny", "--tp", "3"], "neox-tiny: tensor parallelism 3 does "
     "not divide the key/value heads (4); choose a TP degree that divides 4"),
    (["inspect", "--model", "neox-tiny", "--tokens", "0"], "--tokens must be at least 1, not 0"),
    (["inspect", "--model", "neox-tiny", "--layers", "0"], "--layers must be at least 1, not 0"),
    (["inspect", "--model", "neox-tiny", "--tp", "4", "--step", "verify"], "neox-tiny has no "
     "'verify' step (it needs a KV-cached model: kimi-k2, deepseek-v3, kimi-k2-tiny, "
     "smollm2-135m, llama-3-8b)"),
    (["inspect", "--model", "llama-tiny", "--tp", "4", "--hand-merged"], "--hand-merged: "
     "llama-tiny has sequential blocks (each all_reduce feeds the next block), so there is "
     "nothing to merge by hand; models with hand-merged code: neox-tiny, falcon-40b, kimi-k2, "
     "deepseek-v3, kimi-k2-tiny"),  # regression: failed after the "tracing" line
    (["inspect", "--model", "neox-tiny", "--bucket-cap-mb", "inf"],
     "--bucket-cap-mb: bucket_cap_mb must be a finite number > 0, not inf"),
    (["bench", "--model", "no-such-model"], "unknown model 'no-such-model'; choose one of: "
     "llama-tiny, neox-tiny, llama-3-70b, falcon-40b, kimi-k2, deepseek-v3, kimi-k2-tiny, "
     "smollm2-135m, llama-3-8b"),
    (["bench", "--tp", "0"], "--tp must be at least 1, not 0"),
    (["bench", "--tp", "3"], "neox-tiny: tensor parallelism 3 does not divide the key/value "
     "heads (4); choose a TP degree that divides 4"),
    (["bench", "--tokens", "0"], "--tokens must be at least 1, not 0"),
    (["bench", "--steps", "0"], "--steps must be at least 1, not 0"),
    (["bench", "--warmup", "-1"], "--warmup must be at least 0, not -1"),
    (["demo", "--tp", "3"], "neox-tiny: tensor parallelism 3 does not divide the key/value "
     "heads (4); choose a TP degree that divides 4"),  # the first part's model
    (["demo", "--tp", "0"], "--tp must be at least 1, not 0"),
    (["demo", "--tokens", "0"], "--tokens must be at least 2, not 0 (the first new token comes "
     "from the prefill, the others from verify steps)"),
    # regression: killed for memory after 42 s
    (["calibrate", "--max-bytes", "1e30", "--out", "p.json"], "--max-bytes 1e30: at most 1G "
     "(every rank holds a buffer of each size up to it at once, 3.5 GiB at 1G; the largest "
     "bucket fxcoalesce makes by default is 512 MB)"),
    # regression: argparse's "expected one argument"
    (["calibrate", "--max-bytes", "-5M", "--out", "p.json"],
     "--max-bytes must be positive, not -5M"),
    (["calibrate", "--max-bytes=-5M", "--out", "p.json"], "--max-bytes must be positive, not -5M"),
    (["calibrate", "--max-bytes", "5X", "--out", "p.json"],
     "--max-bytes 5X: not a byte count (e.g. 64M, 16K or 1024)"),
    # regression: the ranks started, then each raised OverflowError
    (["calibrate", "--budget", "inf", "--out", "p.json"], "--budget must be finite, not inf"),
]
NEEDS_NO_CUDA = [
    (["bench", "--device", "cuda"], "--device cuda: torch sees no CUDA GPU (use --device cpu)"),
    (["demo", "--device", "cuda"], "--device cuda: torch sees no CUDA GPU (use --device cpu)"),
    (["bench", "--backend", "nccl"], "--backend nccl: torch sees no CUDA GPU, and NCCL needs "
     "one per rank (use --backend gloo)"),
    (["demo", "--backend", "nccl"], "--backend nccl: torch sees no CUDA GPU, and NCCL needs "
     "one per rank (use --backend gloo)"),
]


WAYS = ("in-process", "subprocess")
"""How a refusal is run: ``cli.main`` in this process (no rank may start; milliseconds), or
``python -m fxcoalesce.apps.cli`` (its one stderr line is all the process prints; 5-15 s on a
loaded 2-core machine, so only each family's first case runs this way by default, the others
with ``-m slow``)."""


def both_ways(cases: list) -> list:
    """Each case in process and as a process (the first case's process in the default run)."""
    out = []
    for i, case in enumerate(cases):
        values, marks = (case.values, list(case.marks)) if hasattr(case, "values") else (case, [])
        out.append(pytest.param(WAYS[0], *values, marks=marks))
        out.append(pytest.param(WAYS[1], *values,
                                marks=marks + ([pytest.mark.slow] if i else [])))
    return out


def way_id(v) -> str:
    return " ".join(v) if isinstance(v, list) else (v if v in WAYS else "")


def refuse(way: str, monkeypatch, capsys, *args: str) -> subprocess.CompletedProcess:
    """The command's exit status and output, run ``way``."""
    if way == "subprocess":
        return run_cli(*args)
    monkeypatch.setattr(launch, "spawn", lambda *a, **k: pytest.fail("a rank was started"))
    try:
        rc = cli.main(list(args))
    except SystemExit as e:  # argparse's own refusals
        rc = e.code
    out = capsys.readouterr()
    return subprocess.CompletedProcess(list(args), rc, out.out, out.err)


def assert_refused(proc: subprocess.CompletedProcess, cmd: str, message: str) -> None:
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.splitlines() == [f"fxcoalesce {cmd}: error: {message}"]
    assert proc.stdout == ""  # no table, no "starting N ranks", no trace output


@pytest.mark.parametrize("way, args, message", both_ways(BAD_INPUT + [
    pytest.param(*case, marks=pytest.mark.skipif(not NO_CUDA, reason="CUDA is available"))
    for case in NEEDS_NO_CUDA]), ids=way_id)
def test_bad_input_is_one_line_and_exit_2(monkeypatch, capsys, way, args, message):
    proc = refuse(way, monkeypatch, capsys, *args)
    assert_refused(proc, args[0], message)  # its one line is all it printed: no rank, no trace
    assert "starting" not in proc.stderr


@pytest.mark.parametrize("way, make, args, message", both_ways([
    ("file", ["inspect", "--model", "neox-tiny", "--out", "{p}"],
     "--out {p} is a file; inspect writes a directory (report.json, before.txt, after.txt)"),
    ("file", ["inspect", "--model", "neox-tiny", "--out", "{p}/sub"],
     "--out {p}/sub: {p} is a file, not a directory"),
    ("file", ["bench", "--out", "{p}"],
     "--out {p} is a file; bench writes a directory (bench.json, bench.md, bench.png)"),
    ("file", ["demo", "--out", "{p}"], "--out {p} is a file; demo writes a directory (demo.json)"),
]), ids=way_id)
def test_out_in_the_way_is_refused_before_the_work(monkeypatch, capsys, tmp_path, way, make,
                                                   args, message):
    """Regression: inspect --out naming a file failed only after the whole trace."""
    p = tmp_path / "taken"
    p.write_text("") if make == "file" else p.mkdir()
    proc = refuse(way, monkeypatch, capsys, *(a.format(p=p) for a in args))
    assert_refused(proc, args[0], message.format(p=p))



UNWRITABLE = "/proc/fxcoalesce-out"  # procfs takes no new entries, even from root


@pytest.mark.skipif(not Path("/proc/self").is_dir(), reason="needs Linux's /proc")
@pytest.mark.parametrize("way, args, message", both_ways([
    (["inspect", "--model", "neox-tiny", "--tp", "4", "--out", UNWRITABLE],
     f"--out {UNWRITABLE}: cannot write into /proc (No such file or directory)"),
    (["bench", "--out", f"{UNWRITABLE}/sub"],
     f"--out {UNWRITABLE}/sub: cannot write into /proc (No such file or directory)"),
    (["calibrate", "--out", f"{UNWRITABLE}.json"],
     f"--out {UNWRITABLE}.json: cannot write into /proc (No such file or directory)"),
    (["train-draft", "--out", UNWRITABLE],
     f"--out {UNWRITABLE}: cannot write into /proc (No such file or directory)"),
]), ids=way_id)
def test_unwritable_out_is_refused_before_the_work(monkeypatch, capsys, way, args, message):
    """Regression: inspect printed its table, then a 35-line FileNotFoundError."""
    assert_refused(refuse(way, monkeypatch, capsys, *args), args[0], message)


@pytest.mark.parametrize("way, args, message", both_ways([
    (["inspect", "--model", "neox-tiny", "--tp", "4"], "a directory (inspect writes "
     "report.json, before.txt, after.txt into it)"),
    (["bench"], "a directory (bench writes bench.json, bench.md, bench.png into it)"),
    (["demo"], "a directory (demo writes demo.json into it)"),
    (["calibrate"], "a file (calibrate writes one JSON file)"),
]), ids=way_id)
def test_empty_out_is_refused(monkeypatch, capsys, way, args, message):
    """Regression: ``inspect --out ""`` traced, printed its table and wrote nothing."""
    assert_refused(refuse(way, monkeypatch, capsys, *args, "--out", ""), args[0],
                   f"--out is empty; give {message}")

@pytest.mark.parametrize("args, gpus, message", [
    (["--backend", "nccl", "--device", "cuda", "--tp", "4"], 2,
     "--backend nccl needs a GPU per rank: --tp 4, but torch sees 2 (use --tp 2)"),
    (["--backend", "nccl", "--tp", "2"], 2,
     "--backend nccl needs --device cuda (NCCL reduces GPU tensors only)"),
])
@pytest.mark.parametrize("cmd", ["bench", "demo"])
def test_nccl_needs_a_gpu_per_rank(monkeypatch, capsys, cmd, args, gpus, message):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
    assert cli.main([cmd, *args]) == 2
    assert capsys.readouterr().err == f"fxcoalesce {cmd}: error: {message}\n"


GLOO_CUDA = ("gloo's functional all_gather of CUDA tensors, which the model's output head "
             "issues, kills the ranks with SIGSEGV (torch 2.11)")


@pytest.mark.parametrize("args, message", [
    (["--device", "cuda", "--backend", "gloo", "--tp", "2"], "--backend gloo with --device "
     f"cuda: {GLOO_CUDA}; use --backend nccl with a GPU per rank (torch sees 1), or --device "
     "cpu"),
    (["--device", "cuda", "--tp", "2"], "--device cuda --tp 2 on 1 GPU means gloo ranks (NCCL "
     f"needs a GPU per rank), but {GLOO_CUDA}; use --tp 1 or --device cpu"),
])
@pytest.mark.parametrize("cmd", ["bench", "demo"])
def test_gloo_on_cuda_is_refused_before_spawning(monkeypatch, capsys, cmd, args, message):
    """Regression: on one GPU both ranks died with SIGSEGV in the eager warm-up's all_gather."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(launch, "spawn", lambda *a, **k: pytest.fail("a rank was started"))
    assert cli.main([cmd, *args]) == 2
    assert capsys.readouterr().err == f"fxcoalesce {cmd}: error: {message}\n"


def test_calibrate_may_run_gloo_on_cuda(monkeypatch, tmp_path):
    """calibrate only all_reduces, which gloo does on CUDA tensors (host-staged)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda i=0: (100 * GiB, 140 * GiB))
    args = cli.parser().parse_args(["calibrate", "--device", "cuda", "--backend", "gloo",
                                    "--out", str(tmp_path / "p.json")])
    checks.check_calibrate(args)  # no ValueError


@pytest.mark.parametrize("backend, captured", [("gloo", False), ("nccl", True)])
def test_calibrate_captures_cuda_graphs_with_nccl_only(monkeypatch, backend, captured):
    """Regression: gloo on CUDA failed its capture, then every rank raised "Offset increment
    outside graph capture encountered unexpectedly" (torch 2.11, one H200)."""
    from fxcoalesce.apps.bench.calibrate import run_calibrate

    def spawn(fn, world, args, **kwargs):
        raise launch.RankError(0, "Stop", f"cudagraphs={args[2]}")

    monkeypatch.setattr(launch, "spawn", spawn)
    args = argparse.Namespace(backend=backend, device="cuda", tp=2, max_bytes=1024,
                              no_cudagraphs=False, budget=0.1, nccl_mode="nvlink")
    with pytest.raises(launch.RankError, match=f"cudagraphs={captured}"):
        run_calibrate(args)


@pytest.mark.parametrize("device, message", [
    ("cpu", "2 ranks need about 8.0 GiB but 6.0 GiB is free"),
    ("cuda", "each GPU (2 ranks) needs about 9.0 GiB but 6.0 GiB is free"),
])
def test_calibrate_buffers_must_fit(monkeypatch, capsys, tmp_path, device, message):
    """Every size up to --max-bytes is held at once on every rank: 3.5 GiB at 1G."""
    monkeypatch.setattr(checks, "_mem_available", lambda: 6 * GiB)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda i=0: (6 * GiB, 8 * GiB))
    out = str(tmp_path / "p.json")
    assert cli.main(["calibrate", "--device", device, "--max-bytes", "1G", "--out", out]) == 2
    assert capsys.readouterr().err == (
        "fxcoalesce calibrate: error: --max-bytes 1G: every rank holds each size up to it at "
        f"once, 3.5 GiB; {message} (use a smaller --max-bytes)\n")


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


def test_help_is_plain_text():
    """Regression: ``--help`` showed the module docstring's RST (````fxcoalesce````)."""
    p = cli.parser()
    sub = next(a for a in p._actions if isinstance(a, argparse._SubParsersAction))
    for name, text in [("fxcoalesce", p.format_help())] + [
            (cmd, parser.format_help()) for cmd, parser in sub.choices.items()]:
        assert "`" not in text, name


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
    # regression: report.json ended without a newline: the next output landed on its last line
    for name in ("report.json", "before.txt", "after.txt"):
        assert (tmp_path / name).read_text().endswith("\n"), name
    assert proc.stdout.endswith(f"wrote {tmp_path}/report.json, before.txt, after.txt\n")
    # the prediction says its model is the uncalibrated default, on the fake tensors' CPU
    assert "from the default model (uncalibrated: a ring over PCIe" in proc.stdout
    # progress on stderr: what is traced (its depth) and, after, how long it took
    assert f"tracing neox-tiny forward at TP 4 ({L} layers, 3 tokens)" in proc.stderr
    assert re.search(r"\n  traced in \d+\.\d s\n", proc.stderr), proc.stderr


def test_quiet_prints_no_progress():
    proc = run_cli("-q", "inspect", "--model", "neox-tiny", "--tp", "2", "--layers", "1",
                   timeout=300)
    assert proc.returncode == 0 and "all_reduce launches" in proc.stdout
    assert "tracing" not in proc.stderr and "traced in" not in proc.stderr, proc.stderr


def _imports(path: Path, package: str) -> set[str]:
    """The modules of ``package`` that the file ``path`` imports, at its top or in a function."""
    import ast

    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names |= {node.module} | {f"{node.module}.{a.name}" for a in node.names}
        elif isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
    return {n for n in names if n.startswith(package + ".")}


def test_the_tools_import_no_circle():
    """Regression: checks imported tour (the main job's model) and tour imported checks (its
    backend and prompt), each inside a function. No module of fxcoalesce.apps reaches
    itself again through the modules it imports, at their top or inside a function."""
    root = Path(cli.__file__).resolve().parents[1]  # fxcoalesce/
    modules = {}
    for path in (root / "apps").rglob("*.py"):
        parts = path.relative_to(root.parent).with_suffix("").parts
        modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    edges = {m: _imports(p, "fxcoalesce.apps") & modules.keys() - {m}
             for m, p in modules.items()}

    def reaches(start: str) -> set[str]:
        seen, todo = set(), [start]
        while todo:
            for n in edges[todo.pop()] - seen:
                seen.add(n)
                todo.append(n)
        return seen

    circles = sorted(m for m in modules if m in reaches(m))
    assert circles == [], circles
    assert "fxcoalesce.apps.demo" not in reaches("fxcoalesce.apps.checks")
