"""Shared test fixtures."""

import pytest
import torch
import torch.distributed as dist


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
