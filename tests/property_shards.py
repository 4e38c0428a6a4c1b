"""Run one slow property test (a 10k run) as shards in parallel: each shard a pytest process
of its own, with a fresh seed of its own and its share of the examples, so a machine with
many cores runs 10k fresh examples in minutes instead of hours. Every shard's seed is
printed and kept; a failing shard leaves its example in ``property-failures/``
(``property_record``), and the exit status is 1 if any shard failed.

    python tests/property_shards.py -k 10k tests/test_property_ranks.py --shards 14
    python tests/property_shards.py -k 10k tests/test_property_ranks.py --examples 10000 \\
        --shards 14 --out results.json
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("path", help="the test file")
    ap.add_argument("-k", default="10k", help="pytest -k expression naming the slow test")
    ap.add_argument("--examples", type=int, default=10_000, help="examples in all")
    ap.add_argument("--shards", type=int, default=max(1, (os.cpu_count() or 2) - 2))
    ap.add_argument("--out", help="JSON file for the shards' seeds, times and outcomes")
    args = ap.parse_args(argv)
    rng = random.SystemRandom()
    per = [args.examples // args.shards + (i < args.examples % args.shards)
           for i in range(args.shards)]
    t0 = time.monotonic()
    procs = []
    for i, n in enumerate(per):
        seed = rng.randrange(2**32)
        env = dict(os.environ, FXCOALESCE_PROPERTY_SEED=str(seed),
                   FXCOALESCE_PROPERTY_EXAMPLES=str(n), OMP_NUM_THREADS="1")
        log = open(ROOT / f"property-shard-{i}.log", "w")
        cmd = [sys.executable, "-m", "pytest", "-q", "-m", "slow", "-p", "no:cacheprovider",
               "--hypothesis-show-statistics", "-k", args.k, args.path]
        procs.append((i, n, seed, log, subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log,
                                                        stderr=subprocess.STDOUT)))
        print(f"shard {i}: {n} examples, FXCOALESCE_PROPERTY_SEED={seed}", flush=True)
    shards = []
    for i, n, seed, log, p in procs:
        rc = p.wait()
        log.close()
        lines = (ROOT / f"property-shard-{i}.log").read_text().strip().splitlines()
        ran = [x.strip(" -") for x in lines if "passing," in x]  # hypothesis's statistics
        shards.append({"shard": i, "examples": n, "seed": seed, "rc": rc,
                       "summary": lines[-1] if lines else "", "hypothesis": ran,
                       "done_s": round(time.monotonic() - t0)})
        print(f"shard {i}: rc {rc}: {shards[-1]['summary']} ({shards[-1]['done_s']} s)",
              flush=True)
    failed = [s for s in shards if s["rc"] != 0]
    result = {"test": f"{args.path} -k {args.k}", "examples": sum(per), "shards": shards,
              "wall_s": round(time.monotonic() - t0), "passed": not failed}
    print(f"{result['examples']} examples in {len(shards)} shards, {result['wall_s']} s: "
          + ("passed" if not failed else f"{len(failed)} shard(s) failed"), flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
