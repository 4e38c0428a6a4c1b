"""Inductor's caches with the fxcoalesce backend (issue 14 §3): a warm compile is served from
the cache, only ever with fxcoalesce's own code, still says what the passes did, and keeps the
ranks' agreement right when some ranks hit the cache and others do not.

Environment variables and Inductor's cache directory are per process: each compile that must
start cold or warm runs in a process of its own (a subprocess, or spawned ranks).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch.testing import FileCheck
from test_rank_order import _inputs, const_after_wait, eager

import fxcoalesce
from fxcoalesce.apps.launch import spawn

ROOT = Path(__file__).resolve().parents[1]

COMPILE = """
import json, sys, torch, fxcoalesce
from torch._inductor.utils import run_and_get_code
from tests.test_compile_modes import two_independent
from fxcoalesce.apps.launch import init_fake_group
init_fake_group(2)
x, w = torch.randn(8, 8), torch.randn(8, 8)
for backend in sys.argv[1:]:
    torch._dynamo.reset()
    fxcoalesce.clear_reports()
    fn = torch.compile(two_independent, fullgraph=True, backend=backend)
    out, (code,) = run_and_get_code(fn, x, w)
    reports = [dict(cache=r.cache, after=r.all_reduce["after"]) for r in fxcoalesce.reports()]
    print(json.dumps(dict(reports=reports, code=code)))
"""


def compile_in_process(backends: list[str], cache: Path, trace: Path | None = None
                       ) -> list[dict]:
    """Each of ``backends`` compiles the graph in turn, in one fresh process (a process
    costs 5-8 s on a loaded machine; each compile after the first resets Dynamo)."""
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(cache)}
    if trace is not None:
        env["TORCH_TRACE"] = str(trace)
    done = subprocess.run([sys.executable, "-c", COMPILE, *backends], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    return [json.loads(line) for line in done.stdout.strip().splitlines()[-len(backends):]]


def launches(n: int, code: str) -> None:
    # exactly n all_reduce launches in the generated code (in place or not)
    FileCheck().check_count("torch.ops._c10d_functional.all_reduce", n, exactly=True).run(code)


@pytest.fixture(scope="module")
def cold_and_warm(tmp_path_factory):
    """One cold compile, then one warm, each traced (TORCH_TRACE): the two tests below read
    them (each compile is a process of its own: 20-60 s on a loaded machine)."""
    tmp = tmp_path_factory.mktemp("cache")
    cache = tmp / "inductor"
    (cold,) = compile_in_process(["fxcoalesce"], cache, trace=tmp / "cold")
    (warm,) = compile_in_process(["fxcoalesce"], cache, trace=tmp / "warm")
    return tmp, cache, cold, warm


def test_warm_compile_is_served_from_the_cache_and_reports(cold_and_warm):
    _, cache, cold, warm = cold_and_warm
    # cold: the passes ran (a max, then two independent sums -> one); warm: AOTAutograd's cache
    # answered, and the report saved beside it says what was done
    assert cold["reports"] == [{"cache": "", "after": 2}]
    assert warm["reports"] == [{"cache": "hit", "after": 2}]
    # a cache hit serves the same code: two all_reduce launches
    launches(2, cold["code"])
    launches(2, warm["code"])
    # plain torch.compile of the same graph is not served fxcoalesce's code, nor the reverse
    plain, again = compile_in_process(["inductor", "fxcoalesce"], cache)
    launches(3, plain["code"])
    assert plain["reports"] == []
    assert again["reports"] == [{"cache": "hit", "after": 2}]
    launches(2, again["code"])
    # Inductor's own cache layout and ours beside it; no temporary directory per compile
    # (the old force_disable_caches left one behind each time)
    assert not [p.name for p in cache.iterdir() if p.name.startswith("tmp")]
    assert len(list((cache / "fxcoalesce").glob("*.json"))) == 1


def test_a_warm_start_trace_still_shows_the_report(cold_and_warm):
    """On a cache hit AOTAutograd skips the passes; the trace gets the saved report."""
    tmp_path, _, _, warm = cold_and_warm
    assert warm["reports"] == [{"cache": "hit", "after": 2}]
    logs = "".join(p.read_text() for p in (tmp_path / "warm").glob("*.log"))
    assert '"name": "fxcoalesce_report"' in logs
    assert '"cache": "hit"' in logs or "\"cache\": \"hit\"" in logs


def _cached_rank(rank, world, dirs):
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = dirs[rank]
    torch.set_num_threads(1)
    fxcoalesce.clear_reports()
    torch._dynamo.reset()
    compiled = torch.compile(const_after_wait, backend="fxcoalesce", fullgraph=True)
    with torch.no_grad():
        got = compiled(*_inputs(rank))
    return {"got": got, "want": eager(const_after_wait, _inputs(rank)),
            "reports": [(r.cache, r.agreement["step"]) for r in fxcoalesce.reports()]}


@pytest.mark.slow  # Inductor on 2 ranks, twice: 3 min on a loaded 2-core machine
def test_a_rank_served_from_the_cache_still_agrees_with_one_that_compiles(tmp_path):
    dirs = [str(tmp_path / "rank0"), str(tmp_path / "rank1")]
    cold = spawn(_cached_rank, 2, (dirs,), backend="gloo", timeout=300)
    shutil.rmtree(dirs[1])  # rank 1 starts cold, rank 0 warm
    warm = spawn(_cached_rank, 2, (dirs,), backend="gloo", timeout=300)
    step = "without the choices that read compute"  # linearity differs by rank
    assert [r["reports"] for r in cold] == [[("", step)], [("", step)]]
    # rank 0 took both steps of the agreement from the cache, rank 1 compiled them: same step
    assert [r["reports"] for r in warm] == [[("hit", step)], [("", step)]]
    for r in cold + warm:
        for got, want in zip(r["got"], r["want"], strict=True):
            torch.testing.assert_close(got, want)


def test_the_key_of_list_options_is_their_contents():
    """Regression: a list-valued Inductor option (``reorder_for_compute_comm_overlap_passes``,
    which the backend sets on torch 2.14+) went into the key by its id, so a warm start
    never found the cache (found on torch 2.15)."""
    from fxcoalesce.compile_cache import compile_key

    def key(passes):
        return compile_key("f", "cfg", {"reorder_for_compute_comm_overlap_passes": passes})

    assert key(["sink_waits", "raise_comms"]) == key(["sink_waits", "raise_comms"])
    assert key(["sink_waits", "raise_comms"]) != key(["raise_comms", "sink_waits"])
