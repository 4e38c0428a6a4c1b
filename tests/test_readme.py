"""The README stays short, its links resolve, and the commands it shows work as written.

Every shell line in the README's code blocks is either run here (the cheap ones), run by
another test (named below), or listed as too long for the default run; a new command that is
none of these fails ``test_every_readme_command_is_accounted_for``.
"""

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = sorted((ROOT / "docs").glob("*.md"))
CLI = [sys.executable, "-m", "fxcoalesce.apps.cli"]

# run here, each with lines the README shows from its output (None: exit 0 is the check)
CHEAP = {
    "fxcoalesce --help": None,
    "fxcoalesce inspect --list": None,
    "fxcoalesce inspect --model neox-tiny --tp 4": [
        "all_reduce launches  9 -> 5  (lower bound 5)",
        "all_reduce bytes     3456 -> 1986  (1920 + 66 of the run-time check)",
        "verdict              reached the lower bound"],
}
SLOW = {  # run by test_slow_readme_commands (pytest -m slow)
    "fxcoalesce inspect --model kimi-k2 --tp 8 --step verify": [
        "all_reduce launches  183 -> 123  (lower bound 123)",
        "all_reduce bytes     7870464 -> 5289984"],
}
CPU_ROUTE = ("python3 -m venv {venv} && {venv}/bin/pip install 'torch>=2.11' "
             "--index-url https://download.pytorch.org/whl/cpu")
"""The README's CPU-only route: PyTorch's CPU wheel into the venv before the set-up command."""
ELSEWHERE = {  # run in full by another test or script; here their options are parsed
    "python3 -m venv .venv-run && .venv-run/bin/pip install -e . && .venv-run/bin/fxcoalesce demo":
        ".ci/run",
    "python3 -m venv .venv && .venv/bin/pip install -q -e '.[dev]' && .venv/bin/python -m pytest -q":
        ".ci/run",
    CPU_ROUTE.format(venv=".venv-run"): "by hand (PyTorch's CPU wheel index; "
        "test_cpu_route_takes_the_torch_the_package_admits)",
    CPU_ROUTE.format(venv=".venv"): "by hand (as above)",
    ".venv-run/bin/torchrun --standalone --nproc-per-node 2 examples/tp_parallel_block.py":
        "tests/test_examples.py",
    "fxcoalesce bench --model neox-tiny --tp 2": "by hand (3 min 17 s on 2 shared cores)",
    "fxcoalesce calibrate --tp 2 --out profile.json": "by hand (53 s on 2 cores, 2026-12-01)",
    "fxcoalesce demo": ".ci/run",
    ".venv/bin/torchrun --standalone --nproc-per-node 2 examples/hf_generate.py":
        "tests/test_examples.py (slow)",
    "fxcoalesce inspect --hf cohere --tp 8": "tests/test_inspect_doors.py (slow)",
    "fxcoalesce inspect --hf deepseek_v3 --tp 8": "tests/test_inspect_doors.py (slow)",
    "fxcoalesce inspect --model my_model.py:make --tp 8":
        "tests/test_inspect_doors.py (a factory written in a temporary directory)",
}


def readme_text() -> str:
    return README.read_text()


def code_blocks(text: str) -> list[tuple[str, list[str]]]:
    """(language, lines) of every fenced block."""
    return [(m.group(1), m.group(2).splitlines())
            for m in re.finditer(r"^```(\w*)\n(.*?)^```", text, re.S | re.M)]


def shell_commands(text: str) -> list[str]:
    """Each command line of the README's shell blocks, without its trailing comment."""
    prefixes = ("fxcoalesce ", "python3 ", ".venv", "torchrun", "bash ", "FXCOALESCE_")
    found = []
    for lang, lines in code_blocks(text):
        if lang not in ("", "bash", "sh"):
            continue
        for line in lines:
            if line.startswith(prefixes):
                found.append(line.split("  #")[0].strip())
    return found


def test_readme_is_short():
    n = len(readme_text().splitlines())
    assert n <= 300, f"README.md has {n} lines; the reference belongs in docs/"


def test_prose_lines_are_at_most_100_characters():
    long = []
    for path in [README, *DOCS]:
        fence = False
        for i, line in enumerate(path.read_text().splitlines(), 1):
            if line.startswith("```"):
                fence = not fence
            elif not fence and not line.startswith(("|", "![")) and len(line) > 100:
                long.append(f"{path.relative_to(ROOT)}:{i} ({len(line)})")
    assert not long, "prose lines over 100 characters (tables, images and code are exempt): " + \
        ", ".join(long)


def github_anchor(heading: str) -> str:
    """The anchor GitHub gives a heading: lower case, punctuation dropped, spaces to '-'."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def anchors_of(path: Path) -> set[str]:
    text = re.sub(r"^```.*?^```", "", path.read_text(), flags=re.S | re.M)
    return {github_anchor(m.group(1)) for m in re.finditer(r"^#+ (.+)$", text, re.M)}


def test_every_relative_link_resolves():
    """Links of the README and docs/ to files (and to headings in them) exist."""
    broken = []
    for path in [README, *DOCS]:
        for target in re.findall(r"\]\(([^)\s]+)\)", path.read_text()):
            if re.match(r"[a-z]+://", target):
                continue
            file, _, anchor = target.partition("#")
            dest = (path.parent / file).resolve() if file else path
            if not dest.exists():
                broken.append(f"{path.relative_to(ROOT)}: {target} (no such file)")
            elif anchor and dest.suffix == ".md" and anchor not in anchors_of(dest):
                broken.append(f"{path.relative_to(ROOT)}: {target} (no such heading)")
    assert not broken, "\n".join(broken)


def test_readme_links_every_doc():
    linked = set(re.findall(r"\]\(docs/([\w-]+\.md)", readme_text()))
    missing = sorted(p.name for p in DOCS if p.name not in linked)
    assert not missing, f"docs/ files the README does not link: {missing}"


def test_config_quick_reference_names_every_field():
    from dataclasses import fields

    from fxcoalesce.config import Config

    section = readme_text().split("## `Config` quick reference", 1)[1].split("\n## ", 1)[0]
    rows = [ln for ln in section.splitlines() if ln.startswith("| `")]
    named = {name for row in rows for name in re.findall(r"`(\w+)`", row.split("|")[1])}
    missing = sorted(f.name for f in fields(Config) if f.name not in named)
    assert not missing, f"Config fields missing from the README's quick reference: {missing}"


def test_setup_commands_are_the_ones_ci_runs():
    """.ci/run runs the README's two set-up commands; they must stay letter for letter."""
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    setup = [c for c, where in ELSEWHERE.items() if where == ".ci/run" and "venv" in c]
    for command in setup:
        assert command in shell_commands(readme_text()), f"README lost: {command}"
        assert command in ci, f".ci/run no longer runs: {command}"


def test_cpu_route_takes_the_torch_the_package_admits():
    """The CPU wheel asked for is one pyproject.toml takes, so ``pip install -e .`` keeps it
    (a newer one would be replaced by PyPI's CUDA build), and it goes into the venv that the
    set-up command after it uses."""
    import tomllib

    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    [torch] = [d for d in deps if re.match(r"torch\b", d)]
    assert f"'{torch.replace(' ', '')}'" in CPU_ROUTE, (torch, CPU_ROUTE)
    setup = {c.split()[3]: c for c, where in ELSEWHERE.items() if where == ".ci/run"
             and "venv" in c}
    for venv in (".venv-run", ".venv"):
        assert setup[venv].startswith(f"python3 -m venv {venv} && {venv}/bin/pip install")
        assert CPU_ROUTE.format(venv=venv) in shell_commands(readme_text())


def test_every_readme_command_is_accounted_for():
    known = {**CHEAP, **SLOW, **ELSEWHERE}
    unknown = [c for c in shell_commands(readme_text()) if c not in known]
    assert not unknown, f"README commands no test runs (add them to test_readme.py): {unknown}"
    gone = [c for c in known if c not in shell_commands(readme_text())]
    assert not gone, f"commands test_readme.py lists but the README no longer shows: {gone}"


def run_cli(command: str, timeout: float) -> subprocess.CompletedProcess:
    argv = shlex.split(command)
    assert argv[0] == "fxcoalesce", command
    return subprocess.run(CLI + argv[1:], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, "OMP_NUM_THREADS": "1"})


def check_output(command: str, proc: subprocess.CompletedProcess, lines) -> None:
    assert proc.returncode == 0, f"{command}: exit {proc.returncode}\n{proc.stderr}"
    for want in lines or ():
        assert want in proc.stdout, f"{command}: README shows {want!r}; got:\n{proc.stdout}"


@pytest.mark.parametrize("command", sorted(CHEAP))
def test_cheap_readme_commands(command):
    check_output(command, run_cli(command, timeout=120), CHEAP[command])


@pytest.mark.parametrize("command", sorted(c for c in ELSEWHERE if c.startswith("fxcoalesce")))
def test_long_readme_commands_parse(command):
    """The options of the commands run elsewhere exist: argparse reads them, then --help."""
    proc = run_cli(command + " --help", timeout=60)
    assert proc.returncode == 0, f"{command} --help: exit {proc.returncode}\n{proc.stderr}"
    assert proc.stdout.startswith("usage: fxcoalesce "), proc.stdout


@pytest.mark.slow
@pytest.mark.parametrize("command", sorted(SLOW))
def test_slow_readme_commands(command):
    check_output(command, run_cli(command, timeout=300), SLOW[command])
