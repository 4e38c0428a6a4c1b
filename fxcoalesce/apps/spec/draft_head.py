"""A trained EAGLE-3 draft head on disk: safetensors shards of at most 15 MiB, an HF-style
index, and ``config.json`` naming the target it was trained for.

    head/config.json                         target, vocabularies, capture layers, training stats
    head/model.safetensors.index.json        {"metadata": {"total_size"}, "weight_map": {...}}
    head/model-00001-of-00002.safetensors    ...

The draft's input embedding is the target's (frozen): it is not saved, ``load_head`` takes it
from the target's weights.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from fxcoalesce.models.eagle3 import DraftArgs, Eagle3Draft

FORMAT = "fxcoalesce-eagle3-head"
SHARD_BYTES = 15 << 20
INDEX = "model.safetensors.index.json"
DEFAULT_HEAD = Path(__file__).resolve().parents[3] / "heads" / "smollm2-135m"
"""The head committed with the repository (found from an editable install)."""


def head_path(given: str | None) -> Path:
    """``--draft``, else the repository's head; ValueError naming what to do when neither."""
    path = Path(given) if given else DEFAULT_HEAD
    if not path.is_dir():
        kind = "a file, not a head directory" if path.exists() else "no such directory"
        raise ValueError(f"--draft {path}: {kind}" if given else
                         f"no draft head at {DEFAULT_HEAD}: pass --draft DIR (fxcoalesce "
                         f"train-draft --target {DEFAULT_HEAD.name} --out DIR trains one)")
    return path


def head_tensors(draft: Eagle3Draft, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """What is saved: every parameter and buffer but the (target's) embedding."""
    return {name: (t.to(dtype) if t.is_floating_point() else t).detach().cpu().contiguous()
            for name, t in draft.state_dict().items() if name != "embed.weight"}


def save_head(draft: Eagle3Draft, out: Path, config: dict, dtype=torch.bfloat16) -> list[Path]:
    """Write ``draft`` to directory ``out`` (replacing a previous head there, file by file
    through renames, so a reader never sees half a shard); returns the files written."""
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    tensors = head_tensors(draft, dtype)
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, t in tensors.items():
        nbytes = t.numel() * t.element_size()
        if nbytes > SHARD_BYTES:
            raise ValueError(f"{name} ({nbytes} bytes) does not fit a {SHARD_BYTES}-byte shard")
        if size + nbytes > SHARD_BYTES:
            shards.append({})
            size = 0
        shards[-1][name] = t
        size += nbytes
    files, weight_map = [], {}
    for i, shard in enumerate(shards, 1):
        name = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, out / f".{name}.tmp")
        files.append(out / name)
        weight_map |= dict.fromkeys(shard, name)
    index = {"metadata": {"total_size": sum(t.numel() * t.element_size()
                                            for t in tensors.values())},
             "weight_map": weight_map}
    meta = {"format": FORMAT, "dtype": str(dtype).removeprefix("torch."),
            "draft": {f: getattr(draft.args, f) for f in DraftArgs.__dataclass_fields__}} | config
    for path, text in ((out / INDEX, json.dumps(index, indent=1)),
                       (out / "config.json", json.dumps(meta, indent=1))):
        path.with_name(f".{path.name}.tmp").write_text(text)
        files.append(path)
    for path in files:
        os.replace(path.with_name(f".{path.name}.tmp"), path)
        path.chmod(0o644)
    for stale in set(out.glob("model-*.safetensors")) - set(files):
        stale.unlink()
    return files


def read_config(path: Path) -> dict:
    config = path / "config.json"
    if not config.is_file():
        raise ValueError(f"draft head {path}: no config.json (a head is a directory written "
                         "by fxcoalesce train-draft)")
    meta = json.loads(config.read_text())
    if meta.get("format") != FORMAT:
        raise ValueError(f"draft head {path}: config.json is not an {FORMAT} config")
    return meta


def check_compatible(meta: dict, path: Path, target_name: str, target_args) -> None:
    """The head was trained for this target: same name, vocabulary, width, capture layers."""
    want = {"target": target_name, "target_vocab": target_args.vocab,
            "target_dim": target_args.dim, "capture_layers": list(target_args.capture_layers)}
    wrong = [f"{k} {meta.get(k)!r} (this target: {v!r})" for k, v in want.items()
             if meta.get(k) != v]
    if wrong:
        raise ValueError(f"draft head {path} was trained for another target: "
                         + "; ".join(wrong))


def load_head(path: str | Path, *, target_name: str, target_args, embed_weight: torch.Tensor,
              device=None, dtype: torch.dtype = torch.float32) -> tuple[Eagle3Draft, dict]:
    """The draft head at ``path`` for the target ``target_name`` (``target_args``: its
    LlamaArgs; ``embed_weight`` [V, H]: its full, unsharded embedding) -> (draft, config)."""
    from safetensors.torch import load_file

    path = Path(path)
    meta = read_config(path)
    check_compatible(meta, path, target_name, target_args)
    args = DraftArgs(**meta["draft"])
    index = json.loads((path / INDEX).read_text())
    tensors: dict[str, torch.Tensor] = {}
    for name in sorted(set(index["weight_map"].values())):
        if not (path / name).is_file():
            raise ValueError(f"draft head {path}: shard {name} is missing")
        tensors |= load_file(path / name)
    if "d2t" not in tensors:
        raise ValueError(f"draft head {path}: no d2t (draft -> target vocabulary map)")
    draft = Eagle3Draft(args, tensors["d2t"])  # checks d2t
    tensors["embed.weight"] = embed_weight
    try:
        draft.load_state_dict({k: v.to(dtype) if v.is_floating_point() else v
                               for k, v in tensors.items()}, assign=True)
    except RuntimeError as e:
        raise ValueError(f"draft head {path} does not match its config: "
                         f"{str(e).splitlines()[-1].strip()}") from None
    draft.embed.weight.requires_grad_(False)
    return draft.to(device).eval(), meta

