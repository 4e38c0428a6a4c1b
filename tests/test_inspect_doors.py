"""``fxcoalesce inspect`` on the user's own model: a factory in a file outside the repository
(``--model path/file.py:function``) and a Hugging Face architecture by config (``--hf``),
each traced under fake tensors on a fake group; and each bad input as one line.

The expected counts are computed from the model's shape: a parallel block issues two
all_reduces that sum into one, a sequential block two in a chain, an embedding one."""

from __future__ import annotations

import json
import re
import textwrap

import pytest

from fxcoalesce.apps import cli

FACTORY = textwrap.dedent('''
    import torch
    import torch.distributed as dist
    import torch.distributed._functional_collectives as funcol
    import torch.nn.functional as F
    from torch import nn
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    LAYERS, DIM, HEAD = {layers}, 256, 64

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.norm = nn.LayerNorm(DIM)
            self.qkv = nn.Linear(DIM, 3 * DIM, bias=False)
            self.proj = nn.Linear(DIM, DIM, bias=False)
            self.up = nn.Linear(DIM, 4 * DIM, bias=False)
            self.down = nn.Linear(4 * DIM, DIM, bias=False)

        def forward(self, x):
            b, s, _ = x.shape
            h = self.norm(x)
            q, k, v = self.qkv(h).view(b, s, 3, -1, HEAD).transpose(1, 3).unbind(2)
            a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            return x + self.proj(a.transpose(1, 2).reshape(b, s, -1)) + self.down(
                F.gelu(self.up(h)))

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = nn.ModuleList(Block() for _ in range(LAYERS))

        def forward(self, x):
            for block in self.blocks:
                x = block(x)
            return x

    def make():
        plan = {{}}
        for i in range(LAYERS):
            column, row = ColwiseParallel(), RowwiseParallel()
            plan |= {{f"blocks.{{i}}.qkv": column, f"blocks.{{i}}.proj": row,
                     f"blocks.{{i}}.up": column, f"blocks.{{i}}.down": row}}
        return Net().to(torch.bfloat16), plan, (1, 8, DIM)

    class Sequential(nn.Module):
        """shards itself (gpt-fast style): a chain of MLPs, each summed over the group"""
        def __init__(self, group):
            super().__init__()
            world = dist.get_world_size(group)
            self.up = nn.ModuleList(nn.Linear(DIM, 4 * DIM // world) for _ in range(LAYERS))
            self.down = nn.ModuleList(nn.Linear(4 * DIM // world, DIM) for _ in range(LAYERS))
            for d in self.down:
                d.register_forward_hook(lambda m, i, out: funcol.all_reduce(out, "sum", group))

        def forward(self, x):
            for up, down in zip(self.up, self.down):
                x = x + down(F.relu(up(x)))
            return x

    def make_sharded(group):
        return Sequential(group), None, (2, DIM)

    def fails():
        raise FileNotFoundError("no checkpoint at /data/ckpt")

    def not_a_triple():
        return Net()

    def unsharded():
        return Net(), None, (1, 8, DIM)

    def bad_plan():
        return Net(), {{"blocks.9.qkv": ColwiseParallel()}}, (1, 8, DIM)
''')


@pytest.fixture(scope="module")
def factory(tmp_path_factory):
    """The factory file, written outside the repository (pytest's tmp directory)."""
    path = tmp_path_factory.mktemp("user") / "my_model.py"
    path.write_text(FACTORY.format(layers=3))
    return path


def inspect(capsys, *args) -> tuple[int, str, str]:
    code = cli.main(["-q", "inspect", *args])
    out = capsys.readouterr()
    return code, out.out, out.err


def test_factory_with_a_plan(factory, capsys, tmp_path):
    code, out, err = inspect(capsys, "--model", f"{factory}:make", "--tp", "4",
                             "--out", str(tmp_path))
    assert code == 0, err
    layers = 3
    assert f"  all_reduce launches  {2 * layers} -> {layers}  (lower bound {layers})\n" in out
    assert "  verdict              reached the lower bound\n" in out
    for i in range(layers):  # the user's own module names
        assert (f"    blocks.{i}.proj + blocks.{i}.down -> one all_reduce, summed  [") in out
    assert f"{factory}:make: make() -> Net" in out and "sharded by its plan" in out
    rep = json.loads((tmp_path / "report.json").read_text())
    assert rep["door"] == "factory" and rep["all_reduce"]["after"] == layers
    # one prediction per profile, the default model last and the one the rewrite used
    rows = rep["predicted_per_profile"]
    assert rows[-1]["source"] == "default" and rows[-1]["chose_the_rewrite"]
    measured = [r for r in rows if r["source"] != "default"]
    assert measured, "the repository's measured profiles are found from an editable install"
    # the default view: one predicted time, the model's that chose the rewrite, named
    assert len(out.splitlines()) <= 16 and "from the default model (uncalibrated" in out, out
    code, out, err = inspect(capsys, "--model", f"{factory}:make", "--tp", "4", "-v")
    for r in measured:  # -v: each labelled with where and how it was measured, its figures
        assert "by `fxcoalesce calibrate" in r["label"], r
        assert "/root/" not in r["label"], r  # no path of the machine it was measured on
        assert r["after_us"]["total"] < r["before_us"]["total"]
        assert f"    {r['name']}  " in out or f"    {r['name']} " in out
        assert f"    {r['name']}: {r['label']}\n" in out
    # the profiles were measured at 2 ranks and read at TP 4: said so
    assert "* measured at 2 ranks, read as is at TP 4" in out


def test_factory_that_shards_itself(factory, capsys):
    code, out, err = inspect(capsys, "--model", f"{factory}:make_sharded", "--tp", "2")
    assert code == 0, err
    assert "make_sharded(group) -> Sequential" in out and "sharded by itself" in out
    assert "  all_reduce launches  3 -> 3  (lower bound 3)\n" in out  # one chain
    assert "already at its bound" in out


def test_factory_with_your_profile(factory, capsys, tmp_path):
    profile = tmp_path / "p.json"
    profile.write_text(json.dumps({"backend": "nccl", "device": "cuda", "world_size": 4,
                                   "alpha_us": 100.0, "beta_us_per_byte": 0.0}))
    code, out, err = inspect(capsys, "--model", f"{factory}:make", "--tp", "4",
                             "--profile", str(profile))
    assert code == 0, err
    # 100 µs a call: 6 all_reduces before, 3 after, the rewrite chosen with it
    assert re.search(r"\n  predicted +600\.0 -> 300\.0 µs of all_reduce a step, [\d.]+ -> "
                     r"[\d.]+ not hidden by compute; from your profile \(4 nccl ranks, CUDA\), "
                     r"which chose the rewrite\n", out), out
    assert len(out.splitlines()) <= 15, out  # the default view; -v shows every profile


def test_the_token_split_has_its_own_row(capsys):
    """Full-size Llama-3-8B (4 layers) at 512 tokens on the P2P-off profile: the split's row
    gives what it runs in parts and the saving; its parts are not listed as merges."""
    from pathlib import Path

    profile = (Path(__file__).resolve().parents[1] / "benchmarks/results"
               / "gpu_h200x2_2026-11-30/calibrate_p2poff_overlap.json")
    code, out, err = inspect(capsys, "--model", "llama-3-8b", "--layers", "4", "--tp", "2",
                             "--tokens", "512", "--profile", str(profile))
    assert code == 0, err
    assert re.search(r"\n  token split +8 all_reduce\(s\) in 2 parts of the 512 tokens, each "
                     r"under the other part's compute: predicted -\d\.\d{3} ms a step\n", out), out
    assert "by design" in out and "above the bound" not in out and "what it merged" not in out
    assert len(out.splitlines()) <= 15, out


def tiny(*extra: str) -> list[str]:
    return ["--layers", "2", "--set", "hidden_size=128", "--set", "intermediate_size=256",
            "--set", "vocab_size=512", "--set", "num_attention_heads=4",
            "--set", "num_key_value_heads=4", *extra]


def test_hf_parallel_blocks(capsys):
    pytest.importorskip("transformers")
    code, out, err = inspect(capsys, "--hf", "cohere", "--tp", "4", *tiny())
    assert code == 0, err
    assert "CohereForCausalLM (CohereConfig, defaults of transformers" in out
    assert "--layers 2 --set hidden_size=128" in out.replace(", --set", " --set")
    # the embedding's all_reduce, then attention + MLP summed per layer
    assert "  all_reduce launches  5 -> 3  (lower bound 3)\n" in out
    for i in range(2):
        assert (f"model.layers.{i}.self_attn.o_proj + model.layers.{i}.mlp.down_proj -> one "
                "all_reduce, summed") in out


def test_hf_local_config_json(capsys, tmp_path):
    """A config.json as a user has one: DeepSeek-V3's routed and shared experts summed
    (transformers up to 5.24; from 5.25 its TP plan leaves the experts to EP and shards MLA
    attention: one chain, at its bound)."""
    transformers = pytest.importorskip("transformers")
    config = transformers.DeepseekV3Config(
        hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=4, vocab_size=128, moe_intermediate_size=32,
        first_k_dense_replace=1, n_routed_experts=4, num_experts_per_tok=2, n_group=1,
        topk_group=1, q_lora_rank=None, kv_lora_rank=16, qk_rope_head_dim=8,
        qk_nope_head_dim=8, v_head_dim=16)
    config.save_pretrained(tmp_path)
    code, out, err = inspect(capsys, "--hf", str(tmp_path / "config.json"), "--tp", "2")
    assert code == 0, err
    assert f"DeepseekV3Config, {tmp_path / 'config.json'}: 3 layers" in out
    if "layers.*.mlp.experts" in transformers.DeepseekV3Config.base_model_tp_plan:
        # embedding + the dense layer's MLP + (routed + shared) in each of the 2 MoE layers
        assert "  all_reduce launches  6 -> 4  (lower bound 4)\n" in out
        assert ("model.layers.1.mlp.experts + model.layers.1.mlp.shared_experts.down_proj -> "
                "one all_reduce, summed") in out
    else:  # embedding + attention and MLP (the shared experts) of each of the 3 layers
        assert "  all_reduce launches  7 -> 7  (lower bound 7)\n" in out
        assert "verdict              already at its bound" in out


BAD = [  # (arguments, the error line after "fxcoalesce inspect: error: ")
    (["--model", "{f}:fails"], "--model {f}:fails: the factory failed: FileNotFoundError: no "
     "checkpoint at /data/ckpt"),
    (["--model", "{f}:not_a_triple"], "--model {f}:not_a_triple: the factory returned Net; "
     "return (module, plan, input_shape)"),
    (["--model", "{f}:bad_plan"], "--model {f}:bad_plan: plan names 'blocks.9.qkv', which is "
     "no submodule of Net"),
    (["--model", "{f}:unsharded"], "{f}:unsharded: its step issues no all_reduce, so "
     "fxcoalesce has nothing to merge: its sharding sums nothing over the ranks"),
    (["--model", "{f}:make", "--tp", "1"], "{f}:make: its step issues no all_reduce, so "
     "fxcoalesce has nothing to merge: at TP 1 nothing is sharded (give --tp N)"),
    (["--model", "{f}:nothing"], "--model {f}:nothing: {f} has no 'nothing'"),
    (["--model", "{d}/missing.py:make"], "--model {d}/missing.py:make: {d}/missing.py: no such "
     "file"),
    (["--model", "no_such_package.models:make"], "--model no_such_package.models:make: no module "
     "named 'no_such_package' (a zoo model's name has no ':'; a factory is "
     "'package.module:function' importable from here, or 'path/to/file.py:function')"),
    (["--model", "{f}:make", "--layers", "2"], "--layers: not for a factory (zoo models and "
     "--hf)"),
    (["--model", "neox-tiny", "--hf", "llama"], "--model and --hf name two models; give one"),
    (["--hf", "llama", "--step", "verify"], "--step verify: not for a Hugging Face config (zoo "
     "models only)"),
    (["--hf", "llama3"], "--hf llama3: transformers {tv} knows no model type 'llama3'; close: "
     "llama, mllama, llama4"),
    (["--hf", "qwen3_moe", "--tp", "8"], "--hf qwen3_moe: tensor parallelism 8 does not divide "
     "the key/value heads (4); choose a TP degree that divides 4"),
    (["--hf", "bert", "--tp", "2"], "--hf bert: BertConfig has no tensor-parallel plan "
     "(base_model_tp_plan), so tp_plan='auto' cannot shard it"),
    (["--hf", "llama", "--set", "hidden_sise=64"], "--hf llama: LlamaConfig has no field "
     "'hidden_sise'; did you mean 'hidden_size'?"),
    (["--hf", "llama", "--set", "64"], "--set 64: give KEY=VALUE, e.g. --set hidden_size=4096"),
    (["--hf", "{d}/nothing.json"], "--hf {d}/nothing.json: no such file"),
    (["--model", "neox-tiny", "--tp", "4", "--profile", "{d}/p2.json"], "--profile "
     "{d}/p2.json was measured at world size 2, but inspect traces --tp 4; calibrate with "
     "--tp 4, or inspect --tp 2"),
]


@pytest.mark.parametrize("args, message", BAD, ids=[" ".join(a) for a, _ in BAD])
def test_bad_input_is_one_line(factory, capsys, args, message):
    if any(a.startswith("--hf") for a in args):
        pytest.importorskip("transformers")
    import transformers

    d = factory.parent
    (d / "p2.json").write_text(json.dumps({"backend": "gloo", "device": "cpu", "world_size": 2,
                                           "alpha_us": 1.0, "beta_us_per_byte": 0.0}))
    fill = dict(f=factory, d=d, tv=transformers.__version__)
    code, out, err = inspect(capsys, *(a.format(**fill) for a in args))
    assert code == 2
    assert err.splitlines()[-1:] == [f"fxcoalesce inspect: error: {message.format(**fill)}"]
    assert out == ""


def expected_counts(model: str) -> tuple[int, int]:
    """(before, after) all_reduces of a full-size config: the embedding's, then per layer
    attention + MLP summed (Cohere), or the dense layers' MLP and each MoE layer's routed +
    shared experts summed (DeepSeek-V3 up to transformers 5.24, whose plan does not shard
    attention; from 5.25 attention and the MLP of every layer, in one chain)."""
    import transformers

    config = transformers.AutoConfig.for_model(model)
    layers = config.num_hidden_layers
    if model == "cohere":
        return 1 + 2 * layers, 1 + layers
    if "layers.*.mlp.experts" not in config.base_model_tp_plan:  # transformers >= 5.25:
        return 1 + 2 * layers, 1 + 2 * layers  # attention and MLP sharded, experts to EP
    dense = config.first_k_dense_replace
    return 1 + dense + 2 * (layers - dense), 1 + layers


@pytest.mark.slow
@pytest.mark.parametrize("model", ["cohere", "deepseek_v3"])
def test_full_size_hf_composed(model, tmp_path):
    """The issue's bar: full size, TP 8, counts, bound, verdict and every profile, from one
    layer of each kind (DeepSeek-V3: the first, a dense one, a MoE one, the last; Cohere:
    the first, one between, the last), equal to tracing every layer (``--all-layers``, for
    DeepSeek-V3 2 minutes and more here; benchmarks/NOTES.md has the times)."""
    import subprocess
    import sys

    pytest.importorskip("transformers")
    before, after = expected_counts(model)
    reports = {}
    for how in ("composed", "all"):
        out = tmp_path / how
        proc = subprocess.run([sys.executable, "-m", "fxcoalesce.apps.cli", "inspect", "--hf",
                               model, "--tp", "8", "--out", str(out)]
                              + (["--all-layers"] if how == "all" else []),
                              capture_output=True, text=True, timeout=900)
        assert proc.returncode == 0, proc.stderr
        assert (f"  all_reduce launches  {before} -> {after}  (lower bound {after})\n"
                in proc.stdout)
        assert "2 x H200, NVLink" in proc.stdout and "default model" in proc.stdout
        reports[how] = json.loads((out / "report.json").read_text())
    layers = {"cohere": "3 of 40", "deepseek_v3": "4 of 61"}[model]
    assert reports["composed"]["composed"]["text"].startswith(f"traced {layers} layers")
    for key in ("all_reduce", "nodes", "chains", "other_collectives", "verdict"):
        assert reports["composed"][key] == reports["all"][key], key
