"""Rank safety, in one place: what fxcoalesce promises about the ranks of a job, and why it holds.

**The property.** For any program that plain ``torch.compile`` runs right on every rank (the
program issues the same collectives, in the same order, on every rank), fxcoalesce's
rewrite of it returns, on every rank and at every step, what plain's returns (up to
floating-point reassociation, which ``Config(reassociate=False)`` switches off), or, in a
class listed below, raises one :class:`CollectiveMismatchError` on every rank that names the
cause and the fix, no later than plain would have failed. Never a wrong value, never a
process killed by the transport, never a wait longer than plain's.

**The argument**, in three parts, one module each:

1. *Compile time* (``agreement``: the protocol and its proof; ``exchange``: the store side).
   A graph whose passes could change its collective sequence is rewritten only where every
   rank that shares one of its groups decided, through the default group's c10d store
   (never a collective), to run the same rewritten sequence from the same place in every
   group's stream. Otherwise it keeps the program's own order, which pairs however ranks cut
   the program into graphs. Waits end: each is bounded by ``agree_timeout_s`` and by the
   groups' own timeouts, and no two ranks wait for each other at the same place.
2. *Run time, in Python* (``runtime``). Every call of an agreed graph checks that the
   default group is the one it agreed in (a group made anew: agree again, in the new store).
   Where Dynamo would run a function the ranks agreed to rewrite uncompiled on one rank (a
   frame it skips, a partial compile, the recompile limit), the rank votes in the store
   first: all alike run it uncompiled (right, as plain); otherwise every rank stops loud.
3. *Run time, on the wire* (``tag``, with the kernel ``kernels.tag_check``). A rank that
   re-cuts or recompiles alone a stretch its peers run rewritten is seen only when the
   collectives meet: every rewritten graph (and every later graph of a function this rank
   rewrote) carries a tag, handed out by a counter in the store and exact in its dtype, on
   the first all_reduce of each group; its check fails on every rank of the pairing before
   any value is returned. Graphs of the program's own order carry none: they pair with
   eager code, skipped frames and other cuts exactly as plain's graphs do.

``check`` holds what the ranks compare (collective sequences) and the error.

**What stays outside** (docs/rank-agreement.md, "What stays outside", lists each with what a
user sees): a rank that re-cuts alone, for the first time, a function the ranks agreed to
rewrite, or that Dynamo runs uncompiled alone (loud on every rank, with the fix); different
``Config``s on different ranks, and ``run_checks=False`` with such re-cuts (unchecked).

**The proof** is measured, not simulated: ``benchmarks/fuzz_ranks.py`` generates programs
of the kinds users write (rank-dependent logging, eager collectives, ``disable``, recompile
limits, groups made anew, dynamic shapes, KV caches) and runs each on real gloo ranks under
plain ``torch.compile`` and under fxcoalesce; ``tests/test_fuzz_ranks.py`` and
``tests/test_rank_safety.py`` replay what it found. ``graph_compile`` (outside this
package) is where a compile meets it: it runs the agreement and puts tags on graphs.
"""
