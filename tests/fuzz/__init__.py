"""A differential fuzzer on real ranks: the project's evidence for rank safety.

**What is generated** (``gen``): from a seed (``random.Random(seed)``) and a world size, the
source of a whole script that one process per rank runs, of the kinds users write:

- TP blocks: ``funcol.all_reduce(x, op, group)`` with op sum/avg/max/min in float32, float16
  or bfloat16; summed pairs and triples ``AR(a) + AR(b)`` (fxcoalesce's linearity rewrite),
  independent pairs (bucketing), chains, ``funcol.all_gather_tensor`` of a slice beside an
  all_reduce; over one to three groups (the world, halves and even/odd ranks on 4 ranks,
  made by every rank in one order with ``dist.new_group``); unrolled or in a layer loop;
- rank-dependent logging inside the compiled function: ``print`` / ``logger.warning`` on one
  rank, every N steps, inside the layer loop, through a helper, rank from ``RANK`` or
  ``dist.get_rank()``, a module-level flag (``CFG.verbose``) one rank sets at some step;
- eager ``dist.all_reduce`` / ``dist.broadcast`` between compiled calls;
- ``torch.compiler.disable`` on a helper (compute, or an all_reduce) on one rank only; a
  small recompile limit (``recompile_limit``, ``cache_size_limit`` before 2.13) that one
  rank reaches by a value only it changes;
- sequence lengths that change between steps, sometimes ``dynamic=True``; a KV cache
  updated in place (``cache[:, pos] = ...`` or ``index_copy_``);
- the process group destroyed and made anew on a new port, the same size or smaller (the
  ranks beyond it stop), then the same compiled function called again;
- 3-8 steps mostly, sometimes tens, now and then hundreds; a second compiled function;
- issue 49's classes, each in about one program in twenty (from a second generator: a seed
  that draws none gives the program it gave before them): two threads per rank, each with
  its own ``dist.new_group`` and row count, calling one compiled function (``threads``); a
  user ``ValueError`` before any collective (a bad shape, one rank or all) or after some (a
  flag, every rank), caught, recorded and the call made again (``raise``); a group made
  anew, then on one rank a print in a loop, a recompile limit reached or
  ``torch.compiler.disable`` (``regroup_then``); ``dynamic=True`` with a print on one rank
  every N steps and branches on int arguments, 30-200 steps (``dynint``).

**How it runs** (``runner``, ``harness``, ``zygote``): each program runs on 2 or 4 gloo
ranks on CPU, one OS process each (forked from an interpreter that imported torch, Dynamo
and Inductor once: half the time; ``FXFUZZ_SPAWN=exec`` for ``python program.py``), under eager (``torch.compile`` left out), plain ``torch.compile``
(``backend="aot_eager"``), ``fxcoalesce.backend(Config(codegen="eager"))`` and the same with
``check_ranks=True``; about one program in ten (``--inductor always`` for all) uses real
Inductor instead: ``backend="inductor"``, ``backend="fxcoalesce"`` and
``Config(check_ranks=True)``. Group timeout 40 s (30 s in the default test), a wall limit
per run. Each rank writes each step's outputs and wall time and its end (done / stopped /
the exception) as JSON lines; the runner keeps exit codes and stderr.

**The oracle** (``oracle``, whose docstring has the details): plain must finish on every
rank and match eager, else the program is left out (counted). Then each fxcoalesce variant
must match plain on every rank at every step (per-dtype tolerance: sums may reassociate),
with no step slower than plain's allowance (10 s grace; 1.5x + 15 s on a compiled
function's first call), or stop loudly, counted apart as ``loud``: the rank(s) that see
why raise ``CollectiveMismatchError`` (or an error naming fxcoalesce and a fix), every other
rank that error too or the transport's ("Connection closed by peer") as a stopped rank's
process ends, within the step's allowance, as under plain when a peer raises (issue 49's
promise). Failures: ``wrong``, ``killed``, ``hang``, ``partial_error``, ``error``,
``missing``, ``slow``. The slow run's summary gives the loud share per feature class.

**Record and replay** (``record``): a failure is written to
``property-failures/fuzz/<seed>.json`` (seed, world, variants, program text, each rank's
status and stderr tail); once fixed, copy the file into ``tests/data/fuzz/``, where the
default test replays it (its recorded text).

**Running it**::

    pytest tests/test_fuzz_ranks.py                 # fixed seeds, 2 ranks, ~2-4 min
    FXCOALESCE_FUZZ_N=500 pytest -m slow tests/test_fuzz_ranks.py -k fresh -s
    python benchmarks/fuzz_ranks.py --n 500 --jobs 8 --seed-base S \\
        --out benchmarks/results/fuzz_<name>/      # summary.json, summary.md, failures/
    python benchmarks/fuzz_ranks.py --seed 123 --variant fxcoalesce --world 4 -v
    python benchmarks/fuzz_ranks.py --seed 123 --variant plain -v  # eager and plain only
    python benchmarks/fuzz_ranks.py --replay property-failures/fuzz/123.json -v

Only torch and the stdlib are needed (no safetensors, no hypothesis).
"""
