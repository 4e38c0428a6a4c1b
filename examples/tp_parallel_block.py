"""A tensor-parallel model of its own, compiled with fxcoalesce. On CPU, two gloo ranks:

    torchrun --nproc-per-node 2 examples/tp_parallel_block.py

The model is a few GPT-J / GPT-NeoX-style *parallel* blocks: attention and MLP read one norm
of the residual, and both outputs are added back. Tensor parallelism is applied after
construction (as in gpt-fast): column-parallel linears keep a slice of the outputs,
row-parallel linears a slice of the inputs, and a forward hook all_reduces each
row-parallel output. Each block therefore issues two all_reduces whose sum is all it needs:

    x + all_reduce(attn(h)) + all_reduce(mlp(h))   ->   x + all_reduce(attn(h) + mlp(h))

fxcoalesce makes that rewrite (its ``linearity`` pass), so a layer launches one all_reduce
instead of two. The same model with sequential blocks (each all_reduce feeds the next norm)
is already at its bound, and the report says so. Every rank checks its compiled output
against plain ``torch.compile``'s; rank 0 prints the reports and a one-line result.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as F
from torch import nn

import fxcoalesce
from fxcoalesce.apps.progress import Phase


@dataclass(kw_only=True, slots=True)
class ModelArgs:
    dim: int = 64
    n_heads: int = 4
    ffn_dim: int = 256
    n_layers: int = 4
    parallel: bool = True
    """GPT-J / NeoX blocks (attention and MLP off one norm); False: Llama-style blocks."""


class Attention(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.n_heads = args.n_heads
        self.head_dim = args.dim // args.n_heads
        self.wq = nn.Linear(args.dim, args.dim, bias=False)
        self.wk = nn.Linear(args.dim, args.dim, bias=False)
        self.wv = nn.Linear(args.dim, args.dim, bias=False)
        self.wo = nn.Linear(args.dim, args.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape  # [B, S, D]
        # after apply_tp each rank holds n_heads / world heads: [B, heads, S, head_dim]
        q, k, v = [w(x).view(b, s, -1, self.head_dim).transpose(1, 2)
                   for w in (self.wq, self.wk, self.wv)]
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(out.transpose(1, 2).reshape(b, s, -1))  # partial sum: [B, S, D]


class MLP(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.w1 = nn.Linear(args.dim, args.ffn_dim, bias=False)
        self.w2 = nn.Linear(args.ffn_dim, args.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.gelu(self.w1(x)))  # partial sum: [B, S, D]


class ParallelBlock(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.norm = nn.LayerNorm(args.dim)
        self.attn = Attention(args)
        self.mlp = MLP(args)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(x)
        return x + self.attn(h) + self.mlp(h)


class SequentialBlock(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.attn_norm = nn.LayerNorm(args.dim)
        self.mlp_norm = nn.LayerNorm(args.dim)
        self.attn = Attention(args)
        self.mlp = MLP(args)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x))
        return x + self.mlp(self.mlp_norm(x))


class Transformer(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        block = ParallelBlock if args.parallel else SequentialBlock
        self.blocks = nn.ModuleList(block(args) for _ in range(args.n_layers))
        self.norm = nn.LayerNorm(args.dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.norm(x)


def shard_linear_(linear: nn.Linear, dim: int, rank: int, world: int) -> None:
    """Keep this rank's slice of ``linear.weight`` ([out, in]) along ``dim``."""
    part = linear.weight.detach().chunk(world, dim=dim)[rank].clone()
    linear.weight = nn.Parameter(part, requires_grad=False)


def apply_tp(model: Transformer, group: dist.ProcessGroup) -> Transformer:
    """Shard ``model`` in place over ``group``: column-parallel q/k/v and w1 (dim 0 of the
    weight), row-parallel wo and w2 (dim 1), each row-parallel output summed over the ranks."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)

    def sum_over_ranks(_module, _inputs, out):
        return funcol.all_reduce(out, "sum", group)

    for block in model.blocks:
        for column in (block.attn.wq, block.attn.wk, block.attn.wv, block.mlp.w1):
            shard_linear_(column, 0, rank, world)
        for row in (block.attn.wo, block.mlp.w2):
            shard_linear_(row, 1, rank, world)
            row.register_forward_hook(sum_over_ranks)
    return model


def phase(what: str) -> Phase:
    """Rank 0 says on stderr what the ranks do and, every 20 s while it lasts, for how long
    (a compile takes 10-60 s on two busy CPU cores)."""
    say = ((lambda text: print(text, file=sys.stderr, flush=True)) if dist.get_rank() == 0
           else None)
    return Phase(say, f"{what} on {dist.get_world_size()} ranks")


def check_and_report(name: str, model: Transformer, x: torch.Tensor) -> dict:
    """Compile ``model`` with fxcoalesce and with plain torch.compile; compare on every rank."""
    with torch.no_grad():
        with phase(f"compiling the {name} with fxcoalesce"):
            out = torch.compile(model, backend="fxcoalesce")(x)
        report = fxcoalesce.reports()[-1]
        torch._dynamo.reset()  # the same model compiled again: never reuse the code above
        with phase(f"compiling the {name} with plain torch.compile"):
            expected = torch.compile(model, backend="inductor")(x)
    # floating-point summation order differs (the linearity pass adds before it reduces);
    # Config(reassociate=False) keeps the result bit-exact
    diff = (out - expected).abs().max().reshape(1)
    dist.all_reduce(diff, op=dist.ReduceOp.MAX)  # the worst rank's difference
    if not torch.allclose(out, expected, rtol=1e-5, atol=1e-5):
        raise SystemExit(f"rank {dist.get_rank()}: {name}: fxcoalesce's output differs from "
                         f"plain torch.compile's by {diff.item():.3g}")
    return {"name": name, "report": report, "max_abs_diff": diff.item()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=16)
    cli = parser.parse_args()

    dist.init_process_group("gloo")  # torchrun's env: RANK, WORLD_SIZE, MASTER_ADDR/PORT
    group = dist.group.WORLD
    results = []
    for parallel in (True, False):
        torch.manual_seed(0)  # every rank builds the same weights, then keeps its shard
        args = ModelArgs(n_layers=cli.layers, parallel=parallel)
        model = apply_tp(Transformer(args), group)
        x = torch.randn(1, cli.tokens, args.dim)  # [B, S, D], the same on every rank
        name = "parallel blocks" if parallel else "sequential blocks"
        results.append(check_and_report(name, model, x))

    if dist.get_rank() == 0:
        for r in results:
            print(f"{r['name']}: {r['report'].summary()}")
        counts = ", ".join(f"{r['name']} {r['report'].all_reduce['before']} -> "
                           f"{r['report'].all_reduce['after']}" for r in results)
        worst = max(r["max_abs_diff"] for r in results)
        print(f"result: all_reduce launches per step: {counts}; output equal to plain "
              f"torch.compile's on all {dist.get_world_size()} ranks (max abs diff {worst:.1e})")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
