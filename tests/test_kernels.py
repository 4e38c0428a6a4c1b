"""fxcoalesce.kernels on CPU: the fused op's schema, fake tracing and Inductor placement; its
arithmetic against the unfused ops on 1 process and on 2 gloo ranks, with the bf16 bound;
symm_mem_ready's answers without symmetric memory and its agreement across ranks;
ensure_symm_mem_fakes; the CUDA path's Python (the P2P checks, the workspace) over a host
stand-in for symmetric memory; and, where Triton is installed, the Triton kernel itself
through Triton's CPU interpreter: on 2 ranks (two processes over shared memory standing in
for P2P), and behind the op's CUDA implementation on 1 rank. nccl_symm's op, its readiness
check (on 2 gloo ranks too: a rank that cannot go on stops both), its window and prepare,
over the same stand-in."""

from __future__ import annotations

import contextlib
import importlib.util
import math
import os
import subprocess
import sys
import types

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode

import fxcoalesce.kernels  # noqa: F401  (registers the op)
from fxcoalesce.apps.launch import init_fake_group, spawn
from fxcoalesce.kernels import ensure_symm_mem_fakes, fakes, ops, symm, symm_mem_ready

pytestmark = pytest.mark.usefixtures("one_thread")

OP = torch.ops.fxcoalesce.all_reduce_add_rms_norm.default
U_BF16 = 2.0 ** -8  # bf16 unit roundoff: half an ulp, relative
EPS = 1e-5


def _inputs(rank: int, dtype, tokens=16, hidden=96, seed=0):
    """Rank ``rank``'s partial sum; the residual and weight are the same on every rank."""
    x = torch.randn(tokens, hidden, generator=torch.Generator().manual_seed(seed + rank))
    g = torch.Generator().manual_seed(seed + 1000)
    residual = torch.randn(tokens, hidden, generator=g)
    weight = 1.0 + 0.1 * torch.randn(hidden, generator=g)
    return x.to(dtype), residual.to(dtype), weight.to(dtype)


def _unfused(x, residual, weight, group=None):
    """What the graph computes before fuse_norm: all_reduce in the dtype, add, rms_norm."""
    reduced = x.clone()
    if group is not None:
        dist.all_reduce(reduced, group=group)
    h = reduced if residual is None else reduced + residual
    return F.rms_norm(h, (x.shape[-1],), weight, EPS), h


def _ro_bound(partials, residual):
    """|fused residual_out - unfused| for bf16 at 2 ranks (``u = 2^-8``): the unfused graph
    rounds the all_reduce (|a - S| <= u |S|, one rounding of the sum of two partials) and then
    the add (<= u |a + r|); the fused op rounds S + r once (<= u |S + r|). So the two differ by
    at most u (|S| (1 + u) + 2 |S + r|). (At W ranks NCCL/gloo round inside the reduction too:
    the first term grows to about (W - 1) u sum |x_r|.)"""
    s = sum(p.double() for p in partials)
    h = s if residual is None else s + residual.double()
    return U_BF16 * (s.abs() * (1 + U_BF16) + 2 * h.abs())


def test_schema_is_exactly_the_one_the_passes_use():
    assert str(OP._schema) == (
        "fxcoalesce::all_reduce_add_rms_norm(Tensor input, Tensor? residual, Tensor weight, "
        "float eps, str group_name) -> (Tensor normed, Tensor residual_out)")


def test_imports_without_triton():
    """A machine without Triton (this one, CI) imports the package and registers the op."""
    code = ("import sys; sys.modules['triton'] = None\n"
            "import torch, fxcoalesce.kernels as k\n"
            "assert not k.HAS_TRITON and 'fxcoalesce.kernels.triton_ar_norm' not in sys.modules\n"
            "assert torch.ops.fxcoalesce.all_reduce_add_rms_norm.default\n"
            "print(k.kernel_supports((3, 64), torch.bfloat16, 2))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert "Triton is not importable" in out.stdout


@pytest.mark.parametrize("residual", [True, False])
def test_fake_tensor_mode_gives_contiguous_outputs_of_input_shape_and_dtype(residual):
    with FakeTensorMode():
        x = torch.empty(64, 3, dtype=torch.bfloat16).t()  # non-contiguous [3, 64]
        r = torch.empty(3, 64, dtype=torch.bfloat16) if residual else None
        normed, residual_out = OP(x, r, torch.empty(64, dtype=torch.float32), EPS, "0")
    for t in (normed, residual_out):
        assert (t.shape, t.dtype, t.stride()) == ((3, 64), torch.bfloat16, (64, 1))
    real = OP(torch.randn(64, 3).t(), None, torch.ones(64), EPS, "0")  # strides agree
    assert [t.stride() for t in real] == [(64, 1), (64, 1)]


def test_shape_errors_are_clear():
    with FakeTensorMode(), pytest.raises(ValueError, match=r"weight must have shape"):
        OP(torch.empty(3, 64), None, torch.empty(32), EPS, "0")
    with pytest.raises(ValueError, match=r"residual must match input"):
        OP(torch.randn(3, 64), torch.randn(3, 64).double(), torch.ones(64), EPS, "0")


def test_dynamo_and_aot_trace_it_under_the_fake_group():
    """Dynamo (fullgraph) keeps the op as one node; AOTAutograd fake-propagates through it;
    run on the fake group (whose all_reduce does nothing) it computes the 1-rank result."""
    group = init_fake_group(4)
    name = group.group_name
    graphs = []

    def record(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    def f(x, r, w):
        return OP(x, r, w, EPS, name)

    x, r, w = _inputs(0, torch.float32)
    want = ops.reference(x, r, w, EPS, "no-such-group")
    for backend in (record, "aot_eager"):
        torch._dynamo.reset()
        got = torch.compile(f, backend=backend, fullgraph=True)(x, r, w)
        assert all(torch.equal(a, b) for a, b in zip(got, want))
    targets = [n.target for n in graphs[0].graph.nodes if n.op == "call_function"]
    assert targets.count(OP) + targets.count(OP.overloadpacket) == 1
    dist.destroy_process_group()


def test_inductor_places_it_as_an_extern_kernel():
    from torch._inductor.utils import run_and_get_code
    from torch.testing import FileCheck

    name = init_fake_group(2).group_name
    x, r, w = _inputs(0, torch.float32, tokens=3, hidden=64)
    torch._dynamo.reset()
    fn = torch.compile(lambda x, r, w: OP(x, r, w, EPS, name), fullgraph=True)
    _, (code,) = run_and_get_code(fn, x, r, w)
    # one call of the op itself in the wrapper, with the group's name as a constant
    FileCheck().check_count("torch.ops.fxcoalesce.all_reduce_add_rms_norm.default(", 1,
                            exactly=True).check(f"'{name}'").run(code)
    dist.destroy_process_group()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("residual", [True, False])
def test_one_process_equals_the_unfused_ops(dtype, residual):
    """Without peers there is no all_reduce to round: the fused op is bit-for-bit the
    unfused add (torch adds bf16 in fp32 and rounds once, as the op does) and rms_norm."""
    x, r, w = _inputs(0, dtype)
    r = r if residual else None
    normed, residual_out = ops.reference(x, r, w, EPS, "no-such-group")
    want_normed, want_h = _unfused(x, r, w)
    assert torch.equal(residual_out, want_h)
    assert torch.equal(normed, ops.rms_norm_f32(residual_out, w, EPS))
    # F.rms_norm (ATen's fused CPU kernel here) may sum the mean in another order: 1 ulp
    tol = dict(rtol=2 * U_BF16, atol=1e-6) if dtype == torch.bfloat16 else dict(
        rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(normed, want_normed, **tol)


def _two_rank_worker(rank, world_size):
    """Everything the two-rank tests need from one spawn (each spawn costs seconds)."""
    group = dist.group.WORLD
    name = group.group_name
    out = {"arith": {}}
    for dtype in (torch.bfloat16, torch.float32):
        for residual in (True, False):
            x, r, w = _inputs(rank, dtype)
            r = r if residual else None
            out["arith"][(str(dtype), residual)] = {
                "fused": OP(x, r, w, EPS, name),
                "unfused": _unfused(x, r, w, group),
                "partials": [_inputs(p, dtype)[0] for p in range(world_size)],
                "residual": r, "weight": w}
    out["counts"] = dict(ops.dispatch_counts)

    def no_collective(*args, **kwargs):
        raise AssertionError("symm_mem_ready ran a collective on gloo")

    real_vote, symm._vote = symm._vote, no_collective
    out["ready"] = symm_mem_ready(name)
    symm._vote = real_vote

    ran = []

    def step(i):
        def fn():
            ran.append(i)
            if i == 2 and rank == 1:
                raise RuntimeError("peer buffer unreadable")
        return fn

    out["agreed"] = symm.run_agreed_steps(group, [(f"step{i}", step(i)) for i in (1, 2, 3)])
    out["ran"] = ran
    out["all_pass"] = symm.run_agreed_steps(group, [("a", lambda: None), ("b", lambda: None)])
    out.update(_nccl_symm_two_ranks(rank, name))
    return out


def _nccl_symm_two_ranks(rank, name):
    """nccl_symm.ready where one rank cannot go on: rank 1's backend is CUDA's, then rank
    1's allocation fails. Each time both ranks answer alike and nobody reaches a step (an
    allocation, the rendezvous) its peer skipped. gloo stands for NCCL (``_precheck``)."""
    from fxcoalesce.kernels import nccl_symm

    reached = []

    def allocate(nbytes, device):
        reached.append("allocate")
        if rank == 1 and backend == "NCCL":
            raise RuntimeError("out of memory")
        return torch.zeros(nbytes, dtype=torch.uint8)

    def register(t, group_name):
        reached.append("rendezvous")
        raise AssertionError("a rank reached the rendezvous")

    symm._precheck = lambda group_name: None
    nccl_symm._allocate, nccl_symm._register = allocate, register
    out = {}
    for backend in ("CUDA", "NCCL"):
        nccl_symm._READY.clear()
        reached.clear()
        nccl_symm.process_backend = lambda b=backend: "NCCL" if rank == 0 else b
        out[f"nccl_ready_{backend}"] = (nccl_symm.ready(name), list(reached))
    return out


@pytest.fixture(scope="module")
def two_ranks():
    return spawn(_two_rank_worker, 2, backend="gloo", timeout=300)


@pytest.mark.parametrize("residual", [True, False])
def test_two_ranks_fp32_equals_the_unfused_ops(two_ranks, residual):
    """fp32: the op reduces an fp32 copy exactly as the unfused graph reduces its fp32
    tensor (the same gloo sum), so both outputs are bit-for-bit equal on every rank."""
    for out in two_ranks:
        case = out["arith"][(str(torch.float32), residual)]
        (normed, ro), (want_normed, want_h) = case["fused"], case["unfused"]
        assert torch.equal(ro, want_h)
        torch.testing.assert_close(normed, want_normed, rtol=1e-6, atol=1e-6)
    a, b = (out["arith"][(str(torch.float32), residual)]["fused"] for out in two_ranks)
    assert all(torch.equal(p, q) for p, q in zip(a, b))  # ranks agree


@pytest.mark.parametrize("residual", [True, False])
def test_two_ranks_bf16_within_the_double_rounding_bound(two_ranks, residual):
    """bf16: the fused residual_out is the fp32 sum rounded once (within half an ulp of the
    exact sum), the unfused one was rounded twice; they differ within ``_ro_bound``, and
    ``normed`` follows: it is rms_norm of the op's own residual_out to 1 ulp, and the
    unfused normed within the bound carried through the norm plus both final roundings."""
    for out in two_ranks:
        case = out["arith"][(str(torch.bfloat16), residual)]
        (normed, ro), (want_normed, want_h) = case["fused"], case["unfused"]
        s = sum(p.double() for p in case["partials"])
        exact = s if case["residual"] is None else s + case["residual"].double()
        assert ((ro.double() - exact).abs() <= U_BF16 * exact.abs() * (1 + 1e-6)).all()
        bound = _ro_bound(case["partials"], case["residual"])
        diff = (ro.double() - want_h.double()).abs()
        assert (diff <= bound).all(), float((diff - bound).max())
        if residual:  # the double rounding is real: here it moved some values
            assert (diff > 0).any()
            assert ((want_h.double() - exact).abs() > U_BF16 * exact.abs()).any()
        torch.testing.assert_close(normed, ops.rms_norm_f32(ro, case["weight"], EPS),
                                   rtol=2 * U_BF16, atol=0)
        xf = ro.double()
        ms = xf.pow(2).mean(-1, keepdim=True)
        inv = (ms + EPS).rsqrt()
        rel_inv = (xf.abs() * bound).mean(-1, keepdim=True) / ms * 1.01  # |d inv| / inv
        w = case["weight"].double().abs()
        n_bound = w * inv * (bound + xf.abs() * rel_inv) + U_BF16 * (
            normed.double().abs() + want_normed.double().abs())
        assert ((normed.double() - want_normed.double()).abs() <= n_bound).all()


def test_two_ranks_ran_the_reference_path(two_ranks):
    for out in two_ranks:
        assert out["counts"] == {"reference": 4}  # 2 dtypes x with/without residual


def test_symm_mem_ready_answers_false_on_gloo_without_a_collective(two_ranks):
    for out in two_ranks:
        ok, why = out["ready"]
        assert not ok and "gloo" in why


def test_a_failing_rank_makes_every_rank_answer_false_with_its_reason(two_ranks):
    for out in two_ranks:
        assert out["agreed"] == (False, "step2: rank 1 of the group: RuntimeError: peer "
                                        "buffer unreadable")
        assert out["ran"] == [1, 2]  # nobody went on to step 3
        assert out["all_pass"] == (True, "ok")


def test_nccl_symm_ready_stops_every_rank_where_one_cannot_go_on(two_ranks):
    for out in two_ranks:
        (ok, why), reached = out["nccl_ready_CUDA"]
        assert not ok and why.startswith("symmetric-memory backend: rank 1 of the group: "
                                         "RuntimeError: this process's symmetric-memory "
                                         "backend is CUDA, not NCCL's")
        assert reached == []  # no rank allocated
        assert out["nccl_ready_NCCL"] == ((False, "allocate: rank 1 of the group: "
                                           "RuntimeError: out of memory"), ["allocate"])


def test_symm_mem_ready_on_the_fake_group_and_without_a_group():
    name = init_fake_group(2).group_name
    symm._READY.pop(name, None)
    ok, why = symm_mem_ready(name)
    assert not ok and "fake process group" in why
    assert symm_mem_ready(name) == (ok, why)  # cached
    dist.destroy_process_group()
    assert symm_mem_ready("no-such-group") == (
        False, "no process group named 'no-such-group' in this process")
    assert symm.MULTICAST_ENV in os.environ  # set at import ("1" unless the user chose)


def _fake_run_args(name: str, a: torch.Tensor):
    if name.endswith("_copy") or name.endswith("_copy_out"):
        head = (a, a, "sum", "0")
    else:
        head = (a, "sum", "0")
    return head + ((torch.empty_like(a),) if name.endswith("_out") else ())


def test_ensure_symm_mem_fakes_is_idempotent_and_keeps_torchs_own():
    ensure_symm_mem_fakes()
    assert ensure_symm_mem_fakes() == ()
    from torch._library.simple_registry import singleton

    for name in fakes.FAKES:
        if not hasattr(torch.ops.symm_mem, name):
            continue
        assert fakes.has_fake(f"symm_mem::{name}")
        with FakeTensorMode():
            a = torch.empty(8, dtype=torch.bfloat16)
            result = getattr(torch.ops.symm_mem, name).default(*_fake_run_args(name, a))
        assert result.shape == (8,)
        if name == "two_shot_all_reduce_":
            assert result is a
    # torch's own Meta kernel for one_shot_all_reduce is still the one in use
    assert torch._C._dispatch_has_kernel_for_dispatch_key("symm_mem::one_shot_all_reduce",
                                                          "Meta")
    assert singleton.find("symm_mem::one_shot_all_reduce").fake_impl.kernel is None


def test_dynamo_traces_two_shot_once_faked():
    ensure_symm_mem_fakes()
    name = init_fake_group(2).group_name
    graphs = []

    def record(gm, example_inputs):  # trace only: the CPU wheel has no kernel to run
        graphs.append(gm)
        outputs = next(n for n in gm.graph.nodes if n.op == "output").args[0]
        return lambda *args: [torch.zeros(8)] * len(outputs)

    def f(x):
        return torch.ops.symm_mem.two_shot_all_reduce_(x * 2, "sum", name)

    torch._dynamo.reset()
    torch.compile(f, backend=record, fullgraph=True)(torch.randn(8))
    assert any("two_shot_all_reduce_" in str(n.target) for n in graphs[0].graph.nodes)
    dist.destroy_process_group()


HAS_TRITON = importlib.util.find_spec("triton") is not None


def _interpreted(monkeypatch, target, args_of_rank, ranks=1, results=1, timeout=300.0):
    """Run ``target(*args_of_rank(rank), queue)`` in ``ranks`` fresh processes with
    TRITON_INTERPRET=1 (read when the kernel is decorated, so only a new process gets it);
    return ``results`` items from the queue, failing at once if a process dies first."""
    import time

    import torch.multiprocessing as mp
    from queue import Empty

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=target, args=(*args_of_rank(r), queue)) for r in range(ranks)]
    for p in procs:
        p.start()
    got, end = [], time.monotonic() + timeout
    try:
        while len(got) < results:
            try:
                got.append(queue.get(timeout=1.0))
            except Empty:
                dead = [p.exitcode for p in procs if p.exitcode not in (None, 0)]
                assert not dead and time.monotonic() < end, f"exit codes {dead} or timeout"
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    return got


def _interpreted_rank(rank, world, workspaces, pads, cases, queue):
    """One rank of the Triton kernel under TRITON_INTERPRET=1: shared-memory tensors stand
    in for symmetric memory, and each process builds its own pointer tables to them, as
    rendezvous does with the peers' mappings."""
    from fxcoalesce.kernels import triton_ar_norm

    bufs = torch.tensor([t.data_ptr() for t in workspaces], dtype=torch.int64)
    sigs = torch.tensor([t.data_ptr() for t in pads], dtype=torch.int64)
    handle = types.SimpleNamespace(buffer_ptrs_dev=bufs.data_ptr(),
                                   signal_pad_ptrs_dev=sigs.data_ptr(),
                                   rank=rank, world_size=world)
    for i, (partials, residual, weight) in enumerate(cases):
        x = partials[rank]
        normed, residual_out = torch.empty_like(x), torch.empty_like(x)
        triton_ar_norm.launch(x, residual, weight, EPS, normed, residual_out, handle,
                              max_blocks=2)
        queue.put((rank, i, normed.tolist(), residual_out.tolist()))


@pytest.mark.skipif(not HAS_TRITON, reason="Triton is not installed")
def test_triton_kernel_interpreted_on_two_ranks(monkeypatch):
    """The kernel's indexing, peer reads, rank-order fp32 sum, residual, norm and barriers,
    on 2 ranks: 5 rows over 2 blocks (a block loops), a masked row (H = 40 of 64), three
    calls in a row on the same signal pads, which must end all zero. fp32 must equal the
    reference exactly (residual_out) and to 1e-6 (normed). bf16 is checked to one ulp only:
    the interpreter converts fp32 to bf16 by truncation, the GPU by round-to-nearest-even:
    residual_out within 1 ulp (2u relative), normed within the 1 ulp it inherits, its own
    truncation and a little for the norm (6u)."""
    world, rows, hidden = 2, 5, 40
    cases = []
    for dtype, residual in ((torch.float32, True), (torch.float32, False),
                            (torch.bfloat16, True)):
        partials = [_inputs(p, dtype, rows, hidden)[0] for p in range(world)]
        _, r, w = _inputs(0, dtype, rows, hidden)
        cases.append((partials, r if residual else None, w))
    workspaces = [torch.zeros(rows * hidden * 4, dtype=torch.uint8).share_memory_()
                  for _ in range(world)]
    pads = [torch.zeros(2 * world, dtype=torch.int32).share_memory_() for _ in range(world)]
    got = _interpreted(monkeypatch, _interpreted_rank,
                       lambda r: (r, world, workspaces, pads, cases), ranks=world,
                       results=world * len(cases))
    for rank, i, normed, residual_out in got:
        partials, r, w = cases[i]
        acc = sum(p.float() for p in partials) + (0 if r is None else r.float())
        want_ro = acc.to(partials[0].dtype)
        want_normed = ops.rms_norm_f32(want_ro, w, EPS)
        normed = torch.tensor(normed, dtype=torch.float64)
        residual_out = torch.tensor(residual_out, dtype=torch.float64)
        if partials[0].dtype == torch.float32:
            assert torch.equal(residual_out, want_ro.double()), (rank, i)
            torch.testing.assert_close(normed, want_normed.double(), rtol=1e-6, atol=1e-6)
        else:
            torch.testing.assert_close(residual_out, want_ro.double(), rtol=2 * U_BF16, atol=0)
            torch.testing.assert_close(normed, want_normed.double(), rtol=6 * U_BF16,
                                       atol=1e-6)
    assert all(int(p.abs().sum()) == 0 for p in pads)


class _HostHandle:
    """A rendezvous handle over host memory, world size 1: its pointer tables hold the
    buffer's and the signal pad's addresses, as torch's device tables hold the peers'."""

    def __init__(self, tensor, owner):
        self.tensor, self.owner, self.rank, self.world_size = tensor, owner, 0, 1
        self.signal_pad_size = 1024
        self.pad = torch.zeros(self.signal_pad_size // 4, dtype=torch.int32)
        self.tables = [torch.tensor([t.data_ptr()], dtype=torch.int64)
                       for t in (tensor, self.pad)]
        self.buffer_ptrs = [tensor.data_ptr()]
        self.buffer_ptrs_dev, self.signal_pad_ptrs_dev = (t.data_ptr() for t in self.tables)
        self.barriers = 0

    def barrier(self, channel=0, timeout_ms=0):
        self.barriers += 1

    def get_buffer(self, rank, sizes, dtype, storage_offset=0):
        view = self.tensor.view(dtype)[storage_offset:storage_offset + math.prod(sizes)]
        return torch.zeros_like(view) if self.owner.corrupt_reads else view.view(sizes)

    def get_signal_pad(self, rank, sizes=(), dtype=None, storage_offset=0):
        return self.pad


class _HostSymm:
    """Stands in for ``torch.distributed._symmetric_memory`` (and the CUDA calls around it)
    on one CPU process, so the CUDA path's Python runs here."""

    def __init__(self):
        self.allocs, self.enabled, self.handles = [], set(), []
        self.corrupt_reads = self.fail_alloc = False

    def empty(self, *size, dtype, device):
        if self.fail_alloc:
            raise RuntimeError("out of symmetric memory")
        self.allocs.append(torch.zeros(*size, dtype=dtype))
        return self.allocs[-1]

    def rendezvous(self, tensor, group_name):
        self.handles.append(_HostHandle(tensor, self))
        return self.handles[-1]

    def enable_symm_mem_for_group(self, name):
        self.enabled.add(name)

    def is_symm_mem_enabled_for_group(self, name):
        return name in self.enabled

    def get_signal_pad_size(self):
        return 1024


class _NoStream:
    def __init__(self, device=None):
        pass

    def synchronize(self):
        pass


def _install_host_symm(set_attr, one_shot=lambda buf, op, name: buf.clone()):
    """Patch through ``set_attr`` (monkeypatch.setattr, or setattr in a child process)."""
    import torch.distributed._symmetric_memory  # noqa: F401  (the attribute to replace)

    host = _HostSymm()
    set_attr(torch.distributed, "_symmetric_memory", host)
    for name, value in (("current_device", lambda: 0), ("synchronize", lambda *a: None),
                        ("Stream", _NoStream), ("device", lambda d: contextlib.nullcontext()),
                        ("stream", lambda s: contextlib.nullcontext())):
        set_attr(torch.cuda, name, value)
    set_attr(torch.ops.symm_mem, "one_shot_all_reduce", one_shot)
    set_attr(symm, "_precheck", lambda group_name: None)  # gloo: let the real test run
    for name in ("_READY", "_WORKSPACES"):
        set_attr(symm, name, {})
    for name in ("_RETIRED", "_PROBES"):
        set_attr(symm, name, [])
    if dist.is_initialized():
        dist.destroy_process_group()
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    return host


@pytest.fixture
def host_symm(monkeypatch):
    host = _install_host_symm(monkeypatch.setattr)
    yield host
    dist.destroy_process_group()


def test_symm_mem_ready_runs_the_p2p_checks(host_symm):
    name = dist.group.WORLD.group_name
    assert symm_mem_ready(name) == (True, "ok")
    (probe,) = host_symm.handles
    assert probe.barriers == 2 and name in host_symm.enabled
    assert symm_mem_ready(name) == (True, "ok") and len(host_symm.handles) == 1  # cached


@pytest.mark.parametrize("fault, reason", [
    ("alloc", "allocate: rank 0 of the group: RuntimeError: out of symmetric memory"),
    ("read", "P2P read of every peer: rank 0 of the group: RuntimeError: read 1024 of 1024 "
             "wrong values from peer 0's buffer"),
    ("one_shot", "one_shot_all_reduce: rank 0 of the group: RuntimeError: one_shot_all_reduce "
                 "off by up to 1000.0 from the exact sum")])
def test_symm_mem_ready_says_which_check_failed(host_symm, monkeypatch, fault, reason):
    host_symm.fail_alloc = fault == "alloc"
    host_symm.corrupt_reads = fault == "read"
    if fault == "one_shot":
        monkeypatch.setattr(torch.ops.symm_mem, "one_shot_all_reduce",
                            lambda buf, op, name: buf + 1000)
    assert symm_mem_ready(dist.group.WORLD.group_name) == (False, reason)


def test_workspace_grows_collectively_and_never_during_capture(host_symm, monkeypatch):
    name, dev = dist.group.WORLD.group_name, torch.device("cuda", 0)
    ws = symm.get_workspace(name, dev, 1000)
    assert ws.nbytes == symm.MIN_WORKSPACE_BYTES and ws.max_blocks == symm.MAX_BLOCKS
    assert symm.get_workspace(name, dev, symm.MIN_WORKSPACE_BYTES) is ws
    monkeypatch.setattr(symm, "capturing", lambda: True)
    with pytest.raises(RuntimeError, match="cannot grow during CUDA-graph capture"):
        symm.get_workspace(name, dev, 3 << 20)
    assert symm.get_workspace(name, dev, 1000) is ws  # a fitting one is fine while capturing
    monkeypatch.setattr(symm, "capturing", lambda: False)
    bigger = symm.get_workspace(name, dev, 3 << 20)
    assert bigger.nbytes == 4 << 20 and symm._RETIRED == [ws]  # kept alive for old graphs
    assert len(host_symm.allocs) == 2


def test_prepare_votes_on_each_step(host_symm):
    """A rank whose workspace allocation fails (out of memory) stops every rank before the
    rendezvous it would never join: prepare returns the reason, the same on every rank, and
    no workspace is registered (the lowering then keeps NCCL on every rank)."""
    name, dev = dist.group.WORLD.group_name, torch.device("cuda", 0)
    host_symm.fail_alloc = True
    ok, why = symm.prepare(name, dev, 1000)
    assert not ok and why.startswith("allocate: rank 0 of the group: RuntimeError: out of "
                                     "symmetric memory")
    assert symm._WORKSPACES == {} and host_symm.handles == []


def _interpreted_cuda_path(queue):
    """Child process: the op's CUDA implementation end to end on CPU tensors, the kernel
    interpreted, symmetric memory the host stand-in (1 rank)."""
    host = _install_host_symm(setattr)
    name = dist.group.WORLD.group_name
    out = []
    for tokens, hidden, residual in ((3, 40, True), (5, 64, False), (40, 8192, True)):
        x, r, w = _inputs(0, torch.float32, tokens, hidden)
        r = r if residual else None
        got = ops._cuda_impl(x, r, w, EPS, name)
        want = ops.reference(x, r, w, EPS, name)
        out.append((torch.equal(got[1], want[1]),
                    float((got[0] - want[0]).abs().max())))
    pads = [int(h.pad.abs().sum()) for h in host.handles]
    (ws,) = symm._WORKSPACES.values()
    queue.put((out, dict(ops.dispatch_counts), [w.nbytes for w in symm._RETIRED + [ws]],
               pads))


@pytest.mark.skipif(not HAS_TRITON, reason="Triton is not installed")
def test_cuda_implementation_end_to_end_interpreted(monkeypatch):
    """The CUDA implementation's glue on 1 rank: the readiness check, kernel_supports, the
    workspace (growing past 1 MiB on the third shape), the launch; results equal the
    reference (residual_out exactly, fp32) and every signal pad ends at zero."""
    ((out, counts, sizes, pads),) = _interpreted(monkeypatch, _interpreted_cuda_path,
                                                 lambda r: ())
    assert [equal for equal, _ in out] == [True, True, True]
    assert max(err for _, err in out) < 1e-5
    assert counts == {"triton": 3}
    assert sizes == [1 << 20, 2 << 20]
    assert pads == [0, 0, 0]  # the readiness probe's and both workspaces'


# --- nccl_symm: NCCL's all_reduce on a registered window (issue 22 §1) -------------------

NCCL_SYMM = torch.ops.fxcoalesce.nccl_symm_all_reduce.default


def test_nccl_symm_fake_and_reference_on_one_process():
    with FakeTensorMode():
        x = torch.empty(3, 8, dtype=torch.bfloat16, device="cuda").t()  # a strided view
        out = NCCL_SYMM(x, "0")
    assert out.shape == (8, 3) and out.dtype == torch.bfloat16 and out.is_contiguous()
    x = torch.randn(4, 8)
    out = NCCL_SYMM(x, "no such group")  # no peers: the sum is the input, in a new tensor
    assert torch.equal(out, x) and out.data_ptr() != x.data_ptr()


def test_use_nccl_backend_reports_torchs_refusal(monkeypatch):
    from fxcoalesce.kernels import nccl_symm

    calls = []

    class Sm:  # torch's module as seen on a GPU build: the switch takes, then it reads NCCL
        backend = "CUDA"

        def get_backend(self, device):
            return self.backend

        def set_backend(self, name):
            calls.append(name)
            if name != "NCCL":
                raise RuntimeError("Backend can not be changed after use.")
            self.backend = name

    monkeypatch.setattr(torch.distributed, "_symmetric_memory", Sm())
    assert nccl_symm.process_backend() == "CUDA"
    assert nccl_symm.use_nccl_backend() == (True, "ok") and calls == ["NCCL"]
    assert nccl_symm.use_nccl_backend() == (True, "ok") and calls == ["NCCL"]  # already
    torch.distributed._symmetric_memory.set_backend = lambda name: (_ for _ in ()).throw(
        RuntimeError("Backend can not be changed after use.\nmore"))
    torch.distributed._symmetric_memory.backend = "CUDA"
    assert nccl_symm.use_nccl_backend() == (
        False, "set_backend('NCCL'): RuntimeError: Backend can not be changed after use.")


@pytest.fixture
def host_nccl_symm(monkeypatch, host_symm):
    """The host stand-in, with this process's backend NCCL's and nccl_symm's state fresh."""
    from fxcoalesce.kernels import nccl_symm

    backend = {"now": "NCCL"}
    monkeypatch.setattr(nccl_symm, "process_backend", lambda: backend["now"])
    for name in ("_READY", "_WORKSPACES"):
        monkeypatch.setattr(nccl_symm, name, {})
    for name in ("_RETIRED", "_PROBES"):
        monkeypatch.setattr(nccl_symm, name, [])
    host_symm.backend = backend
    return host_symm


def test_nccl_symm_ready_tests_the_window_for_real(host_nccl_symm):
    from fxcoalesce.kernels import nccl_symm

    name = dist.group.WORLD.group_name
    assert nccl_symm.ready(name) == (True, "ok")
    (probe,) = host_nccl_symm.handles  # allocated, rendezvoused, summed exactly over gloo
    assert probe.tensor.numel() == 4096 and len(nccl_symm._PROBES) == 1
    assert nccl_symm.ready(name) == (True, "ok") and len(host_nccl_symm.handles) == 1


def test_nccl_symm_ready_refuses_another_backend_before_allocating(host_nccl_symm):
    from fxcoalesce.kernels import nccl_symm

    host_nccl_symm.backend["now"] = "CUDA"
    ok, why = nccl_symm.ready(dist.group.WORLD.group_name)
    assert not ok and why.startswith("symmetric-memory backend: rank 0 of the group: "
                                     "RuntimeError: this process's symmetric-memory backend "
                                     "is CUDA, not NCCL's")
    assert host_nccl_symm.allocs == []


def test_nccl_symm_ready_catches_a_wrong_sum(host_nccl_symm, monkeypatch):
    from fxcoalesce.kernels import nccl_symm

    real = dist.all_reduce
    monkeypatch.setattr(dist, "all_reduce", lambda t, *a, **k: (
        real(t, *a, **k), t.add_(1) if t.dtype == torch.float32 else None)[0])
    ok, why = nccl_symm.ready(dist.group.WORLD.group_name)
    assert not ok and why == ("exact all_reduce on the window: rank 0 of the group: "
                              "RuntimeError: all_reduce on the window off by up to 1.0 from "
                              "the exact sum")


def test_nccl_symm_prepare_votes_and_the_op_runs_on_the_window(host_nccl_symm, monkeypatch):
    """prepare: an allocation failing stops before the rendezvous, with the reason; then the
    op's CUDA path copies in, sums on the window, copies out; the window grows only outside
    capture and outgrown ones stay alive."""
    from fxcoalesce.kernels import nccl_symm

    name, dev = dist.group.WORLD.group_name, torch.device("cpu")
    assert nccl_symm.ready(name) == (True, "ok")
    host_nccl_symm.fail_alloc = True
    ok, why = nccl_symm.prepare(name, dev, 1000)
    assert not ok and why.startswith("allocate: rank 0 of the group: RuntimeError: out of "
                                     "symmetric memory")
    assert nccl_symm._WORKSPACES == {} and len(host_nccl_symm.handles) == 1  # the probe's
    host_nccl_symm.fail_alloc = False
    assert nccl_symm.prepare(name, dev, 1000) == (True, "ok")
    (ws,) = nccl_symm._WORKSPACES.values()
    assert ws.numel() == symm.MIN_WORKSPACE_BYTES
    x = torch.randn(16, 64).t()  # a view: the op reduces a contiguous copy
    out = nccl_symm._cuda(x, name)
    assert torch.equal(out, x) and out.is_contiguous()
    assert torch.equal(ws[:x.numel() * 4].view(torch.float32).view(64, 16), x)  # ran there
    assert out.data_ptr() != ws.data_ptr()  # the next call reuses the window: a copy out
    big = torch.randn(3 << 18)  # 3 MiB
    monkeypatch.setattr(symm, "capturing", lambda: True)
    with pytest.raises(RuntimeError, match="cannot grow during CUDA-graph capture"):
        nccl_symm._cuda(big, name)
    monkeypatch.setattr(symm, "capturing", lambda: False)
    assert torch.equal(nccl_symm._cuda(big, name), big)
    assert nccl_symm._WORKSPACES[(name, None)].numel() == 4 << 20
    assert nccl_symm._RETIRED == [ws]
