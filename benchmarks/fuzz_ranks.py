"""Differential fuzzing of fxcoalesce on real gloo ranks (tests/fuzz): generated programs run
under eager, plain torch.compile and fxcoalesce (default Config and check_ranks=True), one
process per rank; the oracle says ok / loud / failure per program and variant.

    python benchmarks/fuzz_ranks.py --n 500 --jobs 8 --seed-base 1000 \\
        --out benchmarks/results/fuzz_<name>/          # summary.json, summary.md, failures/
    python benchmarks/fuzz_ranks.py --seed 123 --variant fxcoalesce --world 4 -v
    python benchmarks/fuzz_ranks.py --seed 123 --variant plain -v   # eager and plain only
    python benchmarks/fuzz_ranks.py --replay tests/data/fuzz/123.json -v
    python benchmarks/fuzz_ranks.py --merge a/summary.json b/summary.json --out c/

The summary counts outcomes per run, per feature (``by_feature``) and per feature class
(``by_class``: programs, those judged, and per variant its runs, loud outcomes, loud share
and failures; summary.md's "Loud per feature class" table).

Needs only torch and the stdlib (and this checkout). Exit status 1 if any program failed.
"""

from __future__ import annotations

import argparse
import collections
import json
import random
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from fuzz import oracle, record  # (after the path)
from fuzz.gen import default_world, generate


def _args(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, default=20, help="programs to run (seeds from --seed-base)")
    ap.add_argument("--seed-base", type=int, help="first seed (default: a fresh one, printed)")
    ap.add_argument("--seed", type=int, action="append", help="run these seeds only")
    ap.add_argument("--replay", type=Path, action="append", help="a recorded failure (JSON)")
    ap.add_argument("--jobs", type=int, default=1, help="programs run at once")
    ap.add_argument("--world", type=int, choices=(2, 4), help="default: drawn per seed")
    ap.add_argument("--variant", choices=("fxcoalesce", "check", "all", "plain"),
                    default="all", help="plain: eager and plain only (does the generator "
                    "write programs plain torch.compile runs right?)")
    ap.add_argument("--inductor", choices=("auto", "always", "never"), default="auto",
                    help="real Inductor for plain and fxcoalesce (auto: drawn per seed)")
    ap.add_argument("--no-eager", action="store_true", help="skip checking plain against eager")
    ap.add_argument("--group-timeout", type=float, default=40)
    ap.add_argument("--out", type=Path, help="directory for summary.json, summary.md, failures/")
    ap.add_argument("--resume", type=Path, metavar="SUMMARY_JSON",
                    help="a stopped run's summary.json: keep its results, skip its seeds")
    ap.add_argument("--merge", type=Path, nargs="+", metavar="SUMMARY_JSON",
                    help="write one summary (to --out) of these sittings, on one or several "
                         "machines, and run nothing")
    ap.add_argument("--stop-after", type=float, metavar="S",
                    help="start no program after S seconds (those running finish; --resume "
                         "runs the rest)")
    ap.add_argument("-v", "--verbose", action="store_true",
                    help="print each program and each run's statuses; keep the run files")
    return ap.parse_args(argv)


def _programs(args):
    if args.replay:
        return [record.load(p)[0] for p in args.replay]
    if args.seed:
        seeds = args.seed
    else:
        base = args.seed_base if args.seed_base is not None else \
            random.SystemRandom().randrange(2**31)
        print(f"seeds {base}..{base + args.n - 1} (--seed-base {base})", flush=True)
        seeds = range(base, base + args.n)
    inductor = {"auto": None, "always": True, "never": False}[args.inductor]
    done = {r["seed"] for r in args.earlier}
    return [generate(s, args.world or default_world(s), inductor) for s in seeds
            if s not in done]


def commit() -> str | None:
    """The checkout's commit (with '+' when its fxcoalesce/ or passes/ has edits), if git
    is there; $FXFUZZ_COMMIT first where set (a copy of the tree whose .git, if any, is not
    the code that runs): what the run judged."""
    import os
    import subprocess

    if os.environ.get("FXFUZZ_COMMIT") or not (ROOT / ".git").exists():
        return os.environ.get("FXFUZZ_COMMIT")

    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, text=True,
                              capture_output=True, timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "fxcoalesce", "passes"],
                               cwd=ROOT, text=True, capture_output=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    return (head + ("+" if dirty.strip() else "")) or None


def summarize(results: list[dict], args, started: float) -> dict:
    counts = collections.defaultdict(collections.Counter)
    by_feature = collections.defaultdict(collections.Counter)
    failures, louds = [], []
    for res in results:
        plain = res.get("plain", {}).get("outcome", "unfinished")
        counts["plain"][plain] += 1
        for variant, v in res["variants"].items():
            counts[variant][v["outcome"]] += 1
            for f in res["features"] + [f"world.{res['world']}"]:
                by_feature[f][v["outcome"]] += 1
            item = {"seed": res["seed"], "world": res["world"], "variant": variant,
                    "outcome": v["outcome"], "detail": v["detail"][:400],
                    "features": res["features"], "record": res.get("record")}
            if v["outcome"] in oracle.FAILURES:
                failures.append(item)
            elif v["outcome"] == "loud":
                louds.append(item)
    import torch

    return {"args": {k: str(v) for k, v in vars(args).items()
                     if k not in ("earlier", "earlier_wall", "stop_after")},
            "torch": torch.__version__, "commit_start": args.commit_start, "commit_end": commit(),
            "programs": len(results), "wall_s": round(time.monotonic() - started),
            "counts": {k: dict(v) for k, v in counts.items()},
            "by_feature": {k: dict(v) for k, v in sorted(by_feature.items())},
            "by_class": by_class(results),
            "failures": failures, "loud": louds, "results": results}


def by_class(results: list[dict]) -> dict:
    """Per feature class (a feature's name before the dot: ``threads``, ``raise``, ``log``...):
    programs that drew it, those judged (plain ran them right), and per fxcoalesce variant
    its runs, loud outcomes and failures, with the loud share of its runs in percent."""
    out = {}
    for res in results:
        for cls in sorted({f.split(".")[0] for f in res["features"]}):
            c = out.setdefault(cls, {"programs": 0, "judged": 0, "variants": {}})
            c["programs"] += 1
            c["judged"] += res.get("plain", {}).get("outcome") == "ok"
            for variant, v in res["variants"].items():
                n = c["variants"].setdefault(variant, {"runs": 0, "loud": 0, "failed": 0})
                n["runs"] += 1
                n["loud"] += v["outcome"] == "loud"
                n["failed"] += v["outcome"] in oracle.FAILURES
    for c in out.values():
        for n in c["variants"].values():
            n["loud_pct"] = round(100 * n["loud"] / n["runs"], 1)
    return dict(sorted(out.items()))


def markdown(s: dict) -> str:
    lines = [f"# fuzz_ranks: {s['programs']} programs, {s['wall_s']} s", "",
             f"torch {s['torch']}, fxcoalesce at {s['commit_start']} (start) and "
             f"{s['commit_end']} (end)", "",
             "| run | " + " | ".join(["ok", "loud", *oracle.FAILURES, *oracle.SKIPS]) + " |",
             "|---" * (3 + len(oracle.FAILURES) + len(oracle.SKIPS)) + "|"]
    for run, c in s["counts"].items():
        lines.append(f"| {run} | " + " | ".join(str(c.get(k, 0)) for k in
                     ["ok", "loud", *oracle.FAILURES, *oracle.SKIPS]) + " |")
    lines += ["", "Failures (seed, world, variant, outcome: detail):", ""]
    lines += [f"- {f['seed']} w{f['world']} {f['variant']} **{f['outcome']}**: "
              f"{f['detail'][:200]}" for f in s["failures"]] or ["- none"]
    classes = s.get("by_class") or {}
    seen = {v for c in classes.values() for v in c["variants"]}
    variants = [v for v in record.VARIANTS if v in seen] + sorted(seen - set(record.VARIANTS))
    if classes:
        head = ["class", "programs", "judged"] + [f"{v}: {k}" for v in variants
                                                  for k in ("loud", "loud %", "failed")]
        lines += ["", "Loud per feature class (judged: plain ran the program right; per "
                  "variant, loud runs of those judged, their share, and failures):", "",
                  "| " + " | ".join(head) + " |", "|---" * len(head) + "|"]
        for name, c in classes.items():
            cells = [name, str(c["programs"]), str(c["judged"])]
            for v in variants:
                n = c["variants"].get(v, {"loud": 0, "runs": 0, "failed": 0, "loud_pct": 0.0})
                cells += [f"{n['loud']}/{n['runs']}", f"{n['loud_pct']:.1f}", str(n["failed"])]
            lines.append("| " + " | ".join(cells) + " |")
    lines += ["", "Loud errors (counted apart):", ""]
    lines += [f"- {f['seed']} w{f['world']} {f['variant']}: {' '.join(f['features'])}"
              for f in s["loud"]] or ["- none"]
    return "\n".join(lines) + "\n"


def merged(paths: list[Path], out: Path | None) -> int:
    """One summary of several sittings' results (``--merge``): their torch versions,
    commits and wall times side by side."""
    parts = [json.loads(p.read_text()) for p in paths]
    args = argparse.Namespace(merged=[str(p) for p in paths], commit_start=", ".join(
        sorted({str(s["commit_start"]) for s in parts})))
    s = summarize([r for s in parts for r in s["results"]], args, time.monotonic())
    s.update(torch=", ".join(sorted({s["torch"] for s in parts})), wall_s=sum(
        s["wall_s"] for s in parts), commit_end=", ".join(sorted({str(s["commit_end"])
                                                                  for s in parts})))
    if out:
        _save(s, out)
    print(markdown(s), flush=True)
    return 1 if s["failures"] else 0


def main(argv=None) -> int:
    args = _args(argv)
    if args.merge:
        return merged(args.merge, args.out)
    args.commit_start = commit()
    args.earlier, args.earlier_wall = [], 0
    if args.resume:  # a run split over several sittings: one summary at the end
        earlier = json.loads(args.resume.read_text())
        args.earlier = earlier["results"]
        args.commit_start = earlier["commit_start"]
        args.earlier_wall = earlier["wall_s"]
        print(f"resuming: {len(args.earlier)} programs kept from {args.resume}", flush=True)
    programs = _programs(args)
    variants = record.VARIANTS if args.variant == "all" else () if args.variant == "plain" \
        else (args.variant,)
    failures_dir = args.out / "failures" if args.out else record.FAILURES_DIR
    started = time.monotonic() - args.earlier_wall  # wall_s: all sittings together
    results, lock = list(args.earlier), threading.Lock()
    log = (lambda m: print(m, flush=True)) if args.verbose else None
    done = threading.Event()

    def progress():  # a line at least every 30 s, whatever the programs do
        while not done.wait(30):
            with lock:
                bad = sum(v["outcome"] in oracle.FAILURES for r in results
                          for v in r["variants"].values())
                print(f"[{time.monotonic() - started:.0f} s] {len(results)}/"
                      f"{len(programs) + len(args.earlier)} "
                      f"programs done, {bad} failures", flush=True)

    sitting = time.monotonic()

    def one(prog):
        if args.stop_after is not None and time.monotonic() - sitting > args.stop_after:
            return None  # left for --resume
        if args.verbose:
            print(f"--- seed {prog.seed}, world {prog.world}, inductor {prog.inductor}\n"
                  f"{prog.text}", flush=True)
        keep = None
        if args.verbose:  # the scripts, results files and stderr of every run
            keep = str(args.out / "runs" / str(prog.seed)) if args.out else \
                tempfile.mkdtemp(prefix=f"fxfuzz-{prog.seed}-")
            print(f"seed {prog.seed}: run files in {keep}", flush=True)
        return record.fuzz_one(prog, variants, eager=not args.no_eager,
                               group_timeout=args.group_timeout, failures_dir=failures_dir,
                               keep=keep, log=log)

    threading.Thread(target=progress, daemon=True).start()
    with ThreadPoolExecutor(max(1, args.jobs)) as pool:
        for fut in as_completed([pool.submit(one, p) for p in programs]):
            res = fut.result()
            if res is None:
                continue
            with lock:
                results.append(res)
                outcomes = {v: r["outcome"] for v, r in res["variants"].items()}
                print(f"seed {res['seed']} w{res['world']}: plain "
                      f"{res['plain']['outcome']}, {outcomes or '-'} ({res['wall_s']} s)",
                      flush=True)
                for v, r in res["variants"].items():
                    if r["outcome"] != "ok":
                        print(f"    {v} {r['outcome']}: {r['detail'][:300]}", flush=True)
                if args.out:
                    _save(summarize(results, args, started), args.out)
    done.set()
    s = summarize(results, args, started)
    if args.out:
        _save(s, args.out)
    print(markdown(s), flush=True)
    return 1 if s["failures"] else 0


def _save(s: dict, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "summary.json").write_text(json.dumps(s, indent=1))
    (out / "summary.md").write_text(markdown(s))


if __name__ == "__main__":
    sys.exit(main())
