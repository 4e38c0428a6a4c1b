"""Rank safety, in one place: what fxcoalesce promises about the ranks of a job, and why.

**The property.** For a program that plain ``torch.compile`` runs right on every rank (it
issues the same collectives, in the same order, on every rank), fxcoalesce returns on every
rank and at every step what plain returns (up to floating-point reassociation,
``Config(reassociate=False)``), or, in the one class below, stops: the rank that sees it raises
one ``CollectiveMismatchError`` in its own thread, and every other rank fails no later, and no
less clearly, than under plain ``torch.compile`` when a peer raises (its own tag check, or the
transport's error as that process ends). Never a wrong value, never a process killed by the
transport, never a wait longer than plain's. The package adds no thread to the process and
raises nothing in another thread; passes know nothing of ranks (the pipeline hands them the
collectives that stay in place, ``fxcoalesce.checked``).

**The argument**, in three parts:

1. *At compile time, through the store* (``agreement``: the protocol and its state machine;
   ``store``: the keys). A graph whose passes could change its collective sequence is
   rewritten only where every rank sharing one of its groups published a proposal for the
   same program key (the Config, the function, the program's own sequence in a rank-invariant
   form), from the same place in every group's stream, with the same guards (of every kind a
   later call can change on one rank: values, sizes, SymInts), and the first ladder step on
   which all issue one sequence is the decision, added once to a register no rank overwrites.
   Otherwise the program's own order, which pairs however the ranks cut the program into
   graphs. Waits end: a peer's other cut, its note that Dynamo runs the function uncompiled, a
   peer that waits for this rank on another graph (two threads), a dead process or a timeout
   end them; none outlasts the graphs' groups.
2. *On the wire* (``tag``, with ``kernels.tag_check``): every rewritten graph, and every later
   graph of a function this rank ran rewritten, tags its first all_reduce in each group with its
   decision's id (handed out by a counter in the store), and checks it before it issues the
   next collective. A rank that re-cuts or recompiles alone a stretch its peers run rewritten
   pairs that all_reduce with theirs (same size: it is the program's first one there, left in
   place by every pass), the ids differ, and every rank of the pairing fails its check before
   any value is returned. Graphs of the program's own order carry nothing.
3. *The hooks that hear Dynamo* (``hooks``, with every call of an agreed graph): a
   frame Dynamo runs uncompiled on this rank is noted in the store (ends a peer's wait) and,
   where this rank runs the function rewritten, that call sends the reserved id on the tagged
   all_reduce: all ranks uncompiled, the check holds and the rewrite retires; a peer compiled,
   both stop there, lazily, at the first collective. A process group made anew makes a graph
   agree again before it issues anything.

**What stays outside** (docs/rank-agreement.md lists what a user sees): a rank that alone
re-cuts, recompiles or runs uncompiled, for the first time, a function the ranks agreed to run
rewritten (nothing predicted it) stops as above; different ``Config``s on different ranks, and
``run_checks=False`` with such re-cuts, are unchecked.

**The evidence** is measured, not simulated: the differential fuzzer on real gloo ranks
(``tests/fuzz/``, ``benchmarks/fuzz_ranks.py``), its replays (``tests/test_fuzz_ranks.py``) and
``tests/test_rank_safety.py``.

**Size**, counted with ``wc -l`` over every line (docstrings included) of this package,
``fxcoalesce/checked.py``, ``fxcoalesce/errors.py`` and ``fxcoalesce/kernels/tag_check.py``:
see ``tests/test_layout_imports.py``, which holds it at most 1,500.
"""
