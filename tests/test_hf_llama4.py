"""Tier 4: Llama-4 (text) sharded by transformers' own plan, on 2 real gloo ranks (issue 34).

Llama-4 is the one current Hugging Face plan that still TP-shards routed experts
(``moe_tp_experts``: an all_reduce after them). Its MoE ends

    out = self.shared_expert(hidden_states)                  # rowwise: AR(s)      [n, d]
    out.add_(routed_out.reshape(k, -1, d).sum(dim=0))         # AR(r) of [k * n, d]

so the routed all_reduce is read through a reshape and a sum over the experts' dimension,
then added in place into the shared expert's. Both are linear: one all_reduce of
``s + sum_0(reshape(r))``, of [n, d], replaces the two (the ``linearity`` pass). Before, the
two were bucketed: 7 -> 5 launches at the same bytes.

    model (2 layers, hidden 64, 4 experts, 16 tokens, float32)
    all_reduces 7 -> 5 (its bound: embedding, then attention and MoE of each layer, a chain)
    bytes 53248 -> 20480 (bucketed before: 53248 -> 53248)

Logits are compared with plain ``torch.compile``'s (Inductor), under ``no_grad``: with grad
enabled transformers' own forward raises, eagerly as compiled (``out.add_`` writes into the
view DTensor's ``to_local`` returns, which autograd forbids; transformers 5.25).
"""

from __future__ import annotations

import warnings

import pytest
import torch

from fxcoalesce.apps.launch import spawn

transformers = pytest.importorskip("transformers")
TOKENS = 16
CONFIG = dict(hidden_size=64, intermediate_size=128, intermediate_size_mlp=128,
              num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
              vocab_size=128, max_position_embeddings=64, num_local_experts=4,
              num_experts_per_tok=1)
EXPECTED = {"before": 7, "after": 5, "lower_bound": 5, "bytes_before": 53248,
            "bytes_after": 20480}


def _worker(rank, world, path, plain):
    import fxcoalesce

    torch.set_num_threads(1)
    warnings.simplefilter("ignore", FutureWarning)
    model = transformers.AutoModelForCausalLM.from_pretrained(path, tp_plan="auto").eval()
    ids = (torch.arange(TOKENS) % CONFIG["vocab_size"]).reshape(1, TOKENS)
    step = lambda ids: model(input_ids=ids, use_cache=False).logits  # noqa: E731
    reports = []
    be = fxcoalesce.backend(fxcoalesce.Config(codegen="eager", strict=True),
                            on_graph=lambda b, a, r: reports.append(r))
    with torch.no_grad():
        torch._dynamo.reset()
        ours = torch.compile(step, backend=be, fullgraph=True)(ids)
        torch._dynamo.reset()
        want = torch.compile(step, backend="inductor", fullgraph=True)(ids) if plain else step(ids)
    (report,) = reports
    a = report.all_reduce
    return {"all_reduce": {k: a[k] for k in EXPECTED},
            "kinds": sorted(b["kind"] for b in report.buckets),
            "max_abs_err": float((ours - want).abs().max()),
            "close": torch.allclose(ours, want, rtol=1e-5, atol=1e-5)}


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    path = tmp_path_factory.mktemp("llama4")
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(
        transformers.Llama4TextConfig(**CONFIG))
    model.save_pretrained(path)
    return str(path)


def check(path: str, plain: bool) -> None:
    # transformers derives the TP degree from WORLD_SIZE, as torchrun sets it
    results = spawn(_worker, 2, args=(path, plain), backend="gloo",
                    env={"WORLD_SIZE": "2"}, timeout=600)
    for rank, r in enumerate(results):
        assert r["all_reduce"] == EXPECTED, f"rank {rank}"
        # launches at the bound, and the bytes of one [n, d] per MoE instead of (k + 1)
        a = r["all_reduce"]
        assert a["after"] == a["lower_bound"] and a["bytes_after"] < a["bytes_before"]
        assert r["kinds"] == ["sum", "sum"], f"rank {rank}"
        assert r["close"], f"rank {rank}: logits differ by {r['max_abs_err']}"


def test_llama4_moe_is_one_summed_all_reduce_per_layer(saved):
    """Logits against the eager forward's (the Inductor compile of plain costs a minute)."""
    check(saved, plain=False)


@pytest.mark.slow
def test_llama4_logits_equal_plain_torch_compile(saved):
    check(saved, plain=True)
