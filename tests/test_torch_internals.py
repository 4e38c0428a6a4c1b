"""The torch internals fxcoalesce relies on, their canaries, and a torch newer than tested.

Run by .ci/run on torch 2.13 and on the newest and the oldest torch CI has
(.ci/tests-newest.txt, .ci/tests-oldest.txt): a canary that fails there fails the job, so a
moved internal is known the day that torch ships. A newer torch is faked by its version
string: it installs (pyproject.toml admits it), its first compile warns once and runs the
canaries, and a failed canary turns off what it guards, down to plain Inductor.
"""

from __future__ import annotations

import logging
import re
import tomllib
from pathlib import Path

import pytest
import torch
from graphs import GraphBuilder, all_reduces
from packaging.requirements import Requirement
from torch.torch_version import TorchVersion

import fxcoalesce
from fxcoalesce import Config, run_pipeline
from fxcoalesce import torch_internals as ti
from fxcoalesce.apps import cli

ROOT = Path(__file__).resolve().parents[1]
NEWER = f"{ti.TESTED_TO[0]}.{ti.TESTED_TO[1] + 1}.0"
"""A torch one minor release past the tested range (2.16.0 while CI's newest is 2.15)."""


@pytest.fixture
def fresh():
    """The decision made anew (a faked version decides again), and forgotten after."""
    ti._reset()
    yield
    ti._reset()


@pytest.fixture
def newer_torch(monkeypatch, fresh):
    monkeypatch.setattr(torch, "__version__", TorchVersion(NEWER))
    return NEWER


def warnings_of(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.name == "fxcoalesce" and r.levelno >= logging.WARNING]


def test_every_canary_passes_on_this_torch():
    results = ti.run_canaries()
    assert [r.name for r in results] == [i.name for i in ti.INTERNALS]
    failed = [str(r) for r in results if not r.ok]
    assert not failed, f"torch {torch.__version__}: {failed}"
    assert all("\n" not in r.line and r.line for r in results)
    again = ti.run_canaries()  # cheap once torch's compile stack is imported: no compile
    assert sum(r.ms for r in again) < 3000, [(r.name, round(r.ms)) for r in again]


def test_every_internal_is_described_and_guards_known_features():
    for i in ti.INTERNALS:
        assert i.what and i.why and i.versions and i.guards, i.name
        assert set(i.guards) <= set(ti.FEATURES), i.name
    assert len({i.name for i in ti.INTERNALS}) == len(ti.INTERNALS)
    guarded = {f for i in ti.INTERNALS for f in i.guards}
    assert guarded == set(ti.FEATURES), set(ti.FEATURES) - guarded


def test_the_tested_range_is_what_ci_runs():
    def pinned(which):
        text = (ROOT / ".ci" / f"torch-{which}.txt").read_text()
        major, minor = re.search(r"^torch==(\d+)\.(\d+)", text, re.M).groups()
        return int(major), int(minor)

    assert (ti.TESTED_FROM, ti.TESTED_TO) == (pinned("oldest"), pinned("newest"))


def test_the_install_metadata_admits_a_torch_newer_than_tested():
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    (torch_req,) = [Requirement(d) for d in deps if Requirement(d).name == "torch"]
    for version in (NEWER, f"{NEWER}.dev20261201", "2.20.1", "3.0.0", str(torch.__version__)):
        assert torch_req.specifier.contains(version, prereleases=True), (torch_req, version)
    assert not torch_req.specifier.contains(f"{ti.TESTED_FROM[0]}.{ti.TESTED_FROM[1] - 1}.0")


def test_a_tested_torch_runs_no_canary_at_compile_time(fresh, monkeypatch, caplog):
    monkeypatch.setattr(ti, "run_canaries", lambda names=None: pytest.fail("canaries ran"))
    assert ti.is_tested() and ti.check_torch() == frozenset() and ti.disabled() == frozenset()
    assert not warnings_of(caplog)


def tiny(x):
    return torch.relu(x) * 2


def test_the_first_compile_on_a_newer_torch_warns_once(newer_torch, caplog):
    """The version string is faked above the range: the first compile says so, once, and
    runs the canaries (all pass on this torch, so nothing is turned off)."""
    caplog.set_level(logging.WARNING, logger="fxcoalesce")
    torch._dynamo.reset()
    backend = fxcoalesce.backend(Config(codegen="eager"))
    x = torch.randn(4)
    torch.compile(tiny, backend=backend)(x)
    torch.compile(lambda x: tiny(x) + 1, backend=backend)(x)  # a second compile: no word
    (warned,) = warnings_of(caplog)
    assert f"torch {NEWER} is outside the range fxcoalesce is tested on " \
           f"({ti.tested_range()})" in warned
    assert ti.disabled() == frozenset()


def _changed_skip_hook(self, result, frame, extra):  # a signature torch might move to
    return result


def summed_pair():
    b = GraphBuilder()
    x, y = b.input("x", (4, 8)), b.input("y", (4, 8))
    return b.build(b.add(b.all_reduce(b.add(x, x)), b.all_reduce(b.add(y, y))))


def test_a_failed_canary_turns_off_exactly_what_it_guards(newer_torch, monkeypatch, caplog):
    """A newer torch whose Dynamo skip hook moved: the hearing of skips and every rewrite
    are off, said in one line, and the graphs keep their all_reduces (plain Inductor's)."""
    from torch._dynamo import convert_frame

    caplog.set_level(logging.WARNING, logger="fxcoalesce")
    monkeypatch.setattr(convert_frame.CatchErrorsWrapper, "_handle_skip", _changed_skip_hook,
                        raising=False)  # torch 2.11 has none: one that cannot be called
    assert ti.disabled() == {"skip-hook", "rewrite"}
    lines = [w for w in warnings_of(caplog) if "dynamo.skip_hook" in w]
    assert len(lines) == 1 and "\n" not in lines[0]
    assert lines[0].endswith("turned off: skip-hook, rewrite"), lines[0]
    assert "_handle_skip" in lines[0]
    out, report = run_pipeline(summed_pair(), Config(strict=True))
    assert len(all_reduces(out)) == 2 and report.all_reduce["left_alone"] == 2
    assert f"rewrite is off on torch {NEWER}" in " ".join(report.warnings)


def test_a_failed_comm_reorder_canary_keeps_the_rewrites(newer_torch, monkeypatch):
    from torch._inductor import comms

    from fxcoalesce.torch_internals import comm_reorder_options

    monkeypatch.delattr(comms, "sink_waits")
    assert ti.disabled() == {"comm-reorder"}
    assert comm_reorder_options() == {}
    out, _ = run_pipeline(summed_pair(), Config(strict=True, run_checks=False))
    assert len(all_reduces(out)) == 1  # the sum of two all_reduces is still one


def test_doctor(capsys, fresh):
    assert cli.main(["doctor"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) <= 20, lines
    assert lines[0].startswith(f"torch {torch.__version__}, tested {ti.tested_range()}: in range")
    for i in ti.INTERNALS:
        assert any(line.startswith(f"  \u2714 {i.name}: ") for line in lines), i.name
    assert [line.split(":")[0] for line in lines[-5:-1]] == \
        ["GPUs", "NCCL", "symmetric memory", "caches"]
    assert lines[-1].startswith(f"\u2714 all {len(ti.INTERNALS)} canaries pass")


def test_doctor_names_what_a_failed_canary_turns_off(capsys, newer_torch, monkeypatch):
    import torch.distributed as dist

    monkeypatch.setattr(dist.HashStore, "compare_set",
                        lambda self, key, expected, desired: b"")  # a store that lost it
    assert cli.main(["doctor"]) == 1
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) <= 20
    assert "newer than tested" in lines[0]
    (failed,) = [line for line in lines if line.startswith("  \u2718")]
    assert failed.startswith("  \u2718 c10d.store: compare_set on an absent key") \
        and failed.endswith("(off: rewrite)")
    assert lines[-1].startswith(f"\u2718 1 of {len(ti.INTERNALS)} canaries failed")
    assert "off on this torch: rewrite; every graph compiles as plain Inductor" in lines[-1]
