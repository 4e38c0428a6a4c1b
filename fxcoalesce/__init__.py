"""fxcoalesce: fewer, fused all_reduces for tensor-parallel inference, as a torch.compile pass.

    import fxcoalesce
    compiled = torch.compile(step, backend="fxcoalesce")        # or fxcoalesce.backend(cfg)
    compiled(x); print(fxcoalesce.reports()[-1].summary())

The core (what torch.compile calls) is this package's modules; ``fxcoalesce.passes`` holds the
passes, ``fxcoalesce.models`` the model zoo and ``fxcoalesce.apps`` the command-line tools.
Names are imported on first use, so ``fxcoalesce --help`` does not wait for torch.
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "Analysis": "analysis", "analyze": "analysis",
    "backend": "compiler", "inductor_pass": "compiler",
    "find_comm_blocks": "collectives",
    "Config": "config", "CostModel": "config",
    "run_pipeline": "pipeline",
    "Report": "report", "clear_reports": "report", "reports": "report",
    "CollectiveMismatchError": "errors",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'fxcoalesce' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
