"""Tier 4: Hugging Face models sharded by transformers itself, on 2 real gloo ranks.

Each tiny config (2 layers, hidden 64) is saved with ``save_pretrained`` here and loaded in
each rank with ``from_pretrained(path, tp_plan="auto")``: the model's own TP plan. Under
``no_grad`` its row-parallel layers end in ``dist.all_reduce`` (an all_reduce and a wait in
the ATen graph); with grad enabled they go through DTensor, whose ``to_local`` leaves a
``view`` after every wait, and the routed experts' in-place all_reduce comes back as
``copy(buf, wait)``: the layout-only ops ``passes.layout`` sees through. One spawn compiles
every case with fxcoalesce (``codegen="eager"``: the rewritten ATen graph run as Python,
which keeps this file within a minute; the Inductor codegen runs in the slow test) and
compares the logits with the eager forward's (within 2e-7; the slow Inductor run compares
them with plain ``torch.compile``'s, whose Inductor build took 45 s of this file's 70).

    model (2 layers)   all_reduces          bytes (6 tokens)
    Llama              5 -> 5 (its bound)   7680 -> 7680    embedding + 2 chained per layer
    Cohere             5 -> 3               7680 -> 4608    attention + MLP summed per layer
    DeepSeek-V3        4 -> 3               6144 -> 4608    routed.view(shape) + shared summed
      (transformers 5.25+: its TP plan leaves the experts to EP and shards MLA attention:
       5 -> 5, its bound, 7680 bytes)

The same with grad enabled (Cohere, DeepSeek-V3; the slow run). DeepSeek-V3's plan shards neither MLA
attention nor the gate: embedding, the dense layer's MLP, and the MoE layer's routed and
shared experts. Before ``passes.layout`` the two MoE all_reduces were bucketed (4 -> 3
launches, the same 6144 bytes), and so were Cohere's wherever a view or copy followed the
wait (grad enabled; ``codegen="eager"``, whose graphs keep the copy).
"""

from __future__ import annotations

import warnings

import pytest
import torch

from fxcoalesce.apps.launch import spawn

transformers = pytest.importorskip("transformers")
TOKENS = 6
SMALL = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=128, max_position_embeddings=64)


def configs() -> dict:
    T = transformers
    return {
        "llama": T.LlamaConfig(**SMALL),
        "cohere": T.CohereConfig(**SMALL),
        "deepseek_v3": T.DeepseekV3Config(
            **{**SMALL, "num_key_value_heads": 4}, moe_intermediate_size=32,
            first_k_dense_replace=1, n_routed_experts=4, num_experts_per_tok=2,
            n_shared_experts=1, n_group=1, topk_group=1, q_lora_rank=None, kv_lora_rank=16,
            qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16),
    }


def _logits(model, name: str = "logits"):
    """The step function of one model, a code object of its own (``logits_<name>``): as a
    user compiles each model through its own function. One function compiled for several
    models shares their agreements where the collectives are alike (the llama and the new
    DeepSeek-V3 plan issue the same 5 all_reduces): a later model issues what an earlier one
    committed to, and its report says so ("decided before")."""
    f = lambda ids: model(input_ids=ids, use_cache=False).logits  # noqa: E731
    f.__code__ = f.__code__.replace(co_name=f"logits_{name}")
    return f


def _compiled(model, ids, backend, grad: bool, name: str = "logits"):
    """Logits of ``model`` compiled behind a fresh dynamo cache."""
    torch._dynamo.reset()
    with torch.set_grad_enabled(grad):
        return torch.compile(_logits(model, name), backend=backend,
                             fullgraph=True)(ids).detach()


def _worker(rank, world, root, cases, codegen):
    import fxcoalesce

    torch.set_num_threads(1)
    warnings.simplefilter("ignore", FutureWarning)  # tp_plan= directly (transformers 5)
    out = {}
    ids = (torch.arange(TOKENS) % SMALL["vocab_size"]).reshape(1, TOKENS)
    for name, grad in cases:
        model = transformers.AutoModelForCausalLM.from_pretrained(
            f"{root}/{name}", tp_plan="auto").eval()  # float32, as saved
        reports = []
        be = fxcoalesce.backend(fxcoalesce.Config(codegen=codegen, strict=True),
                                on_graph=lambda b, a, r: reports.append(r))
        ours = _compiled(model, ids, be, grad, name)
        if codegen == "inductor" and not grad:
            want = _compiled(model, ids, "inductor", grad, name)
        else:
            with torch.no_grad():
                want = _logits(model)(ids)
        (report,) = reports
        out[name, grad] = {"all_reduce": report.all_reduce,
                           "kinds": sorted(b["kind"] for b in report.buckets),
                           "max_abs_err": float((ours - want).abs().max()),
                           "close": torch.allclose(ours, want, rtol=1e-5, atol=1e-5)}
    return out


def run_models(tmp_path, cases, codegen):
    for name in dict(cases):
        torch.manual_seed(0)
        model = transformers.AutoModelForCausalLM.from_config(configs()[name])
        model.save_pretrained(tmp_path / name)
    # transformers derives the TP degree from WORLD_SIZE, as torchrun sets it
    results = spawn(_worker, 2, args=(str(tmp_path), cases, codegen), backend="gloo",
                    env={"WORLD_SIZE": "2"}, timeout=600)
    assert results[0].keys() == results[1].keys()
    return results


def deepseek_experts_tp() -> bool:
    """Whether the installed transformers' DeepSeek-V3 TP plan shards the routed experts
    (up to 5.24: ``moe_tp_experts``; from 5.25 they are in ``base_model_ep_plan`` only, and
    the TP plan shards MLA attention instead)."""
    return "layers.*.mlp.experts" in transformers.DeepseekV3Config.base_model_tp_plan


EXPECTED = {  # (before, after, lower bound, bytes before, bytes after, buckets)
    "llama": (5, 5, 5, 7680, 7680, []),
    "cohere": (5, 3, 3, 7680, 4608, ["sum", "sum"]),
    # up to transformers 5.24: embedding, dense MLP, routed + shared summed; from 5.25:
    # embedding, then attention and MLP (shared experts) of each layer, one chain
    "deepseek_v3": ((4, 3, 3, 6144, 4608, ["sum"]) if deepseek_experts_tp() else
                    (5, 5, 5, 7680, 7680, [])),
}


CASES = [(name, False) for name in EXPECTED]
GRAD_CASES = [("cohere", True), ("deepseek_v3", True)]


def check(results, case):
    name, _ = case
    for rank, r in enumerate(results):
        got = r[case]
        a = got["all_reduce"]
        assert (a["before"], a["after"], a["lower_bound"], a["bytes_before"], a["bytes_after"],
                got["kinds"]) == EXPECTED[name], f"rank {rank}"
        assert got["close"], f"rank {rank}: logits differ by {got['max_abs_err']}"


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return run_models(tmp_path_factory.mktemp("hf"), CASES, "eager")


@pytest.mark.parametrize("case", CASES, ids=[f"{n}{'-grad' if g else ''}" for n, g in CASES])
def test_tp_plan_auto_counts_bytes_and_logits(results, case):
    check(results, case)


@pytest.mark.slow
def test_tp_plan_auto_with_grad_enabled(tmp_path):
    """DTensor's views and copies after every wait (``passes.layout``), against eager."""
    results = run_models(tmp_path, GRAD_CASES, "eager")
    for case in GRAD_CASES:
        check(results, case)


@pytest.mark.slow
def test_tp_plan_auto_with_inductor_codegen(tmp_path):
    results = run_models(tmp_path, CASES + GRAD_CASES, "inductor")
    for case in CASES + GRAD_CASES:
        check(results, case)
