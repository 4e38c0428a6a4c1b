import sys, contextlib, torch
sys.path.insert(0, "tests")
from test_ranks import _against_eager, spawn

def _without_backport(rank, world, opts, overlap):
    import fxcoalesce.torch_releases as gc
    gc.keep_mutation_renames = contextlib.nullcontext
    return _against_eager(rank, world, opts, overlap)

def main():
    print("torch", torch.__version__, "WITHOUT the backport", flush=True)
    for passes in (["raise_comms"], ["sink_waits"], ["reorder_compute_for_overlap"]):
        overlap = {"reorder_for_compute_comm_overlap": True,
                   "reorder_for_compute_comm_overlap_passes": passes, "fx_graph_cache": False}
        errs = spawn(_without_backport, 2, ({"run_checks": False}, overlap), backend="gloo")
        print(passes, "no tags max err", max(errs), flush=True)

if __name__ == "__main__":
    main()
