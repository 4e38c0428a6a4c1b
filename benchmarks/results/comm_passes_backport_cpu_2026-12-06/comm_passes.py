"""Inductor's comm reordering passes on this torch, kimi-k2-tiny's verify step on 2 gloo
ranks, through fxcoalesce (keep_mutation_renames in), against eager."""
import sys, torch
sys.path.insert(0, "tests")
from test_ranks import _against_eager, spawn
def main():
  print("torch", torch.__version__, flush=True)
  for passes in (["raise_comms"], ["sink_waits"], ["reorder_compute_for_overlap"],
                 ["sink_waits", "raise_comms", "reorder_compute_for_overlap"]):
      for opts in ({"run_checks": False}, {}):
          overlap = {"reorder_for_compute_comm_overlap": True,
                     "reorder_for_compute_comm_overlap_passes": passes, "fx_graph_cache": False}
          errs = spawn(_against_eager, 2, (opts, overlap), backend="gloo")
          print(passes, "tags" if not opts else "no tags", "max err", max(errs), flush=True)

if __name__ == "__main__":
    main()
