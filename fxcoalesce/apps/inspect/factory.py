"""The user's own model for ``inspect --model package.module:function`` (or
``path/to/file.py:function``): a factory that returns ``(module, plan, input)``.

    def make():                          # or make(group), for a module that shards itself
        model = MyModel(dim=8192, layers=40)          # the unsharded model, full size
        plan = {"layers.0.attn.wo": RowwiseParallel(), ...}   # or None
        return model, plan, (1, 16, 8192)             # the example input's shape

- ``module``: an ``nn.Module``; calling it on the input is the step traced.
- ``plan``: a ``parallelize_module`` plan, module path -> torch's ``ParallelStyle``
  (``ColwiseParallel()``, ``RowwiseParallel()``, ``SequenceParallel()``, ...), applied on a
  1-D device mesh of the fake group; or ``None`` when the module shards itself.
- ``input``: the example input's shape (a tuple of ints: zeros of the first parameter's
  dtype, or token ids when the module's first parameterised submodule is an
  ``nn.Embedding``), or an example tensor the factory makes.

A factory with a required parameter is called with the process group (``function(group)``):
a fake group of ``--tp`` ranks, ``group.size()`` is the TP degree and this rank is 0; it
shards the module itself (slices weights, adds ``funcol.all_reduce`` hooks, as gpt-fast
does). The factory runs under ``torch.device("meta")``, so a full-size model allocates no
weights (a tensor it makes on an explicit device does); its parameters and buffers then
become fake CPU tensors (``to_empty`` under ``FakeTensorMode``): shapes and dtypes, no
values. ``package.module`` is imported from the current directory or the environment; a
file's directory is put first on ``sys.path`` while it is imported.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import sys
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode

from fxcoalesce.apps.defaults import parameters_text
from fxcoalesce.apps.inspect.built import Built, first_line, parameter_count


def _split(spec: str) -> tuple[str, str]:
    where, _, name = spec.rpartition(":")
    if not where or not name.isidentifier():
        raise ValueError(f"--model {spec}: a factory is named 'package.module:function' or "
                         "'path/to/file.py:function'")
    return where, name


def _import_file(path: Path, spec: str):
    if not path.is_file():
        kind = "a directory, not a Python file" if path.is_dir() else "no such file"
        raise ValueError(f"--model {spec}: {path}: {kind}")
    name = f"fxcoalesce_user_{abs(hash(str(path.resolve())))}"
    module_spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(module_spec)
    sys.path.insert(0, str(path.resolve().parent))  # its own imports, as a script has them
    try:
        sys.modules[name] = module  # dataclasses and pickling look their module up by name
        module_spec.loader.exec_module(module)
    except Exception as e:
        sys.modules.pop(name, None)
        raise ValueError(f"--model {spec}: importing {path} failed: {first_line(e)}") from None
    finally:
        sys.path.remove(str(path.resolve().parent))
    return module


def _import_module(dotted: str, spec: str):
    if str(Path.cwd()) not in sys.path and "" not in sys.path:  # the console script's path
        sys.path.insert(0, str(Path.cwd()))                     # lacks the current directory
    try:
        return importlib.import_module(dotted)
    except ModuleNotFoundError as e:
        if e.name and dotted.startswith(e.name):
            raise ValueError(f"--model {spec}: no module named {e.name!r} (a zoo model's name "
                             "has no ':'; a factory is 'package.module:function' importable "
                             "from here, or 'path/to/file.py:function')") from None
        raise ValueError(f"--model {spec}: importing {dotted} failed: {first_line(e)}") \
            from None
    except Exception as e:
        raise ValueError(f"--model {spec}: importing {dotted} failed: {first_line(e)}") \
            from None


def load_factory(spec: str) -> Callable:
    """The function ``spec`` names; ValueError (one line) when it cannot be had."""
    where, name = _split(spec)
    is_file = where.endswith(".py") or "/" in where or "\\" in where
    module = _import_file(Path(where), spec) if is_file else _import_module(where, spec)
    fn = getattr(module, name, None)
    if fn is None:
        raise ValueError(f"--model {spec}: {where} has no {name!r}")
    if not callable(fn):
        raise ValueError(f"--model {spec}: {name} is a {type(fn).__name__}, not a function")
    return fn


def takes_group(fn: Callable) -> bool:
    """Whether ``fn`` has a required parameter (it is then given the process group)."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return False
    return any(p.default is p.empty and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
               for p in params)


def _checked(result, spec: str) -> tuple[nn.Module, dict | None, object]:
    from torch.distributed.tensor.parallel import ParallelStyle

    if not (isinstance(result, tuple) and len(result) == 3):
        got = f"a tuple of {len(result)}" if isinstance(result, tuple) else type(result).__name__
        raise ValueError(f"--model {spec}: the factory returned {got}; return (module, plan, "
                         "input_shape)")
    module, plan, example = result
    if not isinstance(module, nn.Module):
        raise ValueError(f"--model {spec}: the factory's module is a {type(module).__name__}, "
                         "not an nn.Module")
    if plan is not None:
        if not isinstance(plan, dict):
            raise ValueError(f"--model {spec}: the plan is a {type(plan).__name__}; give a dict "
                             "of module path -> ColwiseParallel() / RowwiseParallel() / ..., or "
                             "None when the module shards itself")
        modules = dict(module.named_modules())
        for path, style in plan.items():
            if not isinstance(style, ParallelStyle):
                raise ValueError(f"--model {spec}: plan[{path!r}] is {style!r}, not a "
                                 "ParallelStyle (ColwiseParallel(), RowwiseParallel(), ...)")
            if "*" not in str(path) and path not in modules:
                raise ValueError(f"--model {spec}: plan names {path!r}, which is no submodule "
                                 f"of {type(module).__name__}")
    shape_like = (isinstance(example, (tuple, list, torch.Size)) and len(example) > 0
                  and all(isinstance(d, int) and not isinstance(d, bool) and d > 0
                          for d in example))
    if not (shape_like or isinstance(example, torch.Tensor)):
        raise ValueError(f"--model {spec}: the input is {example!r}; give its shape as a tuple "
                         "of positive ints (e.g. (1, 16, 4096)), or an example tensor")
    return module, plan, example


def _example_input(module: nn.Module, example) -> torch.Tensor:
    """The fake input: ``example`` if it is a tensor, else zeros of its shape (token ids for
    a module that starts with an embedding, else the first parameter's dtype)."""
    if isinstance(example, torch.Tensor):
        return torch.empty_like(example, device="cpu")
    first = next((m for m in module.modules() if next(m.parameters(recurse=False), None)
                  is not None), None)
    if isinstance(first, nn.Embedding):
        return torch.zeros(tuple(example), dtype=torch.long)
    dtype = next(module.parameters()).dtype if first is not None else torch.float32
    return torch.zeros(tuple(example), dtype=dtype)


def build_factory(spec: str, tp: int, group) -> Built:
    """Call the factory ``spec`` names, shard what it returns over ``group`` (``tp`` ranks),
    and make its example input, all without weights. ValueError (one line) for a factory
    that fails or returns something else than ``(module, plan, input)``."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import parallelize_module

    fn = load_factory(spec)
    call = f"{spec.rpartition(':')[2]}({'group' if takes_group(fn) else ''})"
    try:
        with torch.device("meta"):
            result = fn(group) if takes_group(fn) else fn()
    except Exception as e:
        raise ValueError(f"--model {spec}: the factory failed: {first_line(e)}") from None
    module, plan, example = _checked(result, spec)
    params = parameter_count(module)
    mesh = init_device_mesh("cpu", (tp,)) if plan and tp > 1 else None  # not under fake mode
    mode = FakeTensorMode(allow_non_fake_inputs=True)  # the factory's meta tensors come in
    try:
        with mode:
            module.to_empty(device="cpu")
            if mesh is not None:
                parallelize_module(module, mesh, plan)
            x = _example_input(module, example)
    except Exception as e:
        raise ValueError(f"--model {spec}: sharding it with its plan failed: "
                         f"{first_line(e)}") from None
    sharding = ("its plan" if plan else "itself") if tp > 1 else "none (TP 1)"
    what = (f"{spec}: {call} -> {type(module).__name__}, {parameters_text(params)} parameters, "
            f"sharded by {sharding}; input {tuple(x.shape)} {str(x.dtype).removeprefix('torch.')}")
    return Built(fn=module.eval(), args=(x,), mode=mode, what=what, parameters=params,
                 model=module)
