"""Every private torch internal fxcoalesce touches, each with a canary, and what is turned off
where one fails.

fxcoalesce reaches past torch's public API: Dynamo's skip hook and guards, Inductor's entry
points and config keys, FX's private graph fields, the c10d store and process-group
internals, the functional collectives' and symmetric memory's op schemas, and a backport for
torch < 2.15. Each :class:`Internal` below names what is touched, why, since which torch,
and the *features* (:data:`FEATURES`) it guards. Its canary checks, cheaply (no compile, no
tensor, no process group of its own), that the internal is there and behaves as relied on,
and says so in one line.

On a torch outside the tested range (:data:`TESTED_FROM` to :data:`TESTED_TO`: what CI runs,
``.ci/torch-oldest.txt`` and ``.ci/torch-newest.txt``) the first compile (:func:`check_torch`,
called by the backend; anything that asks :func:`disabled` first does the same) warns once,
runs the canaries, and turns off exactly what a failed canary guards, one line each: down to
plain Inductor (``"rewrite"``: every all_reduce stays as the program wrote it), never a wrong
value. Inside the tested range the canaries are known to pass (CI runs them on the oldest
and the newest: ``tests/test_torch_internals.py``) and are not run at compile time.
``fxcoalesce doctor`` runs them anywhere.

Torch is imported only inside the canaries (``fxcoalesce doctor`` reads this module first).
"""

from __future__ import annotations

import inspect
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

log = logging.getLogger("fxcoalesce")

TESTED_FROM = (2, 11)
"""The oldest torch CI runs (.ci/torch-oldest.txt); pyproject.toml: ``torch>=2.11``."""
TESTED_TO = (2, 15)
"""The newest torch CI runs (.ci/torch-newest.txt). Newer ones install (pyproject.toml has no
upper bound); on them the first compile runs the canaries (:func:`check_torch`)."""

FEATURES = {
    "rewrite": "every rewrite: the passes see no all_reduce to merge, slice or lower, so each "
               "graph compiles as plain Inductor compiles it (collectives.find_comm_blocks)",
    "skip-hook": "hearing Dynamo's frame skips on this rank (ranks/hooks.py watch_dynamo)",
    "inductor-hook": "the backend's way into Inductor: compile_fx(inner_compile=...) with a "
                     "keyed post_grad_custom_pre_pass (graph_compile.GraphCompile._inductor)",
    "comm-reorder": "Inductor's comm reordering passes after fxcoalesce's "
                    "(torch_releases.comm_reorder_options)",
    "mutation-renames-backport": "the torch < 2.15 backport of pytorch#185873 "
                                 "(torch_releases.keep_mutation_renames)",
    "symm-mem": "the symmetric-memory lowerings: one-shot, two-shot, fused norm, nccl_symm "
                "(lowering.op_available)",
    "fast-graph-copy": "the pipeline's graph copy through FX's private fields "
                       "(pipeline._FAST_COPY; Graph.graph_copy otherwise)",
    "compile-cache": "fxcoalesce's saved entries beside Inductor's cache, for AOTAutograd "
                     "cache hits (compile_cache.save / load; a hit then compiles again)",
    "break-report": "the report of Dynamo's graph breaks at a dist.ReduceOp all_reduce "
                    "(reduce_ops.reduce_op_breaks)",
}
"""What can be turned off, and where (the function that consults :func:`disabled`)."""


class CanaryFailed(Exception):
    """What a canary found wrong, in one line."""


def _require(ok, why: str) -> None:
    if not ok:
        raise CanaryFailed(why)


def _params(fn) -> list[str]:
    return list(inspect.signature(fn).parameters)


# --- the canaries: each returns one line on success and raises on failure ---

IMPORTS = (
    ("torch._guards", ("TracingContext", "detect_fake_mode")),
    ("torch._subclasses.fake_tensor", ("FakeTensor", "FakeTensorMode",
                                       "unset_fake_temporarily")),
    ("torch.utils._python_dispatch", ("TorchDispatchMode", "_disable_current_modes")),
    ("torch.utils._pytree", ("tree_map", "tree_leaves", "tree_flatten", "tree_unflatten")),
    ("torch.utils._ordered_set", ("OrderedSet",)),
    ("torch._logging", ("trace_structured",)),
    ("torch.fx._lazy_graph_module", ("_make_graph_module", "_use_lazy_graph_module")),
    ("torch.fx.immutable_collections", ("immutable_dict",)),
    ("torch.fx.experimental.symbolic_shapes", ("statically_known_true",)),
    ("torch._ops", ("OpOverload", "OpOverloadPacket")),
    ("torch._refs", ("stack",)),
    ("torch._dynamo.backends.common", ("aot_autograd",)),
    ("torch._inductor.decomposition", ("select_decomp_table",)),
    ("torch._functorch.config", ("enable_autograd_cache",)),
    ("functorch.compile", ("make_boxed_func",)),
    ("torch", ("_assert_async",)),
)
"""Private modules and names fxcoalesce imports (most at its own import: a missing one means
``import fxcoalesce.compiler`` fails, which no switch here can help)."""


def canary_imports() -> str:
    import importlib

    missing = []
    for module, names in IMPORTS:
        try:
            m = importlib.import_module(module)
        except Exception as e:  # noqa: BLE001 (any import failure is the finding)
            missing.append(f"{module} ({type(e).__name__})")
            continue
        missing += [f"{module}.{n}" for n in names if not hasattr(m, n)]
    _require(not missing, f"missing: {', '.join(missing[:3])}"
             + (f" and {len(missing) - 3} more" if len(missing) > 3 else ""))
    return f"{sum(len(n) for _, n in IMPORTS)} names from {len(IMPORTS)} private modules import"


def canary_skip_hook() -> str:
    from torch._dynamo import convert_frame

    wrapper = getattr(convert_frame, "CatchErrorsWrapper", None)
    _require(wrapper is not None, "torch._dynamo.convert_frame has no CatchErrorsWrapper")
    from torch._dynamo.types import ConvertFrameReturn, GuardedCode

    result = ConvertFrameReturn()
    _require(hasattr(result, "guarded_code"), "ConvertFrameReturn has no guarded_code")
    _require("code" in _fields(GuardedCode), "GuardedCode has no code field")
    # ranks.hooks: a skip kept to one call, and the recompile limit read off the cache
    _require(hasattr(result, "apply_to_code") or not hasattr(wrapper, "_handle_skip"),
             "ConvertFrameReturn has no apply_to_code (a skip would hold for good)")
    from torch._dynamo import eval_frame

    _require(callable(getattr(eval_frame, "_debug_get_cache_entry_list", None)),
             "torch._dynamo.eval_frame has no _debug_get_cache_entry_list")
    handle = getattr(wrapper, "_handle_skip", None)
    if handle is not None:  # torch 2.13 on: every skip passes through it
        _require(_binds(handle, 3) and _params(handle)[:3] == ["self", "result", "frame"],
                 f"CatchErrorsWrapper._handle_skip{inspect.signature(handle)} is not "
                 "(self, result, frame)")
        _require(hasattr(result, "skip_reason"), "ConvertFrameReturn has no skip_reason")
        return "CatchErrorsWrapper._handle_skip(self, result, frame); result.skip_reason"
    _require(_params(wrapper.__call__)[:2] == ["self", "frame"],
             f"CatchErrorsWrapper.__call__{inspect.signature(wrapper.__call__)} does not take "
             "the frame first")
    return "CatchErrorsWrapper.__call__(self, frame, ...) (no _handle_skip: torch < 2.13)"


def _binds(fn, n: int) -> bool:
    """Whether ``fn`` takes exactly ``n`` positional arguments (as fxcoalesce calls it)."""
    try:
        inspect.signature(fn).bind(*[None] * n)
    except TypeError:
        return False
    return True


def _fields(cls) -> set[str]:
    fields = getattr(cls, "__dataclass_fields__", None)
    if fields is not None:
        return set(fields)
    return set(_params(cls))


def canary_cut_reason() -> str:
    from torch._dynamo.output_graph import GraphCompileReason, OutputGraph
    from torch._dynamo.symbolic_convert import InstructionTranslator

    _require(callable(getattr(InstructionTranslator, "current_tx", None)),
             "InstructionTranslator.current_tx is gone")
    want = {"reason", "user_stack", "graph_break"}
    _require(want <= _fields(GraphCompileReason),
             f"GraphCompileReason lacks {sorted(want - _fields(GraphCompileReason))}")
    try:
        source = inspect.getsource(OutputGraph)
    except (OSError, TypeError):  # no source shipped: the fields above are all we can see
        return "GraphCompileReason(reason, user_stack, graph_break); no source to read"
    _require("self.compile_subgraph_reason =" in source,
             "OutputGraph no longer sets compile_subgraph_reason")
    return "current_tx().output.compile_subgraph_reason: reason, user_stack, graph_break"


def canary_guards() -> str:
    from torch._dynamo.guards import GuardBuilder
    from torch._dynamo.source import LocalSource
    from torch._guards import Guard, TracingContext
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    TracingContext.try_get()  # callable outside a compile (None there)
    ctx = TracingContext(None)
    for attr in ("guards_context", "fake_mode", "traced_code"):
        _require(hasattr(ctx, attr), f"TracingContext has no {attr}")
    _require(hasattr(ctx.guards_context, "dynamo_guards"),
             "TracingContext.guards_context has no dynamo_guards")
    list(ctx.guards_context.dynamo_guards)
    for kind in ("CONSTANT_MATCH", "EQUALS_MATCH"):
        _require(hasattr(GuardBuilder, kind), f"GuardBuilder has no {kind}")
    guard = Guard(LocalSource("flag"), GuardBuilder.EQUALS_MATCH)
    _require(guard.create_fn_name() == "EQUALS_MATCH",
             f"Guard.create_fn_name() gives {guard.create_fn_name()!r}, not 'EQUALS_MATCH'")
    _require(guard.name == "L['flag']", f"Guard.name gives {guard.name!r}, not \"L['flag']\"")
    env = ShapeEnv()
    sym = env.create_symbol(5, LocalSource("step"))
    sources = env.var_to_sources.get(sym)
    _require(sources, "ShapeEnv.var_to_sources does not map a new symbol to its source")
    name = sources[0].name
    name = name if isinstance(name, str) else name()
    _require(name == "L['step']", f"a symbol's source is named {name!r}, not \"L['step']\"")
    value = env.create_symintnode(sym, hint=5)
    _require(bool(value > 2), "a SymInt of hint 5 is not > 2")
    exprs = [str(g.expr) for g in env.guards]
    _require(exprs == [f"{sym} > 2"], f"ShapeEnv.guards holds {exprs}, not ['{sym} > 2']")
    return "TracingContext's guards, Guard.create_fn_name, ShapeEnv var_to_sources / guards"


def canary_graph_break_reasons() -> str:
    from torch._dynamo import utils

    reasons = getattr(utils, "graph_break_reasons", None)
    _require(isinstance(reasons, list), "torch._dynamo.utils.graph_break_reasons is not a list")
    from torch._dynamo.output_graph import GraphCompileReason

    _require({"reason", "user_stack"} <= _fields(GraphCompileReason),
             "GraphCompileReason has no reason / user_stack")
    return "torch._dynamo.utils.graph_break_reasons: reason, user_stack"


def canary_inductor_entry() -> str:
    import torch
    from torch._inductor import config, list_mode_options
    from torch._inductor.compile_fx import compile_fx, compile_fx_inner
    from torch._inductor.custom_graph_pass import CustomGraphPass

    params = _params(compile_fx)
    _require({"inner_compile", "config_patches"} <= set(params),
             f"compile_fx{inspect.signature(compile_fx)} lacks inner_compile or config_patches")
    _require(len(_params(compile_fx_inner)) >= 2, "compile_fx_inner takes no (gm, inputs)")
    _require(CustomGraphPass.__abstractmethods__ == {"__call__", "uuid"},
             f"CustomGraphPass wants {sorted(CustomGraphPass.__abstractmethods__)}")
    known = set(torch._inductor.list_options())
    want = {"post_grad_custom_pre_pass", "post_grad_custom_post_pass", "triton.cudagraphs"}
    _require(want <= known, f"Inductor has no option {sorted(want - known)}")
    _require(list_mode_options("reduce-overhead").get("triton.cudagraphs") is True,
             "mode='reduce-overhead' no longer sets triton.cudagraphs")

    class Probe(CustomGraphPass):
        def __call__(self, graph) -> None:
            pass

        def uuid(self) -> str:
            return "fxcoalesce-canary"

    before, probe = config.post_grad_custom_pre_pass, Probe()
    with config.patch(post_grad_custom_pre_pass=probe):
        _require(config.post_grad_custom_pre_pass is probe,
                 "config.patch(post_grad_custom_pre_pass=...) does not set it")
    _require(config.post_grad_custom_pre_pass is before,
             "config.patch(post_grad_custom_pre_pass=...) does not restore it")
    return "compile_fx(inner_compile, config_patches), CustomGraphPass, custom pass options"


def canary_comm_reorder() -> str:
    import torch
    from torch._inductor import comms

    from .torch_releases import COMM_REORDER_PASSES

    known = set(torch._inductor.list_options())
    want = {"reorder_for_compute_comm_overlap", "reorder_for_compute_comm_overlap_passes"}
    _require(want <= known, f"Inductor has no option {sorted(want - known)}")
    gone = [p for p in COMM_REORDER_PASSES if not callable(getattr(comms, p, None))]
    _require(not gone, f"torch._inductor.comms has no pass {gone}")
    return f"reorder_for_compute_comm_overlap(_passes) and its {len(COMM_REORDER_PASSES)} passes"


def canary_mutation_renames() -> str:
    from .torch_releases import MUTATION_RENAMES_KEPT_FROM, _kept_mutation_renames, torch_version

    if torch_version() >= MUTATION_RENAMES_KEPT_FROM:
        return "not needed: torch keeps the renames itself from 2.15 (pytorch#185873)"
    from torch._inductor import scheduler
    from torch._inductor.dependencies import ReadWrites

    node = scheduler.SchedulerNode
    original = node.__dict__.get("recompute_size_and_body")
    _require(original is not None, "SchedulerNode.recompute_size_and_body is gone")
    _require(callable(getattr(node, "set_read_writes", None)), "SchedulerNode.set_read_writes "
             "is gone")
    for method in ("with_read", "rename"):
        _require(callable(getattr(ReadWrites, method, None)), f"ReadWrites.{method} is gone")
    with _kept_mutation_renames():
        _require(node.recompute_size_and_body is not original, "the backport does not apply")
    _require(node.__dict__["recompute_size_and_body"] is original,
             "the backport is not undone")
    return "recompute_size_and_body patched, restored (the torch < 2.15 backport)"


def canary_cache_dir() -> str:
    try:
        from torch._inductor.runtime.cache_dir_utils import cache_dir
    except ImportError:  # older layouts (compile_cache._directory reads both)
        from torch._inductor.runtime.runtime_utils import cache_dir
    where = cache_dir()
    _require(isinstance(where, str) and where, f"cache_dir() gives {where!r}")
    return f"cache_dir(): {where}"


def canary_graph_copy() -> str:
    import operator

    from torch.fx import Graph

    src = Graph()
    x = src.placeholder("x")
    y = src.call_function(operator.add, (x, 1))
    src.output(src.call_function(operator.mul, (y, y), {}))
    dst = Graph()
    fields = ("_graph_namespace", "_insert", "_find_nodes_lookup_table", "_len")
    _require(all(hasattr(dst, a) for a in fields),
             f"Graph lacks {[a for a in fields if not hasattr(dst, a)]}")
    from .meta import fast_graph_copy

    dst.output(fast_graph_copy(src, dst, {}))
    want = Graph()
    want.output(want.graph_copy(src, {}))
    _require(str(dst) == str(want), "a graph copied through the private fields differs from "
             "Graph.graph_copy's")
    _require(len(dst.nodes) == len(want.nodes) == 4, "the copy's node count is off")
    _require(len(dst.find_nodes(op="call_function", target=operator.add)) == 1,
             "find_nodes does not see the copied nodes")
    dst.lint()
    return "Graph._graph_namespace/_insert/_find_nodes_lookup_table/_len, Node(...)"


FUNCTIONAL = {"all_reduce": ["input", "reduce_op", "group_name"],
              "all_reduce_": ["input", "reduce_op", "group_name"],
              "wait_tensor": ["tensor"]}
OTHER_FUNCTIONAL = ("all_gather_into_tensor", "all_gather_into_tensor_coalesced",
                    "reduce_scatter_tensor", "reduce_scatter_tensor_coalesced",
                    "all_to_all_single", "all_reduce_coalesced", "all_reduce_coalesced_",
                    "broadcast", "broadcast_")
"""The functional collectives fxcoalesce reads and emits by argument name, and those it only
counts (collectives.OTHER_COLLECTIVES)."""


def canary_functional_collectives() -> str:
    import torch

    ns = torch.ops._c10d_functional
    for name, args in FUNCTIONAL.items():
        packet = getattr(ns, name, None)
        _require(packet is not None, f"_c10d_functional.{name} is gone")
        got = [a.name for a in packet.default._schema.arguments]
        _require(got == args, f"_c10d_functional.{name} takes {got}, not {args}")
    gone = [n for n in OTHER_FUNCTIONAL if not hasattr(ns, n)]
    _require(not gone, f"_c10d_functional has no {gone}")
    op = ns.all_reduce.default._schema.arguments[1].type
    more = len(OTHER_FUNCTIONAL)
    return f"all_reduce(input, reduce_op: {op}, group_name), wait_tensor, {more} more"


def canary_store() -> str:
    import torch.distributed as dist

    _require(dist.is_available(), "torch.distributed is not available in this build")
    store = dist.HashStore()
    # ranks/store.py: propose once (compare_set on an absent key sets it), then swap by value
    _require(store.compare_set("k", "", "a") == b"a", "compare_set on an absent key with "
             "expected '' does not set it")
    _require(store.compare_set("k", "x", "b") == b"a", "compare_set with a wrong expected "
             "value does not return the current one")
    _require(store.compare_set("k", "a", "b") == b"b", "compare_set with the right expected "
             "value does not swap")
    store.append("log", "1\n")
    store.append("log", "2\n")
    _require(store.get("log") == b"1\n2\n", "append does not concatenate")
    _require(store.add("n", 1) == 1 and store.add("n", 2) == 3, "add does not count")
    for cls in ("TCPStore", "PrefixStore", "FileStore"):
        for method in ("compare_set", "append", "add"):
            _require(hasattr(getattr(dist, cls), method), f"{cls} has no {method}")
    return "compare_set / append / add as ranks/store.py uses them"


def canary_process_group() -> str:
    import torch.distributed as dist

    _require(dist.is_available(), "torch.distributed is not available in this build")
    from torch.distributed import distributed_c10d as c10d

    pg = dist.ProcessGroup
    for attr in ("_get_sequence_number_for_group", "_get_backend", "_device_types",
                 "group_name"):
        _require(hasattr(pg, attr), f"ProcessGroup has no {attr}")
    for attr in ("_resolve_process_group", "_get_default_store", "_world"):
        _require(hasattr(c10d, attr), f"distributed_c10d has no {attr}")
    for attr in ("pg_names", "default_pg"):
        _require(hasattr(c10d._world, attr), f"distributed_c10d._world has no {attr}")
    if not dist.is_initialized():
        return "_get_sequence_number_for_group, _resolve_process_group, _world (no group)"
    group = c10d._world.default_pg
    _require(c10d._resolve_process_group(group.group_name) is group,
             "_resolve_process_group(name) does not give the group back")
    _require(group in c10d._world.pg_names, "_world.pg_names does not hold the default group")
    if dist.get_backend(group) != "fake":
        _require(isinstance(group._get_sequence_number_for_group(), int),
                 "_get_sequence_number_for_group() is not an int")
    return f"{dist.get_backend(group)} group: sequence number, _resolve_process_group, _world"


SYMM_OPS = {"one_shot_all_reduce": ["input", "reduce_op", "group_name"],
            "one_shot_all_reduce_copy": ["symm_buffer", "local_input", "reduce_op",
                                         "group_name"],
            "two_shot_all_reduce_": ["input", "reduce_op", "group_name"]}


def canary_symm_mem() -> str:
    import torch

    for name, args in SYMM_OPS.items():
        packet = getattr(torch.ops.symm_mem, name, None)
        _require(packet is not None, f"symm_mem.{name} is gone")
        got = [a.name for a in packet.default._schema.arguments]
        _require(got == args, f"symm_mem.{name} takes {got}, not {args}")
    import torch.distributed._symmetric_memory as sm

    want = ("enable_symm_mem_for_group", "is_symm_mem_enabled_for_group", "empty", "rendezvous",
            "set_backend", "get_backend")
    _require(all(hasattr(sm, n) for n in want),
             f"_symmetric_memory has no {[n for n in want if not hasattr(sm, n)]}")
    from torch._inductor.lowering import lowerings
    from torch._library.simple_registry import singleton

    _require(isinstance(lowerings, dict), "torch._inductor.lowering.lowerings is not a dict")
    _require(callable(getattr(torch._C, "_dispatch_has_kernel_for_dispatch_key", None)),
             "torch._C._dispatch_has_kernel_for_dispatch_key is gone")
    entry = singleton.find("symm_mem::one_shot_all_reduce")
    _require(hasattr(getattr(entry, "fake_impl", None), "kernel"),
             "torch._library's registry has no fake_impl.kernel")
    return f"{len(SYMM_OPS)} symm_mem op schemas, _symmetric_memory, the fake-kernel registry"


@dataclass(frozen=True)
class Internal:
    name: str
    what: str
    """The torch internals, by name."""
    why: str
    """What fxcoalesce uses them for."""
    versions: str
    """Which torch releases have them as relied on."""
    guards: tuple[str, ...]
    """The :data:`FEATURES` turned off when the canary fails."""
    canary: Callable[[], str]


INTERNALS = (
    Internal("imports", "private modules and names imported: torch._guards, "
             "torch._subclasses.fake_tensor, torch.utils._python_dispatch / _pytree / "
             "_ordered_set, torch._logging, torch.fx._lazy_graph_module, torch._refs, ...",
             "fake values, the pipeline's lazy graph modules, dispatch modes of the run-time "
             "checks", "2.11-2.15", ("rewrite",), canary_imports),
    Internal("dynamo.skip_hook", "torch._dynamo.convert_frame.CatchErrorsWrapper._handle_skip "
             "(2.13+) / __call__ (2.11), ConvertFrameReturn.skip_reason / guarded_code",
             "ranks/hooks.py: hear a frame Dynamo runs uncompiled on this rank, so peers stop "
             "waiting and a rewritten graph's peers are checked", "_handle_skip 2.13-2.15; "
             "__call__ 2.11-2.12", ("skip-hook", "rewrite"), canary_skip_hook),
    Internal("dynamo.cut_reason", "InstructionTranslator.current_tx().output."
             "compile_subgraph_reason (GraphCompileReason)",
             "ranks/agreement.cut_at: where a graph was cut, so a re-cut on one rank is seen",
             "2.11-2.15", ("rewrite",), canary_cut_reason),
    Internal("dynamo.guards", "torch._guards.TracingContext (guards_context.dynamo_guards, "
             "fake_mode.shape_env.guards / var_to_sources, traced_code), Guard.create_fn_name",
             "ranks/agreement.guard_keys and frame_identity: what a graph is specialized on, "
             "and which function it is", "2.11-2.15", ("rewrite",), canary_guards),
    Internal("dynamo.graph_break_reasons", "torch._dynamo.utils.graph_break_reasons",
             "reduce_ops.reduce_op_breaks: report the break at a dist.ReduceOp all_reduce",
             "2.11-2.15", ("break-report",), canary_graph_break_reasons),
    Internal("inductor.entry", "torch._inductor.compile_fx.compile_fx(inner_compile=, "
             "config_patches=) / compile_fx_inner, CustomGraphPass, config keys "
             "post_grad_custom_pre_pass / post_grad_custom_post_pass / triton.cudagraphs, "
             "list_mode_options", "graph_compile: the passes run inside inner_compile, the "
             "caches keyed through a post_grad_custom_pre_pass; compiler.FxCoalescePass",
             "2.11-2.15 (2.15: the pass options also take lists)",
             ("inductor-hook", "rewrite"), canary_inductor_entry),
    Internal("inductor.comm_reorder", "config reorder_for_compute_comm_overlap(_passes), "
             "torch._inductor.comms.sink_waits / raise_comms / reorder_compute_for_overlap",
             "torch_releases.comm_reorder_options: Inductor's overlap after fxcoalesce's passes",
             "2.11-2.15 (used from 2.14)", ("comm-reorder",), canary_comm_reorder),
    Internal("inductor.mutation_renames", "torch._inductor.scheduler.SchedulerNode."
             "recompute_size_and_body / set_read_writes, dependencies.ReadWrites, StarDep, "
             "WeakDep", "torch_releases.keep_mutation_renames: the backport of pytorch#185873 "
             "(a fused read lost its edge to an in-place all_reduce)", "patched on 2.11-2.14; "
             "not needed from 2.15", ("mutation-renames-backport", "rewrite"),
             canary_mutation_renames),
    Internal("inductor.cache_dir", "torch._inductor.runtime.cache_dir_utils.cache_dir "
             "(runtime_utils before)", "compile_cache: fxcoalesce's entries beside Inductor's "
             "cache", "2.11-2.15", ("compile-cache",), canary_cache_dir),
    Internal("fx.graph_copy", "torch.fx.Graph._graph_namespace / _insert / "
             "_find_nodes_lookup_table / _len, Node(graph, name, op, target, args, kwargs, type)",
             "meta.fast_graph_copy: copy a graph without create_node's argument scan "
             "(half the copy's time)", "2.11-2.15", ("fast-graph-copy",), canary_graph_copy),
    Internal("c10d.functional", "torch.ops._c10d_functional.all_reduce / all_reduce_ "
             "(input, reduce_op, group_name), wait_tensor, and the other collectives",
             "collectives: find, read by argument name, and emit the all_reduces",
             "2.11-2.15 (2.15: reduce_op is Any)", ("rewrite",), canary_functional_collectives),
    Internal("c10d.store", "Store.compare_set / append / add (TCPStore, PrefixStore, FileStore, "
             "HashStore)", "ranks/store.py: the ranks agree on each graph through the process "
             "group's store, never with a collective", "2.11-2.15", ("rewrite",),
             canary_store),
    Internal("c10d.process_group", "ProcessGroup._get_sequence_number_for_group / _get_backend / "
             "_device_types, distributed_c10d._resolve_process_group / _get_default_store / "
             "_world.pg_names / default_pg", "ranks: each rank's position in every group, "
             "the group a graph names, its timeout", "2.11-2.15", ("rewrite",),
             canary_process_group),
    Internal("symm_mem", "torch.ops.symm_mem.one_shot_all_reduce(_copy) / two_shot_all_reduce_, "
             "torch.distributed._symmetric_memory, Inductor's lowerings table, "
             "torch._library.simple_registry, torch._C._dispatch_has_kernel_for_dispatch_key",
             "lowering, passes/lower.py, kernels: symmetric-memory all_reduces and their "
             "fake kernels", "2.11-2.15", ("symm-mem",), canary_symm_mem),
)
assert all(f in FEATURES for i in INTERNALS for f in i.guards)


@dataclass(frozen=True)
class Result:
    name: str
    ok: bool
    line: str
    """What was checked (ok) or what is wrong (failed), one line."""
    guards: tuple[str, ...]
    ms: float

    def __str__(self) -> str:
        mark = "\u2714" if self.ok else "\u2718"
        tail = "" if self.ok else f" (off: {', '.join(self.guards)})"
        return f"{mark} {self.name}: {self.line}{tail}"


def run_canary(internal: Internal) -> Result:
    start = time.perf_counter()
    try:
        ok, line = True, internal.canary()
    except CanaryFailed as e:
        ok, line = False, str(e)
    except Exception as e:  # noqa: BLE001 (a moved internal raises anything)
        ok, line = False, f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e) else ''}"
    return Result(internal.name, ok, " ".join(line.split()), internal.guards,
                  (time.perf_counter() - start) * 1e3)


def run_canaries(names: list[str] | None = None) -> list[Result]:
    """Each canary's result (all of them, or those named), in :data:`INTERNALS`' order."""
    return [run_canary(i) for i in INTERNALS if names is None or i.name in names]


# --- the torch in use, and what is off on it ---

def version_tuple(version: str | None = None) -> tuple[int, int]:
    """(major, minor) of ``version`` (default: the installed torch's)."""
    if version is None:
        import torch

        version = str(torch.__version__)
    major, minor = version.split("+")[0].split(".")[:2]
    return int(major), int("".join(c for c in minor if c.isdigit()) or 0)


def tested_range() -> str:
    return f"{TESTED_FROM[0]}.{TESTED_FROM[1]} to {TESTED_TO[0]}.{TESTED_TO[1]}"


def is_tested(version: str | None = None) -> bool:
    return TESTED_FROM <= version_tuple(version) <= TESTED_TO


_LOCK = threading.RLock()
_STATE: dict = {}
"""Once per process: ``disabled`` (a frozenset), ``version`` (the torch it was decided for)."""


def check_torch() -> frozenset[str]:
    """The first compile's check (the backend calls it; :func:`disabled` does too): on a torch
    outside the tested range, warn once, run the canaries, turn off what a failed one guards
    (one line each). Returns the features off; cheap after the first call."""
    import torch

    version = str(torch.__version__)
    with _LOCK:
        if _STATE.get("version") == version:
            return _STATE["disabled"]
        _STATE.update(version=version, disabled=frozenset())  # re-entry sees nothing off
        if is_tested(version):
            return _STATE["disabled"]
        log.warning("fxcoalesce: torch %s is outside the range fxcoalesce is tested on (%s); "
                    "checking the torch internals it relies on (fxcoalesce doctor lists them)",
                    version, tested_range())
        off: set[str] = set()
        for result in run_canaries():
            if not result.ok:
                off.update(result.guards)
                log.warning("fxcoalesce: torch %s: %s changed (%s); turned off: %s", version,
                            result.name, result.line, ", ".join(result.guards))
        if "rewrite" in off:
            log.warning("fxcoalesce: every graph compiles as plain Inductor compiles it "
                        "(its all_reduces as the program wrote them) on torch %s", version)
        _STATE["disabled"] = frozenset(off)
        return _STATE["disabled"]


def disabled() -> frozenset[str]:
    """The :data:`FEATURES` turned off on this torch (empty inside the tested range, or where
    every canary passes)."""
    return check_torch()


def enabled(feature: str) -> bool:
    assert feature in FEATURES, feature
    return feature not in disabled()


def reason(feature: str) -> str:
    """Why ``feature`` is off, for a report line."""
    import torch

    return f"{feature} is off on torch {torch.__version__} (a changed internal: fxcoalesce doctor)"


def _reset() -> None:
    """Forget the decision (tests that fake a torch version)."""
    with _LOCK:
        _STATE.clear()


def comm_reorder_options() -> dict:
    """``torch_releases.comm_reorder_options``, {} where its canary failed."""
    from .torch_releases import comm_reorder_options as options

    return {} if "comm-reorder" in disabled() else options()


def keep_mutation_renames():
    """``torch_releases.keep_mutation_renames``, nothing where its canary failed (a failed
    canary turns the rewrites off with it)."""
    import contextlib

    from .torch_releases import keep_mutation_renames as keep

    return contextlib.nullcontext() if "mutation-renames-backport" in disabled() else keep()
