"""Shared test fixtures."""

import pytest
import torch.distributed as dist


@pytest.fixture(autouse=True, scope="module")
def no_process_group_leaks_between_files():
    """Tests that set up a (fake) default process group leave it for their module only."""
    yield
    if dist.is_initialized():
        dist.destroy_process_group()
