"""The agreement at compile time: the protocol and its state machine (the argument is in the
package docstring; ``store`` holds the keys).

    outcome = agree_graph("graph 3", cfg, steps, program, sequences, workspaces,
                          check_ranks=False)
    outcome.step          # the ladder step this rank compiles
    outcome.agreement     # what the report says (how, waited_s, differences)
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import re
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace

import torch.distributed as dist

from ..config import Config
from .store import RESERVED_ID, Store

log = logging.getLogger("fxcoalesce")
DEFAULT_TIMEOUT_S = 120.0
TIMEOUT_ENV = "FXCOALESCE_AGREE_TIMEOUT"
RECUT_WAIT_S = 5.0
"""The wait for a later graph of a function the ranks agreed a graph of (a recompile, the rest
after a graph break), and for a graph compared for ``check_ranks`` alone: peers that compile
it come within compile skew; a peer that recompiled nothing (it runs its cached graph), re-cut,
or waits in an eager collective that this graph issues (fuzz seeds 570517, 580632), never. A
peer later than that reads the "timed out" entry and runs the program's order too. (10 s met
a steady step's allowance, plain's time + 10 s, in 580632.)"""
POLL_S = (0.002, 0.05)
PARTED = ("guards differ", "cut differently", "runs uncompiled")
"""Ranks parted on a function for good (a skip holds in a group made anew): no wait again."""
FRESH = ("agreed", "fell back")
"""Entries made from every rank's proposal, read while every rank waits for them."""

Sequence = list[tuple[str | None, str]]
"""(group name, description) per collective, in issue order (``collectives.issue_sequence``)."""


# --- the ladder, and what is compared ---

@dataclass(frozen=True, slots=True)
class Step:
    label: str
    config: Config


def ladder(cfg: Config) -> list[Step]:
    """The configurations ranks try in turn (each differs from the last); the last is the
    program's own order, also where preparing symmetric memory failed (``compile.prepared``)."""
    from ..pipeline import rank_configs

    plain, program = rank_configs(cfg)
    steps: list[Step] = []
    for label, c in (("as configured", cfg), ("without the choices that read compute", plain),
                     ("in the program's own collective order", program)):
        if not (steps and _same(c, steps[-1].config)):
            steps.append(Step(label, c))
    return steps


def _same(a: Config, b: Config) -> bool:
    return (a.enabled_passes, a.slack_aware) == (b.enabled_passes, b.slack_aware)


def resolve(name: str):
    from torch.distributed.distributed_c10d import _resolve_process_group

    return _resolve_process_group(name)


def has_peers(sequence: Sequence) -> bool:
    """Do the sequence's collectives run over a real group of more than one rank?"""
    if not (dist.is_available() and dist.is_initialized()):
        return False
    for name in sorted({g for g, _ in sequence if g is not None}):
        try:
            group = resolve(name)
        except Exception:  # a name no group here has (hand-built graphs)
            continue
        if dist.get_backend(group) != "fake" and group.size() > 1:
            return True
    return False


def must_compare(program: Sequence, all_reduces: int, cfg: Config, check_ranks: bool) -> bool:
    """Do ranks agree on this graph? (The program's sequence and ``cfg`` only: alike.)"""
    from ..pipeline import changes_sequence

    return has_peers(program) and (check_ranks or (all_reduces > 0 and changes_sequence(cfg)))


def timeout_s(cfg: Config) -> float:
    """``cfg.agree_timeout_s``, else ``FXCOALESCE_AGREE_TIMEOUT``, else 120 s."""
    return float(cfg.agree_timeout_s) if cfg.agree_timeout_s is not None else env_timeout()


def env_timeout() -> float:
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


_SYMBOL = re.compile(r"\b([suq]\d+)\b")
_BRACKETS = re.compile(r"\[[^\]]*\]")


@dataclass(slots=True)
class Canon:
    """One rank's groups named by role (order of first use), its size symbols by order of
    appearance (Dynamo names a size after the first input that has it: by rank)."""

    roles: dict[str | None, str] = field(default_factory=dict)
    symbols: dict[str, str] = field(default_factory=dict)

    def role(self, group: str | None) -> str:
        return "g*" if group is None else self.roles.setdefault(group, f"g{len(self.roles)}")

    def text(self, group: str | None, desc: str) -> str:
        def sizes(m: re.Match) -> str:
            return _SYMBOL.sub(lambda s: self.symbols.setdefault(s.group(1),
                                                                 f"S{len(self.symbols)}"),
                               m.group(0))
        role = self.role(group)
        head, sep, rest = desc.partition(")")  # the group argument: last of the op's args
        name, paren, args = head.partition("(")
        parts = args.split(", ")
        if group is not None and paren and parts[-1] == group:
            desc = f"{name}({', '.join([*parts[:-1], role])}{sep}{rest}"
        return f"{role}:{_BRACKETS.sub(sizes, desc)}"

    def sequence(self, seq: Sequence) -> list[str]:
        return [self.text(g, d) for g, d in seq]


def canonical(program: Sequence, *others: Sequence) -> tuple[Canon, list[str], list[list[str]]]:
    """``program`` and ``others`` in one rank-invariant form."""
    canon = Canon()
    prog = canon.sequence(program)
    return canon, prog, [Canon(dict(canon.roles), dict(canon.symbols)).sequence(s)
                         for s in others]


def first_difference(sequences: list[list[str]], ranks: list[int]) -> str | None:
    """A sentence naming the first place where any rank's sequence differs from the first's."""
    ref = sequences[0]
    for seq, rank in zip(sequences[1:], ranks[1:]):
        if seq == ref:
            continue
        i = next((k for k, (a, b) in enumerate(zip(ref, seq)) if a != b), min(len(ref), len(seq)))
        mine = seq[i] if i < len(seq) else "nothing (its sequence ends)"
        theirs = ref[i] if i < len(ref) else "nothing (its sequence ends)"
        return (f"collective #{i}: rank {ranks[0]} issues {theirs}, rank {rank} issues {mine} "
                f"({len(ref)} vs {len(seq)} collectives in all)")
    return None


# --- the decision: a pure function of complete proposals ---

def decide(proposals: dict[int, dict], steps: list[Step], check_ranks: bool) -> dict:
    """The decision entry of ranks that all proposed one program key: the first step on which
    they all issue one sequence over all the groups together, unless they stand at different
    places, their guards differ or a rank's cut of the function varied (then the program's
    order). ``proposals[rank]``: ``{"groups": [[name, [members]], ...] (by role), "pos":
    {name: stream position}, "guards", "varied", "steps": [{"seq", "ws"}, ...]}``."""
    ranks = sorted(proposals)
    entry: dict = {"ranks": ranks, "differences": []}
    last = len(steps) - 1  # the program's own order
    for how, why in (("cut differently", _misplaced(proposals)),
                     ("guards differ", _guarded_apart(proposals)),
                     ("cut varies", _varied(proposals))):
        if why:
            return {**entry, "step": last, "ws": 0, "how": how, "why": why}

    def agreed(i: int) -> bool:
        return all(proposals[r]["steps"][i]["seq"] == proposals[ranks[0]]["steps"][i]["seq"]
                   for r in ranks)

    for i, step in enumerate(steps):
        if agreed(i):
            out = {**entry, "step": i,
                   "ws": max(proposals[r]["steps"][i]["ws"] for r in ranks),
                   "how": "fell back" if entry["differences"] else "agreed",
                   "why": f"the ranks issue one sequence {step.label}"}
            if check_ranks and entry["differences"]:
                out["error"] = entry["differences"][0]
            return out
        texts = [proposals[r]["steps"][i]["seq"] for r in ranks]
        shown = [[_shown(t, [n for n, _ in proposals[r]["groups"]]) for t in seq]
                 for r, seq in zip(ranks, texts)]
        found = first_difference(shown, ranks) or first_difference(texts, ranks)
        entry["differences"].append(f"{step.label}: {found}")
    return {**entry, "step": last, "ws": 0, "how": "fell back",
            "why": "no step agreed"}


def _shown(text: str, names: list[str]) -> str:
    """A canonical collective with its groups named again (``names``: by role)."""
    return re.sub(r"\bg(\d+)\b", lambda m: names[int(m.group(1))]
                  if int(m.group(1)) < len(names) else m.group(0), text.split(":", 1)[1])


def _guarded_apart(proposals: dict[int, dict]) -> str | None:
    """A guard one rank's graph has and another's lacks: it recompiles alone."""
    ranks = sorted(proposals)
    sets = {r: set(proposals[r].get("guards", ())) for r in ranks}
    for r in ranks[1:]:
        if sets[r] != sets[ranks[0]]:
            only = sorted(sets[ranks[0]] ^ sets[r])
            name = only[0].split(" == ")[0]
            if sum(k.split(" == ")[0] == name for k in only) > 1:
                return (f"{name.split(' ', 1)[1]} differs between ranks {ranks[0]} and {r}: "
                        "module-level state one rank may change alone")
            a, b = (ranks[0], r) if only[0] in sets[ranks[0]] else (r, ranks[0])
            return (f"rank {a}'s graph is specialized on {', '.join(only[:3])} and rank "
                    f"{b}'s is not: when that value changes, rank {a} alone compiles again")
    return None


def _varied(proposals: dict[int, dict]) -> str | None:
    varied = sorted({(r, p["varied"]) for r, p in proposals.items() if p.get("varied")})
    if not varied:
        return None
    r, fn = varied[0]
    return (f"rank {r} compiled {fn} cut into graphs in two ways (a graph break that only "
            "some calls reach): a rank may re-cut it alone later")


def _misplaced(proposals: dict[int, dict]) -> str | None:
    """Why ranks with one program key are not at one place of the program, or None."""
    role: dict[str, int] = {}
    pos: dict[str, int] = {}
    names = {r: [name for name, _ in p["groups"]] for r, p in proposals.items()}
    for r in sorted(proposals):
        p = proposals[r]
        for i, (name, members) in enumerate(p["groups"]):
            if role.setdefault(name, i) != i:
                return f"group {name} plays different roles on different ranks"
            # every member of the group that proposed runs it in the same role
            if other := next((q for q in members if q in names
                              and (names[q] + [None] * (i + 1))[i] != name), None):
                return (f"the ranks run this graph over other groups (group {name} on rank "
                        f"{r}, not on its member rank {other}: threads, each with its own)")
        for name, at in p["pos"].items():
            if at is not None and pos.setdefault(name, at) != at:
                return (f"the ranks reach this graph at different points of group {name}'s "
                        "collective stream (they cut the program differently)")
    return None


@dataclass(slots=True)
class Agreement:
    """How the ranks agreed on one graph (``Report.agreement``). ``how``: "agreed", "fell
    back" (an earlier step differed), "cut differently", "timed out",
    "peer gone", "guards differ", "cut varies", "runs uncompiled" (a peer runs this stretch
    uncompiled), "busy" (a peer waits for this rank on another graph: two threads), "store
    gone" (its host ended: the program's order, with the reserved tag where this rank runs the
    function rewritten, so that a peer still running the rewrite stops with it),
    "decided before", "no wait" (every step issues the program's own sequence), ""."""

    compared: bool = False
    step: str = "as configured"
    how: str = ""
    differences: list[str] = field(default_factory=list)
    waited_s: float = 0.0
    ranks: list[int] = field(default_factory=list)
    why: str = ""
    checks: list[str] = field(default_factory=list)
    """The run-time tags the graph carries (``ranks.tag``), one line each."""

    def as_dict(self) -> dict:
        return {**asdict(self), "waited_s": round(self.waited_s, 3)}


# --- this process's state ---

@dataclass(slots=True)
class _Local:
    """One program key here: its round, and the sequence this rank issues for it."""

    round: int = 1
    active: str | None = None
    entry: dict | None = None
    rewritten: bool = False


@dataclass(slots=True)
class RankEnv:
    """This rank's state, in one object (:data:`PROCESS` is the real one, :func:`process_env`
    renews it for each new store; a test makes one per simulated rank over one in-memory
    store): its store, its groups' members, stream positions and timeouts, what it knows in
    this store, and what outlives a group, as Dynamo's compiled graphs do."""

    exchange: Store | None = None
    members: Callable[[str], list[int]] = lambda g: dist.get_process_group_ranks(resolve(g))
    position: Callable[[str], int | None] = lambda g: position(resolve(g))
    timeout: Callable[[str], float | None] = lambda g: group_timeout_s(resolve(g))
    local: dict = field(default_factory=dict)
    rewritten: set = field(default_factory=set)
    """Functions this rank runs a rewritten graph of in this store: later graphs are tagged."""
    alone: dict = field(default_factory=dict)
    """Function (:func:`family`) -> how its ranks parted (:data:`PARTED`), for good."""
    retired: set = field(default_factory=set)
    """Functions whose rewritten graphs this rank runs in the program's own order for good."""
    cuts: dict = field(default_factory=dict)
    """Frame -> the cuts this rank compiled it with (a function cut two ways: :func:`varied`)."""
    agreed: set = field(default_factory=set)
    """Functions this rank has agreed a graph of (in any store: a group made anew)."""
    stores: list = field(default_factory=list)  # kept alive: a freed one's id could return
    max_id: int = 0


PROCESS = RankEnv()


def process_env() -> RankEnv:
    """:data:`PROCESS`, on this process's default process group's store (renewed in place,
    and announced, when the group was made anew)."""
    store = dist.distributed_c10d._get_default_store()
    env = PROCESS
    if not env.stores or env.stores[-1] is not store:
        env.exchange = Store(store, dist.get_rank())
        env.exchange.floor = env.max_id
        env.exchange.announce()
        env.stores.append(store)
        env.local, env.rewritten = {}, set()
    return env


def announce() -> None:
    """Say where this rank runs (a backend is made): its death is seen before it compiles."""
    try:
        if dist.is_initialized() and dist.get_backend() != "fake" and dist.get_world_size() > 1:
            process_env()
    except Exception:  # a group being torn down: peers fall back to the timeouts
        return


def position(group) -> int | None:
    """How many collectives this rank has issued on ``group`` (its c10d sequence number)."""
    try:
        return int(group._get_sequence_number_for_group())
    except Exception:  # a backend without one: no position evidence for this group
        return None


def positions() -> dict[str, int]:
    """This rank's position in every group it has."""
    out = {}
    for group in list(dist.distributed_c10d._world.pg_names):
        at = position(group)
        if at is not None:
            out[group.group_name] = at
    return out


def group_timeout_s(group) -> float | None:
    """A process group's own timeout for a collective, in seconds (None if unknown)."""
    import torch

    for device in getattr(group, "_device_types", None) or [torch.device("cpu")]:
        try:
            return group._get_backend(device).options._timeout.total_seconds()
        except Exception:  # a backend without options (fake, custom): nothing to bound by
            continue
    return None


# --- what Dynamo says of the graph being compiled ---

def frame_identity() -> str:
    """The function Dynamo is compiling ("name@file:first line"), "" outside a compile."""
    from torch._guards import TracingContext

    ctx = TracingContext.try_get()
    code = ctx.traced_code[0] if ctx is not None and getattr(ctx, "traced_code", None) else None
    return "" if code is None else code_key(code)


def code_key(code) -> str:
    return f"{code.co_name}@{os.path.basename(code.co_filename)}:{code.co_firstlineno}"


_RESUME = re.compile(r"^torch_dynamo_resume_in_(.+)_at_\d+$")


def family(frame: str) -> str:
    """The user function a :func:`frame_identity` belongs to ("f@file.py"): a graph break's
    resume function (``torch_dynamo_resume_in_f_at_12``) belongs to ``f``."""
    name, _, rest = frame.partition("@")
    m = _RESUME.match(name)
    return f"{m.group(1) if m else name}@{rest.rsplit(':', 1)[0]}"


def _inside(alone: dict) -> str | None:
    """The function of ``alone`` on this thread's stack, if any (a graph compiled inside it
    is as likely compiled on this rank alone)."""
    import sys

    f = sys._getframe(1)
    while f is not None:
        fam = family(code_key(f.f_code))
        if fam in alone:
            return fam
        f = f.f_back
    return None


def cut_at() -> str | None:
    """Where the graph Dynamo is compiling was cut ("file:line: code (why)"), or None."""
    try:
        from torch._dynamo.symbolic_convert import InstructionTranslator

        reason = InstructionTranslator.current_tx().output.compile_subgraph_reason
    except Exception:  # not inside Dynamo, or another torch's layout: nothing known
        return None
    if reason is None or not getattr(reason, "graph_break", False) or not reason.user_stack:
        return None
    frame = reason.user_stack[-1]
    why = str(reason.reason).strip().splitlines()[0] if reason.reason else "a graph break"
    code = (frame.line or "").strip()
    return f"{os.path.basename(frame.filename)}:{frame.lineno}: {code} ({why})"


VALUE_GUARDS = ("CONSTANT_MATCH", "EQUALS_MATCH")
_COUNTED = re.compile(r"___\d+")
TORCH_OWN = re.compile(r"\bG\['(torch'|__import_torch(_dot_|'))")
"""Guards on torch's own modules: process-wide settings, alike on every rank."""


def guard_keys() -> list[str]:
    """What the graph Dynamo is compiling is specialized on, by name, every kind that a later
    call can change on one rank alone: value guards ("EQUALS_MATCH L['flag']") and the shape
    env's guards on sizes and SymInts, their symbols named by source
    ("Ne(Mod(L['step'] + 1, 5), 0)"). A tensor's own metadata guard is left out: a tensor only
    one rank reads (a row-parallel bias on rank 0) keeps its shape. [] outside a compile."""
    from torch._guards import TracingContext

    ctx = TracingContext.try_get()
    out = set()
    for g in getattr(getattr(ctx, "guards_context", None), "dynamo_guards", None) or ():
        try:
            kind = g.create_fn_name()
        except Exception:  # a guard without a builder name
            continue
        if kind in VALUE_GUARDS and g.name and not TORCH_OWN.search(g.name):
            value = _module_value(g.name) if _MODULE_NAME.match(g.name) else None
            out.add(f"{kind} {_COUNTED.sub('___', g.name)}"
                    + ("" if value is None else f" == {value}"))
    shape_env = getattr(getattr(ctx, "fake_mode", None), "shape_env", None)
    if shape_env is not None:
        names = {}
        for sym, sources in getattr(shape_env, "var_to_sources", {}).items():
            if sources:
                name = sources[0].name
                names[str(sym)] = name if isinstance(name, str) else name()
        for guard in getattr(shape_env, "guards", ()):
            text = re.sub(r"\b[suq]\d+\b", lambda m: names.get(m.group(0), "?"), str(guard.expr))
            out.add(f"SHAPE {text}")
    return sorted(out)


_MODULE_NAME = re.compile(r"^G\['\w+'\]$")
"""A module-level name itself ("G['PHASE']"), not an attribute reached through one (a
model's shard offsets: ``G['fn']._modules['embed'].start``, alike in kind, not in value)."""


def _module_value(name: str) -> str | None:
    """The value of a module-level name the graph is specialized on, as the frame being
    compiled sees it, shortened, or None. Ranks whose values differ hold rank-local state
    there (a phase, a flag), which one rank may change alone, past its recompile limit too."""
    try:
        from torch._dynamo.symbolic_convert import InstructionTranslator

        value = eval(name, {"__builtins__": {}},  # noqa: S307 (a guard's own source)
                     {"G": InstructionTranslator.current_tx().f_globals})
    except Exception:  # a source Dynamo writes with its own helpers: the name alone
        return None
    if isinstance(value, (set, frozenset)):  # its order follows the process's hash seed
        value = sorted(map(repr, value))
    return repr(value)[:40]


# --- one rank's agreement on one key ---

@dataclass(slots=True)
class Outcome:
    step: int
    agreement: Agreement
    key: str = ""
    fresh: bool = False
    """Every rank of the decision took part in it just now (collective set-up may run)."""
    ws: int = 0
    error: str | None = None
    digests: list[str] = field(default_factory=list)
    tag: int = 0
    tagged: bool = False
    """The graph carries the tag: its step is rewritten, or a rank of the decision runs a
    rewritten graph of its function (a re-cut or recompile of one)."""


def _digest(texts: list[str]) -> str:
    return hashlib.sha256("\n".join(texts).encode()).hexdigest()[:24]


def seen(cuts: dict, frame: str, cut: str | None) -> None:
    if frame:
        cuts.setdefault(frame, set()).add(cut)


def varied(cuts: dict, frame: str) -> str | None:
    """A frame of ``frame``'s function that this rank compiled cut in two ways, or None."""
    fam = family(frame) if frame else None
    return next((f.split("@")[0] for f, how in cuts.items()
                 if fam is not None and family(f) == fam and len(how) > 1), None)


def _issuing(digests: list[str], active: str, preferred: int | None) -> int | None:
    if preferred is not None and preferred < len(digests) and digests[preferred] == active:
        return preferred
    return next((i for i, dg in enumerate(digests) if dg == active), None)


def agree_graph(name: str, cfg: Config, steps: list[Step], program: Sequence,
                sequences: list[Sequence], workspaces: list[int], *, check_ranks: bool,
                frame: str = "", cut: str | None = None, guards: list[str] | None = None,
                env: RankEnv | None = None) -> Outcome:
    """Agree with the ranks sharing this graph's groups on which of ``steps`` to compile.
    ``sequences[i]`` / ``workspaces[i]``: what step i issues here and the symmetric workspace
    it sizes; ``frame`` (:func:`frame_identity`), ``cut`` (:func:`cut_at`) and ``guards``
    (:func:`guard_keys`) go into the proposal."""
    try:
        env = env or process_env()
        return _agree(name, cfg, steps, program, sequences, workspaces, check_ranks, frame,
                      cut, guards, env)
    except dist.DistError as e:  # the store's host process ended (its part of the job done)
        marked = env is not None and bool(frame) and family(frame) in env.rewritten
        why = f"the agreement's store is gone ({str(e).splitlines()[0][:80]})"
        log.warning("fxcoalesce[%s]: %s: this rank compiles the program's own order%s", name,
                    why, ", tagged as a run left uncompiled" if marked else "")
        _, _, texts = canonical(program, *sequences)
        return Outcome(len(steps) - 1, Agreement(compared=True, step=steps[-1].label,
                                                 how="store gone", why=why),
                       digests=[_digest(t) for t in texts], tag=RESERVED_ID if marked else 0,
                       tagged=marked)


def _agree(name, cfg, steps, program, sequences, workspaces, check_ranks, frame, cut, guards,
           env) -> Outcome:
    ex = env.exchange
    fam = family(frame) if frame else ""
    later = bool(fam) and fam in env.agreed  # a recompile or re-cut of a function
    seen(env.cuts, frame, cut)
    marked = bool(fam) and fam in env.rewritten
    canon, prog, texts = canonical(program, *sequences)
    groups = [g for g in canon.roles if g is not None]
    members = {g: env.members(g) for g in groups}
    sizes = [f"{canon.role(g)}={len(members[g])}" for g in groups]
    config_key = repr(replace(cfg, dump_dir=None, dump_passes=False, strict=False))
    d = hashlib.sha256("\n".join([config_key, frame, *sizes, *prog]).encode()).hexdigest()[:32]
    digests = [_digest(t) for t in texts]
    evident = all(t == prog for t in texts)
    mine = env.local.get(d)
    if mine is not None and mine.active is not None:
        # a later graph of the key: it issues what this rank committed to, else a new round
        step = _issuing(digests, mine.active, mine.entry.get("active_step"))
        if step is not None:
            agreement = Agreement(compared=True, step=steps[step].label, how="decided before",
                                  ranks=list(mine.entry["ranks"]))
            return Outcome(step, agreement, key=d, digests=digests,
                           ws=mine.entry.get("ws", 0),
                           tag=mine.entry.get("id", 0), tagged=mine.entry.get("tagged", False))
    committed = mine is not None and mine.rewritten
    if mine is None:
        mine = env.local[d] = _Local()
    elif not (mine.active is None and evident and (later or not check_ranks)):
        mine.round += 1
    key = d if mine.round == 1 else f"{d}.{mine.round}"
    run = _Run(name, cfg, env, key, steps, program, canon, check_ranks)
    run.cut, run.family, run.marked, run.later = cut, fam or None, marked or committed, later
    run.checked_only = evident and check_ranks
    run.inside = _inside(env.alone) if env.alone else None
    run.proposal = ex.propose(key, {
        "groups": [[g, members[g]] for g in groups],
        "pos": {g: env.position(g) for g in groups}, "guards": guards or [],
        "marked": marked, "varied": varied(env.cuts, frame),
        "steps": [{"seq": t, "ws": w} for t, w in zip(texts, workspaces)]})
    ex.note({"d": key, "pos": run.proposal["pos"], "cut": cut})
    if evident and not committed and not marked and (later or not check_ranks):
        # every step issues the program's sequence here: so does any decision (with
        # check_ranks, a function's first graph is compared all the same)
        run.noted(texts[0])
        if fam:
            env.agreed.add(fam)
        return Outcome(0, Agreement(compared=True, step=steps[-1].label, how="no wait",
                                    ranks=[ex.rank]), key=d, digests=digests)
    entry, how, waited = run.wait()
    if how == "cut varies" and fam:  # every rank of the closure is here: retire together
        env.retired.add(fam)
        env.rewritten.discard(fam)
    agreement = Agreement(compared=True, step=steps[entry["step"]].label, how=how,
                          differences=list(entry.get("differences", [])), waited_s=waited,
                          ranks=list(entry["ranks"]), why=entry.get("why", ""))
    out = Outcome(entry["step"], agreement, key=d, fresh=how in FRESH,
                  ws=entry.get("ws", 0), error=entry.get("error"),
                  digests=digests, tag=entry.get("id", 0), tagged=entry.get("tagged", False))
    env.max_id = max(env.max_id, out.tag)
    if committed and how not in FRESH and out.error is None:
        _changed(out, cfg, name, agreement.step)  # the peers issue the old rewrite
    mine.entry, mine.active = {**entry, "active_step": entry["step"]}, entry["digest"]
    mine.rewritten = entry["digest"] != _digest(prog)
    if out.error is None and digests[out.step] != mine.active:
        step = _issuing(digests, mine.active, None)
        if step is None:
            _changed(out, cfg, name, agreement.step)
        else:
            out.step, out.fresh = step, False
    mine.entry["active_step"] = out.step
    if fam and digests[out.step] != digests[-1]:
        env.rewritten.add(fam)
    if fam:
        env.agreed.add(fam)
    run.noted(texts[out.step])
    return out


def in_program_order(outcome: Outcome, env: RankEnv | None = None) -> Outcome:
    """``outcome`` at the program's own order (preparing symmetric memory failed, on all)."""
    step = len(outcome.digests) - 1
    mine = (env or process_env()).local[outcome.key]
    mine.active, mine.entry["active_step"] = outcome.digests[step], step
    return replace(outcome, step=step, fresh=False)


_CHANGED = ("this rank compiled again a graph that the ranks agreed to run rewritten ({step}), "
            "its passes no longer issue the agreed collectives there, and its peers did not "
            "compile it again (its compute changed on this rank only): the ranks could not "
            "pair them. Compile such a program with Config(passes=('schedule',)) or plain "
            "torch.compile")


def _changed(out: Outcome, cfg: Config, name: str, step: str) -> None:
    """This rank can no longer issue what its peers agreed to run. With run-time checks it
    runs the program's own order, whose tags make the first pairing with a peer that still
    runs the rewrite raise on every rank of it; without, it raises at the graph's first call."""
    if not cfg.run_checks:
        out.error = _CHANGED.format(step=step)
        return
    log.warning("fxcoalesce[%s]: %s; it runs the program's own order, and if its peers still "
                "run the rewrite, the first such collective raises CollectiveMismatchError",
                name, _CHANGED.format(step=step).split(": the ranks")[0])
    out.step, out.fresh = len(out.digests) - 1, False


class _Run:
    """One rank's agreement on program key ``d``: propose, then wait for a decision, adding
    one when the proposals are complete or the evidence says the peers will not come."""

    def __init__(self, name, cfg, env, d, steps, program, canon, check_ranks):
        self.name, self.cfg, self.d, self.steps = name, cfg, d, steps
        self.env, self.ex = env, env.exchange
        self.program, self.canon, self.check_ranks = program, canon, check_ranks
        self.rank, self.proposal, self.cut, self.family = self.ex.rank, {}, None, None
        self.inside: str | None = None
        self.marked = self.checked_only = self.later = False
        self.proposals: dict[int, dict] = {}

    def _entry_of(self, entries: list[dict]) -> dict | None:
        return next((e for e in entries if self.rank in e["ranks"]), None)

    def wait(self) -> tuple[dict, str, float]:
        """(the decision entry naming this rank, how it was reached, seconds waited)."""
        t0, pause = time.monotonic(), POLL_S[0]
        limit, bound = self._limit()
        proposals = self.proposals = {self.rank: self.proposal}
        said: list[int] | None = None
        try:
            while True:
                entry = self._entry_of(self.ex.entries(self.d))
                if entry is None:
                    for r in sorted(_closure(proposals) - set(proposals)):
                        if (p := self.ex.proposal(self.d, r)) is not None:
                            proposals[r] = p
                    closure = _closure(proposals)
                    missing = sorted(closure - set(proposals))
                    if missing != said:
                        self.ex.waits(self.d, missing)
                        said = missing
                    entry = self._step(closure, missing, time.monotonic() - t0, limit, bound)
                if entry is not None:
                    if entry["how"] in PARTED and self.family:
                        self.env.alone.setdefault(self.family, entry["how"])
                    self._warn(entry)
                    return entry, entry["how"], time.monotonic() - t0
                time.sleep(pause)
                pause = min(POLL_S[1], pause * 2)
        finally:
            if said is not None:
                self.ex.waits(None)

    def _step(self, closure, missing, waited, limit, bound) -> dict | None:
        """The entry to add now, if any: the decision, or the program's order for a reason."""
        if not missing:
            return self._add(decide({r: self.proposals[r] for r in closure}, self.steps,
                                    self.check_ranks))
        if (alone := self.family if self.family in self.env.alone else self.inside):
            how = self.env.alone[alone]
            return self._fallback(closure, how, f"the ranks parted on {alone.split('@')[0]} "
                                  f"before ({how}): so do its later graphs")
        if gone := [r for r in missing if self.ex.gone(r) is not None]:
            return self._fallback(closure, "peer gone", f"rank(s) {gone} ended before "
                                                        "compiling this graph")
        found = self._evidence(closure) or self._uncompiled(missing) or self._busy(missing)
        if found:
            return self._fallback(closure, *found)
        if waited > limit:
            why = (f"waited {limit:g} s ({bound}; Config.agree_timeout_s or {TIMEOUT_ENV} sets "
                   f"it) for rank(s) {missing} to compile this graph; they did not (they never "
                   "reach it, cut the program into other graphs, or are slow)")
            return self._fallback(closure, "timed out", why)
        return None

    def _limit(self) -> tuple[float, str]:
        """(the longest wait, what sets it): ``agree_timeout_s``, :data:`RECUT_WAIT_S` for a
        later graph of a function the ranks agreed on or a graph compared for ``check_ranks``
        alone, or half the graph's groups' shortest timeout if shorter."""
        limit, bound = timeout_s(self.cfg), "agree_timeout_s"
        if (self.marked or self.later or self.checked_only) and RECUT_WAIT_S < limit:
            limit, bound = RECUT_WAIT_S, ("a graph compared for check_ranks alone"
                                          if self.checked_only else
                                          "a later graph of a function the ranks agreed on")
        for g in self.proposal["pos"]:
            t = self.env.timeout(g)
            if t is not None and t / 2 < limit:  # a peer already in a collective outlives it
                limit, bound = t / 2, f"half the timeout of group {g}"
        return limit, bound

    def _warn(self, entry: dict) -> None:
        """One line for a graph the ranks did not agree to compile as configured (info where
        two threads only crossed: ``busy``)."""
        how, differences = entry["how"], "; ".join(entry["differences"])
        why = f"ranks would issue different collectives ({differences})" if differences else \
            entry["why"]
        if how != "agreed":
            (log.info if how == "busy" else log.warning)(
                "fxcoalesce[%s]: %s: every rank compiles this graph %s", self.name, why,
                self.steps[entry["step"]].label)

    def _add(self, entry: dict) -> dict:
        seqs = self.proposal["steps"]
        digest = _digest(seqs[entry["step"]]["seq"])
        marked = any(p.get("marked") for p in self.proposals.values()) or self.marked
        entry = {**entry, "digest": digest, "id": self.ex.new_id(),
                 "tagged": self.cfg.run_checks and entry["how"] != "cut varies" and (
                     marked or digest != _digest(seqs[-1]["seq"]))}
        return self._entry_of(self.ex.add(self.d, entry)) or entry

    def _fallback(self, closure: set[int], how: str, why: str) -> dict:
        """The program's own order for ``closure``: right however each rank cuts the program."""
        last = len(self.steps) - 1
        return self._add({"ranks": sorted(closure), "step": last, "ws": 0,
                          "how": how, "why": why, "differences": []})

    def _uncompiled(self, missing: list[int]) -> tuple[str, str] | None:
        """A missing peer's Dynamo is done with this function at or before where this graph
        starts without proposing it (``hooks``): it runs it uncompiled from there, or it
        compiled it from here cut otherwise, before any collective (a disabled call first),
        or it compiled a function that this rank runs uncompiled and that calls this one
        (``outer``): that graph inlines this one or breaks at it."""
        pos = self.proposal["pos"]
        mine = {s["fam"] for s in self.ex.notes(self.rank) if s.get("how") == "skipped"}
        outer = _inside(dict.fromkeys(mine - {self.family})) if mine else None
        for q in missing:
            for s in self.ex.notes(q):
                if "fam" not in s:  # a graph it proposed (read by _evidence)
                    continue
                if outer and s["fam"] == outer and s["how"] == "compiled":
                    return "cut differently", (f"rank {q} compiled {outer.split('@')[0]}, "
                                               "which this rank runs uncompiled around this "
                                               "graph: it will not propose it")
                if s["fam"] != self.family:
                    continue
                theirs = [(s["pos"][g], at) for g, at in pos.items()  # its groups only
                          if at is not None and g in s["pos"]]
                name = s["fam"].split("@")[0]
                if s["how"] == "skipped" and all(p <= at for p, at in theirs):
                    return "runs uncompiled", (f"rank {q} runs {name} uncompiled (Dynamo "
                                               "skipped it there)")
                if s["how"] == "compiled" and theirs and all(p == at for p, at in theirs) and (
                        self.ex.proposal(self.d, q) is None):
                    return "cut differently", (f"rank {q} compiled {name} from here without "
                                               "this graph (it cut it before any collective)")
        return None

    def _busy(self, missing: list[int]) -> tuple[str, str] | None:
        """A missing peer waits on another key for this rank's proposal, which this rank
        cannot give while it waits here (two threads, each with its own group, reached their
        graphs in other orders on two ranks: Dynamo's compile lock holds the other). The
        rank waiting on the smaller key gives way; the other goes on waiting, and gets it."""
        for q in missing:
            d, theirs = self.ex.waiting(q)
            if d is not None and self.d < d and self.rank in theirs and (
                    self.ex.proposal(d, self.rank) is None):
                return "busy", (f"rank {q} waits for this rank's proposal for another graph "
                                "(another thread of this rank compiles it next)")
        return None

    def _evidence(self, closure: set[int]) -> tuple[str, str] | None:
        """A peer's own graphs show it will not compile this one here: one of them starts
        where this one does, or covers where it starts (it cut the program otherwise)."""
        pos = self.proposal["pos"]
        for q in sorted(closure - {self.rank}):
            for line in _folded(self.ex.notes(q)):
                for g, at in pos.items():
                    theirs, issued = line["pos"].get(g), line.get("m", {}).get(g)
                    if line["d"] == self.d or at is None or theirs is None:
                        continue
                    if theirs > at:  # positions only grow: it is past this graph's start
                        return "runs uncompiled", (
                            f"rank {q} compiled a graph from collective {theirs} of group {g}: "
                            f"it ran collective {at} outside a graph it compiled (eagerly, "
                            "a disabled function, or a frame Dynamo skipped)")
                    if theirs == at or issued and theirs < at < theirs + issued:
                        where = (f": it cut its graph at {line['cut']}" if line.get("cut") else
                                 f": this rank cut its graph at {self.cut}" if self.cut else "")
                        return "cut differently", (f"rank {q} runs collective {at} of group "
                                                   f"{g} in another graph{where}")
        return None

    def noted(self, texts: list[str]) -> None:
        """Note how many collectives this graph issues on each group (peers' evidence)."""
        counts: dict[str, int] = {}
        for t in texts:
            role = t.split(":", 1)[0]
            counts[role] = counts.get(role, 0) + 1
        m = {g: counts.get(self.canon.role(g), 0) for g in self.proposal["pos"]}
        self.ex.note({"d": self.d, "pos": self.proposal["pos"], "m": m})


def _closure(proposals: dict[int, dict]) -> set[int]:
    """Every rank of every group of the known proposals (peers' groups too)."""
    return {r for p in proposals.values() for _, ranks in p["groups"] for r in ranks}


def _folded(lines: list[dict]) -> list[dict]:
    """A rank's notes of graphs, one per graph: the proposal's line with its decided counts."""
    out: dict[tuple, dict] = {}
    for line in (x for x in lines if "d" in x):
        key = (line["d"], json.dumps(line["pos"], sort_keys=True))
        out.setdefault(key, {}).update(line)
    return list(out.values())
