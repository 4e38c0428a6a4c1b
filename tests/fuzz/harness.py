"""What a fuzz program imports on each rank (torch and the stdlib only): start the group,
compile under the variant the runner asked for, time and record each step, make a group
anew. The runner passes everything through the environment:

    RANK WORLD_SIZE MASTER_ADDR MASTER_PORT   the first process group (env://)
    FUZZ_PORTS      free ports for process groups made anew, comma-separated
    FUZZ_VARIANT    eager | plain | fxcoalesce | check
    FUZZ_INDUCTOR   1: plain is backend="inductor", fxcoalesce its default codegen
    FUZZ_RESULTS    this rank's results file (JSON lines, flushed per line)
    FUZZ_GROUP_TIMEOUT  seconds, every process group's timeout

Results lines: {"event": "start"}, one {"event": "step", "step", "t", "first", "outs"} per
finished step ("first": the step made the first call of some compiled function; "outs":
name -> [dtype, shape, values as floats]; an exception the program caught and expected:
name -> ["raised <type>", [], []]), then one of {"event": "done"}, {"event":
"stopped"} (a rank beyond a smaller group) or {"event": "error", "step", "t", "types",
"message"} ("step": None for the closing barrier). A rank leaves through ``_exit``.
"""

from __future__ import annotations

import contextlib
import datetime
import functools
import json
import os
import sys
import time
import traceback

import torch
import torch.distributed as dist

VARIANTS = ("eager", "plain", "fxcoalesce", "check")
VARIANT = os.environ.get("FUZZ_VARIANT", "eager")
INDUCTOR = os.environ.get("FUZZ_INDUCTOR") == "1"
GROUP_TIMEOUT = float(os.environ.get("FUZZ_GROUP_TIMEOUT", "40"))
_PORTS = [p for p in os.environ.get("FUZZ_PORTS", "").split(",") if p]
_file = None
_step = None  # the step being recorded


def _write(event: dict) -> None:
    global _file
    if _file is None:
        _file = open(os.environ.get("FUZZ_RESULTS", os.devnull), "a")  # noqa: SIM115
    _file.write(json.dumps(event) + "\n")
    _file.flush()


def _connect(rank: int, world: int) -> None:
    dist.init_process_group("gloo", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=GROUP_TIMEOUT))


def init() -> tuple[int, int]:
    """Start the default gloo group from the environment: (rank, world size)."""
    torch.set_num_threads(1)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    _write({"event": "start", "rank": rank, "world": world, "variant": VARIANT,
            "inductor": INDUCTOR, "torch": torch.__version__, "pid": os.getpid()})
    _connect(rank, world)
    return rank, world


def regroup(world: int) -> None:
    """Destroy the default group and make one anew on the next port, ``world`` ranks; a rank
    beyond it records that it stopped and exits."""
    rank = dist.get_rank()
    dist.destroy_process_group()
    if rank >= world:
        _write({"event": "stopped"})
        _exit(0)
    os.environ.update(MASTER_PORT=_PORTS.pop(0), WORLD_SIZE=str(world))
    _connect(rank, world)


def subgroup(partition: list[list[int]]):
    """Every rank makes every group of ``partition`` in order; returns this rank's."""
    mine = None
    for ranks in partition:
        group = dist.new_group(ranks)
        if dist.get_rank() in ranks:
            mine = group
    return mine


def halves(world: int) -> list[list[int]]:
    """Two halves of the world from 4 ranks on; below that one group of every rank."""
    half = world // 2
    return [list(range(half)), list(range(half, world))] if world >= 4 else [list(range(world))]


def strided(world: int) -> list[list[int]]:
    """Even and odd ranks from 4 ranks on (a TP x DP grid with the halves); below that one
    group of every rank."""
    return [list(range(0, world, 2)), list(range(1, world, 2))] if world >= 4 else \
        [list(range(world))]


def weights(seed: int, rank: int, layers: int, per: int, dim: int, dtype) -> list:
    """This rank's shard: ``layers`` lists of ``per`` [dim, dim] matrices."""
    gen = torch.Generator().manual_seed(seed * 1009 + rank)
    return [[(torch.randn(dim, dim, generator=gen) / dim ** 0.5).to(dtype)
             for _ in range(per)] for _ in range(layers)]


def randn(seed: int, step: int, rank: int, shape, dtype) -> torch.Tensor:
    gen = torch.Generator().manual_seed((seed * 7919 + step) * 131 + rank)
    return torch.randn(*shape, generator=gen).to(dtype)


def compile(fn, split: bool = False, **kw):
    """``fn`` compiled as the variant says (eager: not compiled; ``split``: fxcoalesce's
    token split forced on); the step that makes its first call is marked, so the oracle can
    leave compile time out of the comparison."""
    if VARIANT == "eager":
        compiled = fn
    elif VARIANT == "plain":
        compiled = torch.compile(fn, backend="inductor" if INDUCTOR else "aot_eager", **kw)
    else:
        import fxcoalesce

        if VARIANT == "fxcoalesce" and INDUCTOR and not split:
            backend = "fxcoalesce"
        else:
            extra = {} if INDUCTOR else {"codegen": "eager"}
            hear = {}
            if split:  # what the split did, on stderr: the run's notes show it
                from fxcoalesce.report import split_line

                extra["token_split"] = True
                hear["on_graph"] = lambda before, after, report: print(
                    f"fxcoalesce split: {split_line(report.decisions)}", file=sys.stderr,
                    flush=True)
            backend = fxcoalesce.backend(fxcoalesce.Config(check_ranks=VARIANT == "check",
                                                           **extra), **hear)
        compiled = torch.compile(fn, backend=backend, **kw)
    calls = [0]

    @functools.wraps(fn)
    def call(*args, **kwargs):
        if calls[0] == 0 and _step is not None:
            _step["first"] = True
        calls[0] += 1
        return compiled(*args, **kwargs)

    return call


class _Record:
    def __init__(self, entry: dict):
        self.entry = entry

    def out(self, name: str, value, scale=None) -> None:
        """Record a tensor (an async collective's result is waited for first). ``scale``:
        for a sum, the sum of its terms' sizes (the oracle's tolerance follows it: each
        term may carry the rounding of a reassociated sum)."""
        if hasattr(value, "wait") and callable(value.wait):
            value = value.wait()
        value = value.detach()
        self.entry["outs"][name] = [str(value.dtype).removeprefix("torch."),
                                    list(value.shape),
                                    value.to(torch.float64).flatten().tolist()]
        if scale is not None:
            self.entry["outs"][name].append(float(scale))

    def raised(self, name: str, e: BaseException) -> None:
        """Record an exception the program caught and expected (a user's ValueError for a
        bad request): an output like a tensor's, so the oracle compares it with plain's (a
        variant that raises where plain did not, or not where plain did, differs)."""
        self.entry["outs"][name] = [f"raised {type(e).__name__}", [], []]


def threads(fn, calls: list[tuple]) -> list:
    """``fn(*args)`` for each ``args`` of ``calls``, each on its own thread, joined; their
    results in order, or the exception raised first (in time: the cause, where a stream's
    error ends its peers' collectives and so the other stream's) raised again here."""
    import threading

    # torch 2.11 (CUDA builds): the device guard FakeTensorMode sets up on its first entry is
    # freed with the thread that entered first, and the next compile on another thread
    # segfaults (plain included; pytorch#178950, fixed after 2.11). Set up here, on the main
    # thread, it lives as long as the process.
    ensure = getattr(torch._C, "_ensureCUDADeviceGuardSet", None)
    if ensure is not None:
        ensure()
    results, errors = [None] * len(calls), []

    def one(i):
        try:
            results[i] = fn(*calls[i])
        except BaseException as e:  # noqa: BLE001 (raised again in the caller's thread)
            errors.append(e)  # in the order raised

    workers = [threading.Thread(target=one, args=(i,), name=f"fuzz-stream-{i}")
               for i in range(len(calls))]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    if errors:
        raise errors[0]
    return results


def _types(e: BaseException) -> list[str]:
    """The exception's type and those it was raised from (Dynamo wraps backend errors)."""
    out, seen = [], set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        out.append(f"{type(e).__module__}.{type(e).__qualname__}")
        e = e.__cause__ or e.__context__
    return out


def _clip(text: str, head: int = 3000, tail: int = 1000) -> str:
    return text if len(text) <= head + tail else f"{text[:head]} [...] {text[-tail:]}"


@contextlib.contextmanager
def step(i: int):
    """Time one step and record its outputs; an exception is recorded and printed, and the
    rank exits with status 1, as it would uncaught."""
    global _step
    _step = {"event": "step", "step": i, "first": False, "outs": {}}
    t0 = time.perf_counter()
    try:
        yield _Record(_step)
    except Exception as e:
        _write({"event": "error", "step": i, "t": time.perf_counter() - t0,
                "types": _types(e), "message": _clip(str(e))})
        traceback.print_exc()  # what an uncaught exception prints, then its exit status
        _exit(1)
    finally:
        entry, _step = _step, None
    entry["t"] = time.perf_counter() - t0
    _write(entry)


def finish() -> None:
    """The program's end: a barrier, so that no rank leaves (rank 0 takes the group's store
    with it) while a peer still works, then done."""
    t0 = time.perf_counter()
    try:
        dist.barrier()
    except Exception as e:
        _write({"event": "error", "step": None, "t": time.perf_counter() - t0,
                "types": _types(e), "message": _clip(str(e))})
        traceback.print_exc()
        _exit(1)
    _write({"event": "done"})
    _exit(0)


def _exit(code: int) -> None:
    """Exit as Python would (atexit handlers run: fxcoalesce leaves its notes there), but
    without the interpreter's teardown: there a gloo rank of torch 2.13 that ran eager
    functional collectives aborts now and then, done or not, destroyed group or not
    ("terminate called without an active exception", 1 exit in 8 in a 4-step loop of
    funcol.all_reduce; never with this exit)."""
    import atexit

    sys.stdout.flush()
    sys.stderr.flush()
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
