"""The package installs beside the torch a user has: ``pip install -e .`` into a venv that holds
any torch pyproject.toml admits (2.11 on: no upper bound; tested 2.11 to 2.15) installs
fxcoalesce and nothing else.

Run by .ci/run in both of its venvs: torch 2.13.0 (CPU) and the newest release (2.15.0).
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]


def test_pip_install_keeps_the_installed_torch():
    # no constraint file: a machine-wide one (this machine caps torch at 2.14.1) would make pip
    # replace a newer torch, which is that machine's choice, not the package's
    env = {**os.environ, "PIP_CONSTRAINT": os.devnull}
    proc = subprocess.run([sys.executable, "-m", "pip", "install", "--dry-run", "--quiet",
                           "--report", "-", "-e", str(ROOT)], capture_output=True, text=True,
                          env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr
    would = [i["metadata"]["name"] for i in json.loads(proc.stdout)["install"]]
    assert would == ["fxcoalesce"], f"with torch {torch.__version__} pip would install {would}"
