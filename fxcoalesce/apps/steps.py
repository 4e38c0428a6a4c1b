"""The step each application traces, benchmarks or runs: ``make_step(model, step, tokens)``.

Models only define modules; what a "forward" or an EAGLE-3 "verify" step feeds them lives
here, next to the tools that use it.

    forward: prefill of ``tokens`` tokens (dense decoders: a plain forward, no cache)
    verify:  EAGLE-3 verification of a binary tree of ``tokens`` nodes after a cached prefix
"""

from __future__ import annotations

import torch

STEPS = ("forward", "verify")


def make_step(model: torch.nn.Module, step: str, tokens: int, prefix: int = 64):
    """(callable, example args) running ``step`` on ``model``; the callable returns logits.

    Dense decoders (``models.transformer``) offer "forward" only; KV-cached targets
    (``models.deepseek``) offer both, after a cache of ``prefix + tokens`` slots is set up.
    """
    if step not in STEPS:
        raise ValueError(f"unknown step {step!r}; choose one of: {', '.join(STEPS)}")
    if not hasattr(model, "setup_cache"):
        if step != "forward":
            raise ValueError(f"{type(model).__module__.rsplit('.', 1)[-1]} models support only "
                             f"step 'forward', not {step!r}")
        return model, (torch.zeros(1, tokens, dtype=torch.long),)
    from fxcoalesce.models.deepseek import causal_mask
    from fxcoalesce.models.eagle3 import Tree, tree_verify_inputs, verify_step

    model.setup_cache(1, prefix + tokens)
    if step == "forward":
        input_pos = cache_pos = torch.arange(tokens)
        mask = causal_mask(cache_pos, prefix + tokens)
    else:
        parents = [-1] + [(i - 1) // 2 for i in range(1, tokens)]
        tree = Tree.from_parents(torch.zeros(tokens, dtype=torch.long), parents)
        input_pos, cache_pos, mask = tree_verify_inputs(tree, prefix, prefix + tokens)

    def logits_of(tokens, input_pos, cache_pos, mask):  # the EAGLE hidden states add no comm
        return verify_step(model, tokens, input_pos, cache_pos, mask)[0]

    return logits_of, (torch.zeros(1, tokens, dtype=torch.long), input_pos, cache_pos, mask)


def steps_for(name: str) -> tuple[str, ...]:
    """The steps :func:`make_step` offers for model ``name``, known before building it (as the
    CLI checks need): "verify" needs a KV cache, i.e. a model class with ``setup_cache``."""
    from fxcoalesce import models

    return STEPS if hasattr(models.family_of(name).Transformer, "setup_cache") else ("forward",)
