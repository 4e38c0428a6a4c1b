"""``inspect`` traces one layer of each kind and composes the whole step's report from them
(``apps.inspect.compose``): the composed numbers equal the full trace's (``--all-layers``)
for a dense model, a MoE model with dense first layers, a model with a layer-type pattern,
and a factory's own list of blocks; and the run-time check's bytes are counted as the run
sends them (``apps.inspect.check``)."""

from __future__ import annotations

import json

import pytest

from fxcoalesce.apps import cli

SMALL = ["--set", "hidden_size=128", "--set", "intermediate_size=256", "--set", "vocab_size=512",
         "--set", "num_attention_heads=4", "--set", "num_key_value_heads=4"]
MODELS = {  # name: (arguments, layers traced of the model's)
    # dense, parallel blocks: the first, one of the middle ones, the last (the slow set: the
    # check test below composes it, and the full size is in test_inspect_doors)
    "cohere": (["--hf", "cohere", "--tp", "4", "--layers", "7", *SMALL], (3, 7)),
    # MoE with 2 dense layers first: the first, a dense one, a MoE one, the last
    "deepseek_v3": (["--hf", "deepseek_v3", "--tp", "2", "--layers", "7", *SMALL,
                     "--set", "moe_intermediate_size=32", "--set", "first_k_dense_replace=2",
                     "--set", "n_routed_experts=4", "--set", "num_experts_per_tok=2",
                     "--set", "n_group=1", "--set", "topk_group=1", "--set", "q_lora_rank=null",
                     "--set", "kv_lora_rank=16", "--set", "qk_rope_head_dim=8",
                     "--set", "qk_nope_head_dim=8", "--set", "v_head_dim=16"], (4, 7)),
    # layer_types: three sliding-window layers, then a global one, twice
    "cohere2": (["--hf", "cohere2", "--tp", "4", "--layers", "8", *SMALL], (4, 8)),
    # layer_types five sliding, one global; its rotary embedding is a function whose nodes
    # name no layer innermost (the layer is further out in their module stack)
    "gemma3_text": (["--hf", "gemma3_text", "--tp", "2", "--layers", "8", *SMALL,
                     "--set", "head_dim=32"], (4, 8)),
}
COMPARED = ("all_reduce", "nodes", "chains", "other_collectives")


def inspect(capsys, tmp_path, name: str, *args: str) -> tuple[str, dict]:
    out_dir = tmp_path / name
    code = cli.main(["-q", "inspect", *args, "--out", str(out_dir)])
    out = capsys.readouterr()
    assert code == 0, out.err
    return out.out, json.loads((out_dir / "report.json").read_text())


def merges(report: dict) -> list[tuple]:
    return sorted((b["kind"], tuple(b["modules"])) for b in report["buckets"])


def predicted(report: dict) -> list[tuple]:
    return [(p["name"], p["before_us"], p["after_us"]) for p in report["predicted_per_profile"]]


@pytest.mark.parametrize("model", [pytest.param("cohere", marks=pytest.mark.slow),
                                   "deepseek_v3", pytest.param("cohere2", marks=pytest.mark.slow),
                                   "gemma3_text"])
def test_composed_equals_the_full_trace(model, capsys, tmp_path):
    pytest.importorskip("transformers")
    args, (traced, depth) = MODELS[model]
    out, composed = inspect(capsys, tmp_path, "composed", *args)
    full_out, full = inspect(capsys, tmp_path, "full", *args, "--all-layers")
    assert (f"  traced {traced} of {depth} layers, one of each kind (" in out
            and "composed the step's report from them; --all-layers traces every layer" in out)
    assert "traced" not in full_out.splitlines()[1]
    assert composed["composed"]["traced"] and full["composed"] is None
    assert sum(composed["composed"]["stands_for"]) == depth
    for key in COMPARED:
        assert composed[key] == full[key], key
    assert composed["predicted_comm_us"] == full["predicted_comm_us"]
    assert merges(composed) == merges(full)
    assert predicted(composed) == predicted(full)
    assert composed["verdict"] == full["verdict"]
    assert composed["run_time_check"] == full["run_time_check"]
    table = [line for line in out.splitlines() if line.startswith("  all_reduce ")]
    assert table == [line for line in full_out.splitlines() if line.startswith("  all_reduce ")]


def test_a_factory_s_blocks_compose(capsys, tmp_path):
    """A factory's own ``nn.ModuleList`` of blocks (no config): the same numbers."""
    from tests.test_inspect_doors import FACTORY

    path = tmp_path / "my_model.py"
    path.write_text(FACTORY.format(layers=6))
    out, composed = inspect(capsys, tmp_path, "composed", "--model", f"{path}:make", "--tp", "2")
    _, full = inspect(capsys, tmp_path, "full", "--model", f"{path}:make", "--tp", "2",
                      "--all-layers")
    assert "  traced 3 of 6 layers" in out
    for key in COMPARED:
        assert composed[key] == full[key], key
    assert merges(composed) == merges(full) and predicted(composed) == predicted(full)


def test_check_bytes_as_the_run_sends_them(capsys, tmp_path):
    """A rewritten step's check: a 2 * TAG_BITS-element tag on its first all_reduce and one
    element on the next, in the step's dtype (bf16 here), added to the bytes after; a step
    left in the program's order carries none."""
    pytest.importorskip("transformers")
    from fxcoalesce.ranks.tag import TAG_BITS

    out, report = inspect(capsys, tmp_path, "cohere", *MODELS["cohere"][0])
    check = report["run_time_check"]
    assert check == {"bytes": (2 * TAG_BITS + 1) * 2, "tags": 1, "gates": 1,
                     "tag_elements": 2 * TAG_BITS, "rewritten": True}
    a = report["all_reduce"]
    assert (f"  all_reduce bytes     {a['bytes_before']} -> {a['bytes_after'] + check['bytes']}"
            f"  ({a['bytes_after']} + {check['bytes']} of the run-time check)\n") in out
    assert (f"  run-time check       {check['bytes']} bytes a step: a {2 * TAG_BITS}-element tag "
            "on the first all_reduce, 1 element on the next all_reduce") in out
    out, report = inspect(capsys, tmp_path, "sequential", "--hf", "llama", "--tp", "4",
                          "--layers", "2", *SMALL)
    assert report["run_time_check"]["bytes"] == 0
    assert "  run-time check       none: the step keeps the program's own order" in out
