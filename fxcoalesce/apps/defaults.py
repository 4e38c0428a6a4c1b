"""What the commands take when they are not told: the main job's models and prompt, and the
process group backend of a run, and how a parameter count is written. Plain data and two
functions, read by ``checks`` (before any
work) and by ``tour`` (the main job), neither of which imports the other.
"""

from __future__ import annotations

PRETRAINED = "smollm2-135m"
"""The model with pretrained weights (apps/spec/smollm2.py): demo decodes it with a trained head."""
DEFAULT_PROMPT = "Why is the sky blue?"
"""What ``demo --model smollm2-135m`` asks without ``--prompt``."""
MERGE_MODEL = "neox-tiny"
"""The main job's first part: a model whose all_reduces fxcoalesce merges (``tour``)."""


def backend_of(args) -> str:
    """The process group backend a bench, demo or calibrate run will use: ``--backend``, else
    NCCL with ``--device cuda`` and a GPU per rank, else gloo."""
    from fxcoalesce.apps.launch import default_backend

    return args.backend or default_backend(args.device, args.tp)


def parameters_text(n: int) -> str:
    """A parameter count as people write it: 1026.41B, 3.78B, 2.1M, 12.3K, 512."""
    for scale, unit, digits in ((1e9, "B", 2), (1e6, "M", 1), (1e3, "K", 1)):
        if n >= scale:
            return f"{n / scale:.{digits}f}{unit}"
    return str(n)
