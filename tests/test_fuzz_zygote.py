"""The fuzzer's ranks fork from zygotes (tests/fuzz/zygote.py): a child must be what
``python script.py`` would be, as far as a fuzz program can tell, and ranks of one program
must not share a hash seed."""

from __future__ import annotations

import json
import os
import signal
import sys
import time

import pytest
from fuzz import zygote

SCRIPT = """
import json, os, random, sys
what = os.environ["WHAT"]
out = {"argv": sys.argv, "path0": sys.path[0], "cwd": os.getcwd(), "name": __name__,
       "env": sorted(k for k in os.environ if k.startswith("ZYG_")), "pid": os.getpid(),
       "sid": os.getsid(0), "hash": hash("fxcoalesce"), "rand": random.random(),
       "stdin": sys.stdin.read()}
print(json.dumps(out))
print("to stderr", file=sys.stderr)
if what == "exit3":
    sys.exit(3)
if what == "abort":
    sys.stdout.flush()
    os.abort()
if what == "raise":
    raise ValueError("boom")
"""


def _run(tmp_path, rank, what, shared):
    script = tmp_path / "prog.py"
    script.write_text(SCRIPT)
    out, err = tmp_path / f"{rank}{what}.out", tmp_path / f"{rank}{what}.err"
    p = zygote.fork(rank, str(script), str(tmp_path), {**shared, "WHAT": what, "ZYG_A": "1"},
                    str(out), str(err), shared)
    t0 = time.monotonic()
    while p.poll() is None:
        assert time.monotonic() - t0 < 60
        time.sleep(0.05)
    return p.returncode, out.read_text(), err.read_text()


@pytest.mark.skipif(not hasattr(os, "fork"), reason="no fork here: the runner execs")
def test_a_forked_rank_is_like_a_fresh_python_and_ranks_differ_in_hash_seed(tmp_path):
    shared = {k: v for k, v in os.environ.items() if not k.startswith("ZYG_")}
    shared["PYTHONPATH"] = os.pathsep.join(sys.path)  # where the test found torch
    code, out, err = _run(tmp_path, 0, "ok", shared)
    assert code == 0 and err == "to stderr\n"
    first = json.loads(out)
    assert first["argv"] == [str(tmp_path / "prog.py")] and first["path0"] == str(tmp_path)
    assert first["cwd"] == str(tmp_path) and first["name"] == "__main__"
    assert first["env"] == ["ZYG_A"] and first["sid"] == first["pid"] and first["stdin"] == ""
    assert _run(tmp_path, 0, "exit3", shared)[0] == 3
    code, out, _ = _run(tmp_path, 0, "abort", shared)
    assert code == -signal.SIGABRT and json.loads(out)["pid"] != first["pid"]
    code, _, err = _run(tmp_path, 0, "raise", shared)
    assert code == 1 and "ValueError: boom" in err
    other = json.loads(_run(tmp_path, 1, "ok", shared)[1])
    again = json.loads(_run(tmp_path, 0, "ok", shared)[1])
    assert other["hash"] != first["hash"] == again["hash"]  # rank 1: another interpreter
    assert again["rand"] != first["rand"]  # random reseeded per child


@pytest.mark.skipif(not hasattr(os, "fork"), reason="no fork here: the runner execs")
def test_a_zygote_of_another_environment_replaces_the_one_of_its_rank(tmp_path):
    """One zygote per rank index: under pytest every test has its own environment
    (PYTEST_CURRENT_TEST), and a zygote kept per environment filled CI's 24 GiB."""
    shared = {k: v for k, v in os.environ.items() if not k.startswith("ZYG_")}
    shared["PYTHONPATH"] = os.pathsep.join(sys.path)
    assert _run(tmp_path, 0, "ok", shared)[0] == 0
    old = zygote._POOL[0][1]
    script = tmp_path / "prog.py"
    p = zygote.fork(0, str(script), str(tmp_path), {**shared, "WHAT": "exit3"},
                    str(tmp_path / "b.out"), str(tmp_path / "b.err"), {**shared, "ZYG_B": "1"})
    assert p.wait() == 3  # waits on the zygote's news, holding its condition
    assert zygote._POOL[0][1] is not old and len(zygote._POOL) <= 2
    assert old.proc.wait(timeout=30) == 0  # retired: it left once its children were reaped
