"""The oracle: plain ``torch.compile`` is the reference (checked against eager execution of
the same program), fxcoalesce must match it on every rank at every step, or stop loudly: a
rank that sees why says so, and every other rank fails no later and no less clearly than
under plain when a peer raises.

Outcomes of a program under a variant, judged against plain:

- ``ok``: every rank finished as under plain (done, or stopped by a smaller group at the same
  step) with every step's outputs close to plain's, and no step slower than plain's
  allowance (below).
- ``loud`` (counted apart, not a failure while plain runs the program right; the promise
  of issue 49): where fxcoalesce must stop, the rank(s) that see it raise
  ``fxcoalesce.CollectiveMismatchError`` (or an error whose message names fxcoalesce and a
  fix: ``loud()``), and every other rank still in the job fails no later and no less
  clearly than under plain ``torch.compile`` when a peer raises: its own loud error, or
  the transport's error as the stopped rank's process ends (gloo's "Connection closed by
  peer", a reset or closed connection: ``transport()``) within the step's allowance
  (``slow`` below), never a group timeout (``hang``) or an abort (``killed``); and every
  value returned before was right. At least one rank is loud.

Failures, the first that applies in this order:

- ``wrong``: a value on some rank at some step not close to plain's (even if an error follows).
- ``killed``: a rank ended by a signal, "terminate called" in its stderr, or gloo's
  collective-mismatch abort (a size mismatch: "Received data size doesn't match",
  "op.preamble.length"), whatever the other ranks did.
- ``hang``: the run passed its wall limit, or a rank's error is a group timeout.
- ``partial_error``: an error on some ranks while the others finished normally (or left
  no end), or a loud error on some ranks and on another one an error that is neither loud
  nor the transport's (a Dynamo or fxcoalesce error that says nothing of what to change).
- ``error``: an error on every rank, none of which says what fxcoalesce wants changed.
- ``missing``: a rank finished with fewer steps, or another status, than under plain.
- ``slow``: a step (or the step that raised) slower than plain allows. Fair to compile time:
  a step that made the first call of a compiled function may take 1.5x plain's slowest rank
  at that step + 15 s (fxcoalesce compiles more than plain does); any other step plain's
  slowest non-first step (any rank), or plain's slowest rank at that step, + 10 s. A wait
  to a group timeout (40 s by default) passes either allowance unless plain itself was slow
  there; scheduler noise on shared cores does not.

Before any of this, plain is judged against eager (same tolerances): ``eager_failed``,
``plain_failed`` (some rank did not finish) and ``plain_wrong`` leave the program out.
Tolerances are per dtype and relative to the reference's size (fxcoalesce may reassociate
sums: AR(a) + AR(b) -> AR(a + b)); a wrong pairing moves values by their own size.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from .runner import RunResult

FAILURES = ("wrong", "killed", "hang", "partial_error", "error", "missing", "slow")
SKIPS = ("eager_failed", "plain_failed", "plain_wrong")
TOL = {"float32": 1e-4, "float64": 1e-9, "float16": 2e-2, "bfloat16": 8e-2}
GRACE_S, FIRST_GRACE_S, FIRST_FACTOR = 10.0, 15.0, 1.5
ABORTS = ("terminate called", "Is there a distributed collective mismatch",
          "Received data size doesn't match", "op.preamble.length", "Fatal Python error",
          "Segmentation fault")
TRANSPORT = ("Connection closed by peer", "Connection reset", "Connection was likely closed",
             "Broken pipe")
"""A peer's process ended under a rank's collective (or store request): what plain's ranks
get when a peer raises (gloo: "[.../pair.cc] Connection closed by peer [127.0.0.1]:port";
the store: "Failed to recv, got 0 bytes. Connection was likely closed")."""
TIMEOUTS = ("Timed out", "timed out", "Timeout", "timeout")


@dataclass
class Verdict:
    outcome: str
    detail: str = ""

    @property
    def failed(self) -> bool:
        return self.outcome in FAILURES


def close(got, want, compute: str = "float32") -> tuple[bool, float]:
    """Recorded outputs ([dtype, shape, values]): (close, the largest error over what the
    dtype allows). ``compute``: the program's dtype (a loss summed in float32 from a bf16
    output carries bf16's rounding). A recorded sum's fourth field is the sum of its
    terms' sizes: each term may be off by the tolerance, so the sum by that times this."""
    (dtype, shape, g, *gs), (wdtype, wshape, w, *ws) = got, want
    if (dtype, shape) != (wdtype, wshape) or len(g) != len(w):
        return False, math.inf
    tol = max(TOL.get(dtype, 1e-4), TOL.get(compute, 1e-4))
    scale = max([1.0, *ws] + [abs(x) for x in w if math.isfinite(x)])
    worst = 0.0
    for a, b in zip(g, w):
        if math.isnan(a) and math.isnan(b) or a == b:
            continue
        err = abs(a - b)
        worst = max(worst, err / (tol * scale + tol * abs(b)) if math.isfinite(err) else math.inf)
    return worst <= 1.0, worst


def first_wrong(run: RunResult, ref: RunResult, compute: str) -> str | None:
    for r, (mine, theirs) in enumerate(zip(run.ranks, ref.ranks)):
        for step in sorted(mine.steps):
            if step not in theirs.steps:
                continue
            got, want = mine.steps[step]["outs"], theirs.steps[step]["outs"]
            if set(got) != set(want):
                return f"rank {r} step {step}: outputs {sorted(got)} vs {sorted(want)}"
            for name in sorted(got):
                kinds = got[name][0], want[name][0]
                if kinds[0] != kinds[1] and any(k.startswith("raised ") for k in kinds):
                    return (f"rank {r} step {step} {name!r}: {kinds[0]} (a caught exception "
                            f"or a tensor's dtype), plain {kinds[1]}")
                ok, worst = close(got[name], want[name], compute)
                if not ok:
                    return (f"rank {r} step {step} {name!r}: off by {worst:.3g}x the "
                            f"{got[name][0]} tolerance; got {got[name][2][:4]}, want "
                            f"{want[name][2][:4]}")
    return None


def loud(error: dict | None) -> bool:
    """CollectiveMismatchError, or an error that names fxcoalesce and a fix."""
    if not error:
        return False
    message = error["message"]
    return any(t.endswith("CollectiveMismatchError") for t in error["types"]) or (
        "fxcoalesce" in message and any(fix in message for fix in
                                        ("Config(", "docs/", "torch._dynamo.config")))


def transport(error: dict | None) -> bool:
    """The transport's error as a peer's process ended (``TRANSPORT``), not a timeout: how
    a rank of plain's fails when a peer raises (within a fraction of a second)."""
    if not error:
        return False
    message = error["message"]
    return any(t in message for t in TRANSPORT) and not any(t in message for t in TIMEOUTS)


def judge_plain(plain: RunResult, eager: RunResult | None, compute: str) -> Verdict | None:
    """A skip verdict, or None when plain ran the program right."""
    if eager is not None and not eager.finished():
        return Verdict("eager_failed", _statuses(eager))
    if not plain.finished():
        return Verdict("plain_failed", _statuses(plain))
    if eager is not None:
        wrong = first_wrong(plain, eager, compute) or _missing(plain, eager)
        if wrong:
            return Verdict("plain_wrong", wrong)
    return None


def judge(run: RunResult, plain: RunResult, compute: str) -> Verdict:
    """``compute``: the program's dtype (``Program.dtype``), for the tolerance."""
    wrong = first_wrong(run, plain, compute)
    if wrong:
        return Verdict("wrong", wrong)
    for r in run.ranks:
        abort = next((a for a in ABORTS if a in r.stderr), None)
        if (r.returncode is not None and r.returncode < 0) or abort:
            return Verdict("killed", f"rank {r.rank}: return code {r.returncode}"
                                     f"{', ' + repr(abort) if abort else ''}; "
                                     + _statuses(run))
    if run.timed_out:
        return Verdict("hang", f"past the wall limit ({run.wall_s:.0f} s); " + _statuses(run))
    timeouts = [r.rank for r in run.ranks if r.error and not loud(r.error)
                and any(t in r.error["message"] for t in TIMEOUTS)]
    if timeouts:
        return Verdict("hang", f"group timeout on ranks {timeouts}; " + _statuses(run))
    active = [r for r in run.ranks if r.status != "stopped"]
    errors = [r for r in active if r.status == "error"]
    if errors:
        louds = [r for r in errors if loud(r.error)]
        # a rank the stopped rank's end reached through the transport: as under plain
        ended = [r for r in errors if not loud(r.error) and transport(r.error)]
        if len(errors) < len(active) or louds and len(louds) + len(ended) < len(errors):
            return Verdict("partial_error", _statuses(run))
        if not louds:
            return Verdict("error", _statuses(run))
        slow = _slow(run, plain)  # an ended rank's error too: within the step's allowance
        if slow:
            return Verdict("slow", slow)
        note = f"loud on ranks {[r.rank for r in louds]}" + (
            f", the transport's error on ranks {[r.rank for r in ended]}" if ended else "")
        return Verdict("loud", f"{note}; {_statuses(run)}")
    missing = _missing(run, plain)
    if missing:
        return Verdict("missing", missing)
    slow = _slow(run, plain)
    return Verdict("slow", slow) if slow else Verdict("ok")


def _missing(run: RunResult, ref: RunResult) -> str | None:
    for mine, theirs in zip(run.ranks, ref.ranks):
        if mine.status != theirs.status or set(mine.steps) != set(theirs.steps):
            return (f"rank {mine.rank}: {mine.status} after {len(mine.steps)} steps, "
                    f"against {theirs.status} after {len(theirs.steps)}")
    return None


def _slow(run: RunResult, plain: RunResult) -> str | None:
    steady = max([s["t"] for r in plain.ranks for s in r.steps.values() if not s["first"]],
                 default=0.0)
    for r in run.ranks:
        timed = [(n, s["t"], s["first"]) for n, s in r.steps.items()]
        if r.error:  # the step that raised: compared as a first call (it may compile)
            timed.append((r.error["step"], r.error["t"], True))
        for step, t, first in timed:
            there = max([p.steps[step]["t"] for p in plain.ranks if step in p.steps],
                        default=steady)
            allowed = FIRST_FACTOR * there + FIRST_GRACE_S if first else \
                max(steady, there) + GRACE_S
            if t > allowed:
                return (f"rank {r.rank} step {step}: {t:.1f} s, plain allows {allowed:.1f} s "
                        f"({'first call' if first else 'steady'}; plain's slowest rank at "
                        f"that step {there:.1f} s)")
    return None


def _statuses(run: RunResult) -> str:
    parts = []
    for r in run.ranks:
        what = r.status
        if r.error:
            what += (f" at step {r.error['step']}: {r.error['types'][0].rsplit('.', 1)[-1]}: "
                     f"{r.error['message'][:160]}")
        parts.append(f"rank {r.rank} rc {r.returncode} {what}")
    return "; ".join(parts)
