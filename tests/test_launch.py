"""apps.launch.spawn on real gloo ranks: results in rank order, and a failing rank brought
back as one readable RankError with no rank left running."""

import multiprocessing
import os

import pytest
import torch.distributed as dist

from fxcoalesce.apps.launch import RankError, spawn


def _rank_times_ten(rank, world):
    return rank * 10


def _rank_1_raises_while_0_waits(rank, world):
    if rank == 1:
        raise ValueError("bad shard on rank 1")
    dist.barrier()  # never completes: rank 1 is gone, and gloo would wait 30 minutes


def _rank_1_dies_while_0_waits(rank, world):
    if rank == 1:
        os._exit(3)  # a crash with no Python exception: nothing is ever put on the queue
    dist.barrier()


def test_results_come_back_in_rank_order():
    assert spawn(_rank_times_ten, 2, backend="gloo", timeout=120) == [0, 10]


def test_raising_rank_is_reported_and_the_others_stopped():
    """Regression: a rank raising early left rank 0 blocked in its collective, and the error
    came back as nested tracebacks inside a RuntimeError."""
    with pytest.raises(RankError) as caught:
        spawn(_rank_1_raises_while_0_waits, 2, backend="gloo", timeout=120)
    e = caught.value
    assert str(e) == "rank 1: ValueError: bad shard on rank 1"
    assert (e.rank, e.kind, e.message) == (1, "ValueError", "bad shard on rank 1")
    assert "Traceback" in e.traceback and "_rank_1_raises_while_0_waits" in e.traceback
    assert multiprocessing.active_children() == []  # rank 0 was terminated, not left waiting


def test_rank_that_dies_without_an_exception_is_reported():
    """A rank killed or crashed in C++ reports nothing; spawn used to wait its full timeout."""
    with pytest.raises(RankError, match=r"^rank 1: its process exited with code 3 before"):
        spawn(_rank_1_dies_while_0_waits, 2, backend="gloo", timeout=120)
    assert multiprocessing.active_children() == []


def _config_seen(rank, world):
    import torch._inductor.config as c

    return c.size_asserts, os.environ.get("TORCHINDUCTOR_SIZE_ASSERTS")


def test_a_variable_read_at_import_gets_fresh_ranks(monkeypatch):
    """The fork server imported Inductor with the environment it started with: a spawn that
    changes a variable Inductor's config reads at import (in ``env=`` or in the parent's
    environment: one dict, ``_context``) gets ranks that import anew."""
    from fxcoalesce.apps import launch

    assert spawn(_config_seen, 2, backend="gloo", timeout=120)[0] == (True, None)
    got = spawn(_config_seen, 2, backend="gloo", timeout=120,
                env={"TORCHINDUCTOR_SIZE_ASSERTS": "0"})
    assert got == [(False, "0")] * 2
    monkeypatch.setenv("TORCHINDUCTOR_SIZE_ASSERTS", "0")
    assert launch._context().get_start_method() == "spawn"


def test_ranks_start_fresh_where_cuda_is(monkeypatch):
    """A rank forked from the server could not start CUDA (the GPU machine): spawn there."""
    import torch

    from fxcoalesce.apps import launch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert launch._context().get_start_method() == "spawn"


def test_ranks_in_network_namespaces_need_one_each_and_an_address():
    """``FXCOALESCE_RANK_NETNS`` (ranks as hosts over a shaped link) is checked before any
    namespace is entered: one per rank, and the first rank's address."""
    from fxcoalesce.apps.launch import _enter_netns

    for spec in ("fxc0,fxc1", "fxc0@10.77.0.1"):
        with pytest.raises(ValueError, match="one namespace per rank"):
            _enter_netns(spec, 1)
    with pytest.raises(FileNotFoundError):
        _enter_netns("no-such-namespace,x@10.0.0.1", 0)
