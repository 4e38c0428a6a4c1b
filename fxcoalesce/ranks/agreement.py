"""Every rank issues one collective sequence, agreed without a collective at compile time.

Ranks pair collectives by issue order. A rank sees its own graph only, and what a pass reads
there (the cost model's compute estimates, the adds ``linearity`` sums through, the slice
``slice`` reduces, which collective depends on which) can differ between ranks, so the
rewritten sequences can differ. Ranks also cut one program into graphs differently (a
``print`` under ``if rank == 0:`` breaks rank 0's graph in two; a value that changes on one
rank recompiles there only), so a rank cannot know that its peers compile this graph at all.

The protocol (``exchange``), for each graph whose passes could change its sequence:

1. The graph is named by its *program key* ``D``: a digest of the Config and of the graph's
   own collective sequence in a rank-invariant form (groups by the role they play in the
   graph, symbolic sizes renamed in order of appearance: :func:`canonical`). The rank
   publishes, through the default group's c10d store (never a collective), a *proposal*: the
   sequence its passes would issue at each step of :func:`ladder`, the groups it uses with
   their members, and where it stands in each group's collective stream (the group's c10d
   sequence number: how many collectives it has issued there).
2. A *decision* for ``D`` is an entry in one register per ``D``, extended only by
   compare-and-set, never changed: ``{"ranks": [...], "step": i}``. Every rank takes the
   first entry that names it, so every rank named by an entry takes that entry's step, and
   every later compile of ``D`` (a recompile, a late rank, a cache hit) reads it.
3. A rank that sees proposals for ``D`` from every rank of its *closure* (the members of its
   groups, and of its peers' groups, transitively) computes the decision (:func:`decide`:
   the first step on which they all issue one sequence over all the groups together) and
   adds it, unless an entry already names one of them. A rank that sees a peer compile
   another graph at the same place (evidence of another cut), or waits longer than
   ``Config.agree_timeout_s``, adds ``{"ranks": closure, "step": program order}``.
4. A rank whose every ladder step issues the program's own sequence publishes and goes on:
   whatever is decided, it issues that sequence.

Why every interleaving of compiles and runs pairs every collective. Assume only that the
program issues the same collectives on every rank. (a) Whatever the cut, the program's own
order pairs: each rank issues the program's collectives in program order. (b) A rewrite is
run only by the ranks of a decision entry made from complete proposals, which all proposed
the same ``D``, at the same stream positions, and issue the same sequence at that step over
all the groups of the graph: the same collectives, in one interleaving, from one point of
every group's stream (so also no cross-group wait cycle: every rank reaches each collective
in the same global order). No rank of that closure can take another entry: an entry is only
added when none already names a rank of it, and an entry made from complete proposals is
the whole closure. (c) Every other rank of those groups is in the closure. So any two ranks
that share a group take the same step for ``D``, and a rewritten graph runs only where all
its peers run the same rewritten graph from the same place. Waits end: each is bounded by
``agree_timeout_s``, and no rank waits for a peer that waits for it at the same place (they
see each other's proposal). What no compile-time scheme can make safe is a rank that
recompiles, with another cut, a stretch of the program the ranks already run rewritten (its
peers keep running the old graph): that is the run-time half below.

``check_ranks`` turns a difference in what ranks would issue (their rewrites differ, or a
peer issues another collective at the same place: the program differs) into
:class:`CollectiveMismatchError` on every rank at the graph's first call; a different cut
into graphs is not such a difference.

**At run time** (the rest of the job; ``ranks.tag``, ``runtime``). What a rank may assume
about its peers once the agreement is made, and how each assumption is kept:

- *They stay in one process group.* A compiled graph checks at every call that the default
  group is the one it agreed in (one attribute read); a group made anew makes it agree
  again in the new store, offering only what it can run now (``runtime.Guarded``).
- *They recompile together, or issue the same sequence when they recompile alone.* Two
  ranks whose graphs are specialized on different values (one reads the step under
  ``if rank == 0:``) will recompile apart later: :func:`decide` keeps the program's order
  for them from the start ("guards differ"), and a later graph of that function is not
  waited for. A function some rank has compiled cut in two ways (a print only some steps
  reach) is never rewritten ("cut varies"), and the ranks retire its earlier rewritten
  graphs together, before any runs the new one (``runtime.Guarded``). Where a rank still
  re-cuts or recompiles a rewritten stretch alone, the tags (``ranks.tag``) make the first
  pairing with a peer that runs the rewrite fail its check on every rank of the pair,
  before any value is returned. (A rank whose recompile can still issue the agreed
  sequence keeps it.) Graphs of the program's own order carry no tag: they pair with eager
  code, skipped frames and other cuts exactly as plain ``torch.compile``'s graphs do.
- *They are alive and compiling.* A rank whose process ends leaves ``gone/<rank>`` in the
  store at exit, and says where it runs (host, pid) when it starts, so a peer waiting for
  its proposal stops at once; a rank publishes how far it is in each group's stream every
  half second (``exchange.heartbeat``), so a peer that runs the stretch uncompiled (a frame
  Dynamo skipped) ends the wait at once; no wait is longer than the shortest timeout of the
  graph's groups.

Assumed at run time, beyond the program issuing the same collectives on every rank: the
same ``Config`` on every rank. A rank that Dynamo would run a rewritten function uncompiled
on (a skipped frame, a partial compile, the recompile limit) votes first (``runtime``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field, replace

from ..config import Config
from .check import Sequence, first_difference, has_peers

DEFAULT_TIMEOUT_S = 120.0
TIMEOUT_ENV = "FXCOALESCE_AGREE_TIMEOUT"


@dataclass(frozen=True, slots=True)
class Step:
    label: str
    config: Config
    without_symm: bool = False
    """A copy of the step before it without symmetric memory: taken only when preparing
    symmetric memory failed (on every rank alike, a vote) for the step before it."""


def ladder(cfg: Config) -> list[Step]:
    """The configurations ranks try in turn (each differs from the last), each step that may
    use symmetric memory followed by its copy without it."""
    from fxcoalesce.passes import program_order, without_compute_choices

    steps: list[Step] = []
    for label, c in (("as configured", cfg),
                     ("without the choices that read compute", without_compute_choices(cfg)),
                     ("in the program's own collective order", program_order(cfg))):
        if steps and _same(c, steps[-1].config):
            continue
        steps.append(Step(label, c))
        plain = replace(c, lower=False)
        if not _same(plain, c):
            steps.append(Step(f"{label}, without symmetric memory", plain, without_symm=True))
    return steps


def _same(a: Config, b: Config) -> bool:
    return (a.enabled_passes, a.slack_aware) == (b.enabled_passes, b.slack_aware)


def program_step(steps: list[Step]) -> int:
    return len(steps) - 1


def must_compare(program: Sequence, all_reduces: int, cfg: Config, check_ranks: bool) -> bool:
    """Do ranks agree on this graph? A function of the program's own sequence and ``cfg``
    only, so every rank answers alike."""
    from fxcoalesce.passes import changes_sequence

    return has_peers(program) and (check_ranks or (all_reduces > 0 and changes_sequence(cfg)))


def timeout_s(cfg: Config) -> float:
    """``cfg.agree_timeout_s``, else ``FXCOALESCE_AGREE_TIMEOUT``, else 120 s; an
    environment value that is no number of seconds >= 0 is an error (:func:`env_timeout`)."""
    if cfg.agree_timeout_s is not None:
        return float(cfg.agree_timeout_s)
    return env_timeout()


def env_timeout() -> float:
    import math
    import os

    raw = os.environ.get(TIMEOUT_ENV)
    if raw is None or not raw.strip():
        return DEFAULT_TIMEOUT_S
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not (math.isfinite(value) and value >= 0):
        raise ValueError(f"{TIMEOUT_ENV}={raw!r} is not a number of seconds >= 0 (e.g. "
                         f"{TIMEOUT_ENV}=60); unset it for the default, "
                         f"{DEFAULT_TIMEOUT_S:g} s")
    return value


# --- a rank-invariant form of a collective sequence ---

_SYMBOL = re.compile(r"\b([suq]\d+)\b")
_BRACKETS = re.compile(r"\[[^\]]*\]")


@dataclass(slots=True)
class Canon:
    """Renames one rank's groups by role (order of first use in the program) and its size
    symbols by order of first appearance: dynamo names a size after the first input that has
    it, which differs by rank; what a size *is* does not."""

    roles: dict[str | None, str] = field(default_factory=dict)
    symbols: dict[str, str] = field(default_factory=dict)

    def role(self, group: str | None) -> str:
        if group is None:
            return "g*"
        return self.roles.setdefault(group, f"g{len(self.roles)}")

    def text(self, group: str | None, desc: str) -> str:
        def sizes(m: re.Match) -> str:
            return _SYMBOL.sub(lambda s: self.symbols.setdefault(s.group(1),
                                                                 f"S{len(self.symbols)}"),
                               m.group(0))
        role = self.role(group)
        return f"{role}:{_BRACKETS.sub(sizes, _group_arg(desc, group, role))}"

    def sequence(self, seq: Sequence) -> list[str]:
        return [self.text(g, d) for g, d in seq]


def _group_arg(desc: str, group: str | None, role: str) -> str:
    """``desc`` with its group argument (the last one of every collective op's schema that
    takes a group: ``all_reduce(sum, 3)``) named by the group's role."""
    head, sep, rest = desc.partition(")")
    name, paren, args = head.partition("(")
    parts = args.split(", ")
    if group is None or not paren or parts[-1] != group:
        return desc
    return f"{name}({', '.join([*parts[:-1], role])}{sep}{rest}"


def canonical(program: Sequence, *others: Sequence) -> tuple[Canon, list[str], list[list[str]]]:
    """``program`` and ``others`` in one rank-invariant form: one renaming of the program's
    groups and symbols for all; a symbol only one of ``others`` has is numbered within it
    (so what one step introduces never shifts another step's names)."""
    canon = Canon()
    prog = canon.sequence(program)
    rest = []
    for seq in others:
        own = Canon(dict(canon.roles), dict(canon.symbols))
        rest.append(own.sequence(seq))
    return canon, prog, rest


# --- the decision, a pure function of complete proposals ---

def shown_text(text: str, names: list[str]) -> str:
    """A canonical collective as a person reads it: its groups by name again (``names``:
    the rank's groups by role)."""
    body = text.split(":", 1)[1]
    return re.sub(r"\bg(\d+)\b", lambda m: names[int(m.group(1))]
                  if int(m.group(1)) < len(names) else m.group(0), body)


def uses_symm(texts: list[str]) -> bool:
    """Does a canonical sequence run a symmetric-memory implementation?"""
    from ..lowering import SYMM_OPS

    names = {op.split("::")[1] for op in SYMM_OPS.values()}
    return any(t.split(":", 1)[1].split("(")[0] in names for t in texts)


def decide(proposals: dict[int, dict], steps: list[Step], check_ranks: bool) -> dict:
    """The decision entry of ranks that all proposed one program key.

    ``proposals[rank]``: ``{"groups": [[name, [members]], ...] (by role), "pos": {name:
    stream position or None}, "steps": [{"seq": [texts], "ws": bytes}, ...]}``. The entry:
    ``{"ranks", "step", "ws" (the largest symmetric workspace any rank sized for the step),
    "nosymm" (the step to take if preparing symmetric memory fails), "why", "differences",
    "error" (with ``check_ranks``, where the rewrites differ)}``."""
    ranks = sorted(proposals)
    entry: dict = {"ranks": ranks, "differences": []}
    last = program_step(steps)
    why = _misplaced(proposals)
    if why:
        return {**entry, "step": last, "ws": 0, "nosymm": last, "how": "cut differently",
                "why": why}
    why = _guarded_apart(proposals)
    if why:
        return {**entry, "step": last, "ws": 0, "nosymm": last, "how": "guards differ",
                "why": why}
    varied = sorted({(r, p["varied"]) for r, p in proposals.items() if p.get("varied")})
    if varied:
        r, fn = varied[0]
        return {**entry, "step": last, "ws": 0, "nosymm": last, "how": "cut varies",
                "why": f"rank {r} compiled {fn} cut into graphs in two ways (a graph break "
                       "that only some calls reach): a rank may re-cut it alone later"}

    def agreed(i: int) -> bool:
        return all(proposals[r]["steps"][i]["seq"] == proposals[ranks[0]]["steps"][i]["seq"]
                   for r in ranks)

    for i, step in enumerate(steps):
        if step.without_symm:
            continue
        if agreed(i):
            seqs = proposals[ranks[0]]["steps"]
            nosymm = next((j for j in range(i, len(steps))
                           if not uses_symm(seqs[j]["seq"]) and agreed(j)), last)
            out = {**entry, "step": i, "nosymm": nosymm,
                   "ws": max(proposals[r]["steps"][i]["ws"] for r in ranks),
                   "how": "fell back" if entry["differences"] else "agreed",
                   "why": f"the ranks issue one sequence {step.label}"}
            if check_ranks and entry["differences"]:
                out["error"] = entry["differences"][0]
            return out
        texts = [proposals[r]["steps"][i]["seq"] for r in ranks]
        shown = [[shown_text(t, [n for n, _ in proposals[r]["groups"]]) for t in seq]
                 for r, seq in zip(ranks, texts)]
        found = first_difference(shown, ranks) or first_difference(texts, ranks)
        entry["differences"].append(f"{step.label}: {found}")
    # the program key is equal, so the program's own sequences are: unreachable in practice
    return {**entry, "step": last, "ws": 0, "nosymm": last, "how": "fell back",
            "why": "no step agreed"}


def _guarded_apart(proposals: dict[int, dict]) -> str | None:
    """Why a later call may recompile this graph on some ranks only: a value one rank's
    graph is specialized on and another's is not (read under ``if rank == 0:``), or None.
    A rewrite agreed now would then meet, on the peers that keep it, a rank that runs the
    program differently cut or computed; the program's own order pairs whatever it runs."""
    ranks = sorted(proposals)
    sets = {r: set(proposals[r].get("guards", ())) for r in ranks}
    for r in ranks[1:]:
        if sets[r] != sets[ranks[0]]:
            only = sorted(sets[ranks[0]] ^ sets[r])
            a, b = (ranks[0], r) if only[0] in sets[ranks[0]] else (r, ranks[0])
            return (f"rank {a}'s graph is specialized on {', '.join(only[:3])} and rank "
                    f"{b}'s is not: when that value changes, rank {a} alone compiles again")
    return None


def _misplaced(proposals: dict[int, dict]) -> str | None:
    """Why ranks with one program key are not at one place of the program (a group playing
    different roles, or reached at different points of its stream), or None."""
    role: dict[str, int] = {}
    pos: dict[str, int] = {}
    for r in sorted(proposals):
        p = proposals[r]
        for i, (name, _) in enumerate(p["groups"]):
            if role.setdefault(name, i) != i:
                return f"group {name} plays different roles on different ranks"
        for name, at in p["pos"].items():
            if at is not None and pos.setdefault(name, at) != at:
                return (f"the ranks reach this graph at different points of group {name}'s "
                        "collective stream (they cut the program differently)")
    return None


@dataclass(slots=True)
class Agreement:
    """How the ranks agreed on one graph (``Report.agreement``)."""

    compared: bool = False
    step: str = "as configured"
    how: str = ""
    """"agreed" (every rank of the closure proposed, the first step agreed), "fell back"
    (an earlier step differed), "cut differently" (a peer compiles another graph here),
    "program differs" (a peer issues another collective here), "timed out", "peer gone" (a
    peer's process ended before it compiled this graph), "guards differ" (a rank's graph is
    specialized on a value its peers' are not: it would recompile alone), "cut varies" (a
    rank compiled this function cut in two ways: it may again, alone), "runs uncompiled" (a
    peer issued collectives here without compiling the graph), "decided before"
    (a recompile read the decision), "no wait" (every step issues the program's own sequence
    here, so any decision does), "" (not compared)."""
    differences: list[str] = field(default_factory=list)
    """The difference each rejected step had, first to last."""
    waited_s: float = 0.0
    ranks: list[int] = field(default_factory=list)
    why: str = ""
    """Why the ranks fell back to the program's own order (a peer's other cut, with where
    it cut its graph when known; who never compiled; ...), "" where they did not."""
    checks: list[str] = field(default_factory=list)
    """The run-time tags the graph carries (``ranks.tag``), one line each."""

    def as_dict(self) -> dict:
        return {"compared": self.compared, "step": self.step, "how": self.how,
                "why": self.why, "differences": self.differences,
                "waited_s": round(self.waited_s, 3), "ranks": self.ranks, "checks": self.checks}
