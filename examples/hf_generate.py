"""Hugging Face ``generate()`` on tensor-parallel ranks, compiled through fxcoalesce. On CPU,
two gloo ranks:

    torchrun --standalone --nproc-per-node 2 examples/hf_generate.py [PATH] [--arch cohere]

Any causal LM with a tensor-parallel plan (``base_model_tp_plan``) loads sharded over the
ranks by transformers itself: ``from_pretrained(PATH, distributed_config=DistributedConfig(
tp_plan="auto"))``, or ``tp_plan="auto"`` on a transformers without ``DistributedConfig``.
Without PATH, rank 0 makes a tiny model of ``--arch`` (random weights, seeded) and saves it
in a temporary directory (safetensors) for every rank to load.

Greedy decoding runs three ways on the same prompt: eager, with ``model.forward`` compiled
by plain ``torch.compile``, and with it compiled by the fxcoalesce backend. Every rank checks
that the three give the same tokens; rank 0 prints each compiled graph's report and the time
per token of both compiled runs (after a warm-up, alternating, medians with their range).

Why ``model.forward``: ``generate()`` has its own compile route (a static cache and
``GenerationConfig.compile_config``), but it compiles only on CUDA, XPU, Neuron or TPU
unless the private ``CompileConfig._compile_all_devices`` is set; compiling the forward
works on any device and with the dynamic cache. Decoding changes the cache's length every
step, so Dynamo compiles the prefill, the first decode step, and a dynamic-length decode
step after that (``automatic_dynamic_shapes``): three graphs, each with its report.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist

import fxcoalesce
from fxcoalesce.apps.progress import Phase

TINY = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=4, vocab_size=512, max_position_embeddings=256,
            bos_token_id=1, eos_token_id=2, pad_token_id=0)
"""The tiny config's sizes (any architecture whose config takes these names)."""


def tiny_model_dir(arch: str) -> str:
    """Rank 0 saves a seeded random model of ``arch``; every rank gets its directory."""
    import transformers

    path = [None]
    if dist.get_rank() == 0:
        config = transformers.AutoConfig.for_model(arch, **TINY)
        torch.manual_seed(0)
        model = transformers.AutoModelForCausalLM.from_config(config)
        path[0] = tempfile.mkdtemp(prefix=f"fxcoalesce-hf-{arch}-")
        model.save_pretrained(path[0])  # safetensors: no pickle on the way back in
    dist.broadcast_object_list(path, src=0)
    return path[0]


def load_sharded(path: str):
    """``path``'s causal LM, sharded over the ranks by its own TP plan, the way the installed
    transformers recommends."""
    import transformers

    try:
        from transformers.distributed import DistributedConfig
    except ImportError:  # transformers before DistributedConfig: tp_plan= directly
        return transformers.AutoModelForCausalLM.from_pretrained(path, tp_plan="auto").eval()
    return transformers.AutoModelForCausalLM.from_pretrained(
        path, distributed_config=DistributedConfig(tp_plan="auto")).eval()


def generate(model, ids: torch.Tensor, tokens: int) -> torch.Tensor:
    with torch.no_grad():
        return model.generate(ids, max_new_tokens=tokens, min_new_tokens=tokens,
                              do_sample=False, pad_token_id=0)


def deciles(values: list[float]) -> tuple[float, float]:
    """(p10, p90) of ``values``."""
    if len(values) < 2:
        return values[0], values[0]
    cuts = statistics.quantiles(values, n=10, method="inclusive")
    return cuts[0], cuts[-1]


def p10_p90(values: list[float]) -> str:
    lo, hi = deciles(values)
    return f"{lo:.2f}-{hi:.2f}"


def ms_per_token(model, ids, tokens: int) -> float:
    dist.barrier()
    start = time.perf_counter()
    generate(model, ids, tokens)
    took = torch.tensor([time.perf_counter() - start])
    dist.all_reduce(took, op=dist.ReduceOp.MAX)  # a step is as slow as its slowest rank
    return took.item() * 1e3 / tokens


def phase(what: str, **kw) -> Phase:
    """Rank 0 says on stderr what the ranks do and, every 20 s while it lasts, for how long
    (the compiles take minutes on two busy CPU cores)."""
    say = ((lambda text: print(text, file=sys.stderr, flush=True)) if dist.get_rank() == 0
           else None)
    return Phase(say, f"{what} on {dist.get_world_size()} ranks", **kw)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("path", nargs="?", help="a saved causal LM with a TP plan (default: "
                        "a tiny random one of --arch, made here)")
    parser.add_argument("--arch", default="cohere",
                        help="model type of the tiny model (default: %(default)s)")
    parser.add_argument("--tokens", type=int, default=16, help="new tokens (default: 16)")
    parser.add_argument("--rounds", type=int, default=20,
                        help="timed generate() calls of each compiled model, alternating; 0 "
                             "times nothing (default: 20)")
    cli = parser.parse_args()
    torch.set_num_threads(1)  # the ranks share the cores
    import transformers

    transformers.utils.logging.disable_progress_bar()  # one bar per rank per load otherwise

    dist.init_process_group("gloo")  # torchrun's env: RANK, WORLD_SIZE, MASTER_ADDR/PORT
    path = cli.path or tiny_model_dir(cli.arch)
    model = load_sharded(path)
    vocab = model.config.get_text_config().vocab_size
    ids = torch.randint(1, vocab, (1, 8), generator=torch.Generator().manual_seed(0))

    with phase(f"generating {cli.tokens} tokens eagerly"):
        eager = generate(model, ids, cli.tokens)
    forward = model.forward
    # one forward compiled twice: Dynamo keeps each backend's graphs apart (it guards on the
    # backend), and the reports below show that fxcoalesce compiled its own
    compiled = {"torch.compile": torch.compile(forward, backend="inductor"),
                "fxcoalesce": torch.compile(forward, backend="fxcoalesce")}
    model.forward = compiled["torch.compile"]
    with phase("compiling the prefill and decode steps with plain torch.compile"):
        plain = generate(model, ids, cli.tokens)
    model.forward = compiled["fxcoalesce"]
    with phase("compiling the prefill and decode steps with fxcoalesce"):
        ours = generate(model, ids, cli.tokens)
    reports = fxcoalesce.reports()[:]
    if not reports:
        raise SystemExit("fxcoalesce compiled no graph: Dynamo reused plain torch.compile's")
    same = torch.tensor([int(torch.equal(eager, plain) and torch.equal(plain, ours))])
    dist.all_reduce(same, op=dist.ReduceOp.MIN)
    if not same.item():
        raise SystemExit(f"rank {dist.get_rank()}: tokens differ: eager {eager.tolist()}, "
                         f"torch.compile {plain.tolist()}, fxcoalesce {ours.tolist()}")

    times = {k: [] for k in compiled}
    rounds = 1 + cli.rounds if cli.rounds else 0
    with phase("timing generate()", total=rounds, unit="rounds (the first untimed)") as timing:
        for round in range(rounds):  # a warm-up round, then alternating
            for name, fn in compiled.items():
                model.forward = fn
                took = ms_per_token(model, ids, cli.tokens)
                if round:
                    times[name].append(took)
            timing.advance()
    if dist.get_rank() == 0:
        where = path if cli.path else f"tiny, random weights, saved in {path}"
        print(f"{type(model).__name__} ({where}), TP={dist.get_world_size()} (gloo), "
              f"greedy, {cli.tokens} new tokens")
        for r in reports:
            print(r.summary().splitlines()[0])
        if cli.rounds:
            spread = {k: f"{statistics.median(v):.2f} ms ({p10_p90(v)})" for k, v in times.items()}
            (lo_a, hi_a), (lo_b, hi_b) = (deciles(v) for v in times.values())
            noise = "; the ranges overlap: within noise" if lo_a <= hi_b and lo_b <= hi_a else ""
            print(f"ms per token, median of {cli.rounds} generate() calls (p10-p90): "
                  f"torch.compile {spread['torch.compile']}, fxcoalesce "
                  f"{spread['fxcoalesce']}{noise}")
        print(f"result: tokens equal to eager and to plain torch.compile on all "
              f"{dist.get_world_size()} ranks: {ours[0, ids.shape[1]:].tolist()}")
    dist.barrier()  # every rank has loaded it: the tiny model made here can go
    if not cli.path and dist.get_rank() == 0:
        shutil.rmtree(path, ignore_errors=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
