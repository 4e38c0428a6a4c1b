"""Shared test fixtures."""

import atexit
import os
import shutil
import tempfile

import pytest
import torch
import torch.distributed as dist

# Inductor caches compiles (fxcoalesce's too): one fresh cache for the whole run, shared by the
# ranks and subprocesses the tests start, so a run neither reads an earlier run's entries nor
# leaves its own in the machine's default cache directory.
if "TORCHINDUCTOR_CACHE_DIR" not in os.environ:
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="fxcoalesce-tests-")
    atexit.register(shutil.rmtree, os.environ["TORCHINDUCTOR_CACHE_DIR"], True)


@pytest.fixture(autouse=True, scope="module")
def no_process_group_leaks_between_files():
    """Tests that set up a (fake) default process group leave it for their module only."""
    yield
    if dist.is_initialized():
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def one_thread():
    """One torch thread for a module (``pytestmark = pytest.mark.usefixtures("one_thread")``):
    tiny ops run far faster on one thread and do not fight other jobs for the 2 cores."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


SLOWEST_FIRST = ("test_ranks.py", "test_inspect_compose.py", "test_rank_order.py",
                 "test_dynamic.py", "test_codegen.py", "test_smollm2.py", "test_fuzz_ranks.py",
                 "test_rank_safety.py", "test_rank_classes.py", "test_job_life.py",
                 "test_smollm2_spec.py",
                 "test_cli.py", "test_compile_cache.py", "test_train_draft.py",
                 "test_compile_modes.py", "test_agreement.py", "test_notebook.py",
                 "test_models_compile.py", "test_eagle3.py", "test_property_ranks.py",
                 "test_hf_tp.py")
"""The files that take longest (the default run's ``--durations``, summed per file), longest
first; test_models_compile well after test_codegen, whose kernels it reuses (the cache above)."""


def pytest_collection_modifyitems(items):
    """Run the longest files first: pytest-xdist (``--dist loadfile``, pyproject.toml) hands
    files out in this order, so no worker is left with a long one at the end."""
    first = {name: i for i, name in enumerate(SLOWEST_FIRST)}
    items.sort(key=lambda item: first.get(item.path.name, len(first)))
