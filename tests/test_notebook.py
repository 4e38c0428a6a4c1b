"""notebooks/walkthrough.ipynb is stored without outputs and runs from top to bottom (in a
real kernel, with its two gloo ranks spawned from there), so it cannot rot."""

from __future__ import annotations

from pathlib import Path

import nbformat
from nbclient import NotebookClient

NOTEBOOK = Path(__file__).parents[1] / "notebooks" / "walkthrough.ipynb"


def code_cells(nb) -> list:
    return [c for c in nb.cells if c.cell_type == "code"]


def test_notebook_is_stored_without_outputs():
    nb = nbformat.read(NOTEBOOK, as_version=4)
    assert code_cells(nb)
    assert all(c.outputs == [] and c.execution_count is None for c in code_cells(nb))


def test_notebook_runs(tmp_path):
    nb = nbformat.read(NOTEBOOK, as_version=4)
    # raises CellExecutionError naming the cell if any cell fails; a cell over the timeout
    # (a hung rank) fails too
    NotebookClient(nb, timeout=120, kernel_name="python3",
                   resources={"metadata": {"path": str(tmp_path)}}).execute()
    outputs = [o for c in code_cells(nb) for o in c.outputs]
    text = "".join(o.get("text", "") for o in outputs if o.output_type == "stream")
    assert all(c.execution_count for c in code_cells(nb))
    assert "all_reduces: 9   lower bound: 5" in text
    for rank in (0, 1):  # from the real ranks, compared with eager inside the notebook
        assert f"rank {rank}: all_reduce 9 -> 5 launches" in text
    pictures = [o for o in outputs if o.output_type == "display_data" and "image/png" in o.data]
    assert len(pictures) == 2  # the collectives, the timeline
