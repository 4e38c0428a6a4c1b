"""A Hugging Face architecture for ``inspect --hf NAME`` (a model type: ``cohere``,
``deepseek_v3``, ``gpt_neox``, ``llama``, ``qwen3_moe``, ...) or ``--hf path/config.json``:
transformers' own config class and model code, sharded by the model's own tensor-parallel
plan the way ``from_pretrained(path, distributed_config=DistributedConfig(tp_plan="auto"))``
shards it, at full size and without weights.

    config = hf_config("cohere", layers=None, overrides=())   # CohereConfig's defaults
    check_heads(config, tp=8)                                  # before any build
    built = build_hf(config, tp=8, tokens=3)                   # fake tensors, a fake group

Sizes: a model type's config class defaults (transformers' own, e.g. CohereConfig: 40
layers, hidden 8192, the 35B Command-R), or the ``config.json`` as written; ``--layers``
and ``--set KEY=VALUE`` override fields. The model is built the way ``from_pretrained``
builds it (its init context, weights untied until sharded), but under ``FakeTensorMode``
instead of the meta device, so every parameter is a fake tensor (shapes, no memory); then
``prepare_distribute_model`` / ``maybe_distribute_model`` apply the resolved TP plan on a
device mesh of the fake group, as loading does before it reads any weight.
"""

from __future__ import annotations

import contextlib
import difflib
import json
import math
import warnings
from pathlib import Path

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from fxcoalesce.apps.defaults import parameters_text
from fxcoalesce.apps.inspect.built import Built, first_line, parameter_count
from fxcoalesce.config import did_you_mean

KEY_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "qkv_proj", "query_key_value", "c_attn",
                   "Wqkv", "W_pack")
"""A column-parallel module of one of these names shards attention by head."""


def _transformers():
    try:
        import transformers
    except ImportError:
        raise ValueError("--hf needs transformers: pip install 'fxcoalesce[hf]'") from None
    from transformers import PreTrainedModel

    if not hasattr(PreTrainedModel, "maybe_distribute_model"):
        raise ValueError(f"--hf needs transformers' DistributedConfig tensor-parallel loading "
                         f"(transformers {transformers.__version__} has none): pip install "
                         "'fxcoalesce[hf]'")
    return transformers


def _value(text: str):
    """``--set`` values: JSON (numbers, true/false/null, lists), else the text itself."""
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def parse_overrides(pairs) -> dict:
    """``["num_hidden_layers=4", "hidden_size=1024"]`` -> {...}; ValueError naming the bad one."""
    out = {}
    for pair in pairs:
        key, eq, value = pair.partition("=")
        if not eq or not key.strip().isidentifier():
            raise ValueError(f"--set {pair}: give KEY=VALUE, e.g. --set hidden_size=4096")
        out[key.strip()] = _value(value.strip())
    return out


def _config_file(name: str) -> Path | None:
    path = Path(name)
    if path.is_dir():
        return path / "config.json"
    if path.suffix == ".json" or path.exists() or "/" in name:
        return path
    return None


def _unknown_type(model_type: str, transformers, where: str) -> ValueError:
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    # model types only: the mapping also holds a class name or two ("EvollaModel" in 5.25)
    types = [t for t in CONFIG_MAPPING_NAMES if t == t.lower()]
    close = difflib.get_close_matches(model_type.replace("-", "_").lower(), types, n=3)
    hint = f"; close: {', '.join(close)}" if close else ""
    return ValueError(f"--hf {where}: transformers {transformers.__version__} knows no model "
                      f"type {model_type!r}{hint}")


def _fields_per_layer(data: dict, layers: int) -> dict:
    """``data`` for ``layers`` layers: lists with one entry per layer (``layer_types``, ...)
    cut to the first ``layers``; ValueError when a config with such lists is made deeper."""
    depth = data.get("num_hidden_layers")
    if depth is None or layers == depth:
        return {**data, "num_hidden_layers": layers}
    per_layer = [k for k, v in data.items() if isinstance(v, list) and len(v) == depth]
    if layers > depth and per_layer:
        raise ValueError(f"--layers {layers}: the config has {depth} layers and per-layer "
                         f"fields ({', '.join(per_layer)}); it can be made shallower, not deeper")
    return {**data, "num_hidden_layers": layers, **{k: data[k][:layers] for k in per_layer}}


def hf_config(name: str, *, layers: int | None = None, overrides: dict | None = None):
    """transformers' config for model type ``name`` (its class defaults) or for the
    ``config.json`` at ``name`` (a file, or a directory holding one), with ``layers`` and
    ``overrides`` applied; ValueError (one line) for what cannot be had."""
    transformers = _transformers()
    from transformers import AutoConfig, CONFIG_MAPPING

    overrides = dict(overrides or {})
    file = _config_file(name)
    if file is not None:
        if not file.is_file():
            missing = "no config.json in it" if Path(name).is_dir() else "no such file"
            raise ValueError(f"--hf {name}: {missing}")
        try:
            data = json.loads(file.read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ValueError(f"--hf {name}: not a readable JSON config ({first_line(e)})") \
                from None
        model_type = data.get("model_type") if isinstance(data, dict) else None
        if not model_type:
            raise ValueError(f"--hf {name}: the config has no 'model_type'")
        if model_type not in CONFIG_MAPPING:
            raise _unknown_type(model_type, transformers, name)
        cls = CONFIG_MAPPING[model_type]
        if layers is not None:
            data = _fields_per_layer(data, layers)
        _check_fields(cls, overrides, name)
        try:
            return cls.from_dict({**data, **overrides})
        except Exception as e:
            raise ValueError(f"--hf {name}: {cls.__name__} refuses it: {first_line(e)}") \
                from None
    model_type = name if name in CONFIG_MAPPING else name.replace("-", "_")
    if model_type not in CONFIG_MAPPING:
        raise _unknown_type(name, transformers, name)
    cls = CONFIG_MAPPING[model_type]
    if layers is not None:
        overrides["num_hidden_layers"] = layers
    _check_fields(cls, overrides, name)
    try:
        return AutoConfig.for_model(model_type, **overrides)
    except Exception as e:
        raise ValueError(f"--hf {name}: {cls.__name__} refuses {overrides}: {first_line(e)}") \
            from None


def _check_fields(cls, overrides: dict, name: str) -> None:
    """Every override names a field the config class has (it would take any keyword)."""
    defaults = cls()
    unknown = [k for k in overrides if not hasattr(defaults, k)]
    if unknown:
        hint = did_you_mean(unknown[0], defaults.to_dict())
        raise ValueError(f"--hf {name}: {cls.__name__} has no field {unknown[0]!r}"
                         + (f"; {hint}" if hint else ""))


def causal_lm_class(config):
    """The ``*ForCausalLM`` class of ``config``; ValueError when it has none."""
    from transformers import MODEL_FOR_CAUSAL_LM_MAPPING

    try:
        return MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]
    except KeyError:
        raise ValueError(f"--hf {config.model_type}: transformers has no causal LM for it "
                         "(inspect traces a causal LM's forward)") from None


def tp_plan(config) -> dict[str, str]:
    """The model's tensor-parallel plan as written (``base_model_tp_plan``, layer wildcards)."""
    return dict(getattr(config.get_text_config(), "base_model_tp_plan", None) or {})


def check_heads(config, tp: int) -> None:
    """``tp`` ranks can shard ``config``'s plan: a plan that shards attention by head needs a
    TP degree that divides the attention and key/value heads; a config without a plan
    cannot be sharded at all (``tp_plan="auto"`` refuses it)."""
    plan = tp_plan(config)
    name = config.model_type
    if tp > 1 and not plan:
        raise ValueError(f"--hf {name}: {type(config).__name__} has no tensor-parallel plan "
                         "(base_model_tp_plan), so tp_plan='auto' cannot shard it")
    by_head = any(k.rsplit(".", 1)[-1] in KEY_PROJECTIONS and v.startswith("colwise")
                  for k, v in plan.items())
    if tp < 2 or not by_head:
        return
    text = config.get_text_config()
    heads = text.num_attention_heads
    kv = getattr(text, "num_key_value_heads", None) or heads
    for what, n in (("attention heads", heads), ("key/value heads", kv)):
        if n % tp:
            raise ValueError(f"--hf {name}: tensor parallelism {tp} does not divide the {what} "
                             f"({n}); choose a TP degree that divides {math.gcd(heads, kv)}")


def source(name: str, layers: int | None, sets: list[str]) -> str:
    """Where an ``--hf`` config's sizes come from (its class defaults, or the file) and what
    the command line changed: 'defaults of transformers 5.24.0, --layers 4'."""
    import transformers

    changed = ([f"--layers {layers}"] if layers is not None else []) + [f"--set {s}"
                                                                       for s in sets]
    base = (name if _config_file(name) is not None
            else f"defaults of transformers {transformers.__version__}")
    return ", ".join([base, *changed])


def describe(config, source: str) -> str:
    """'40 layers, hidden 8192, 64 heads / 64 KV heads, vocab 256000' (and experts)."""
    text = config.get_text_config()
    get = lambda *keys: next((getattr(text, k) for k in keys  # noqa: E731
                              if getattr(text, k, None) is not None), None)
    heads = get("num_attention_heads")
    parts = [f"{get('num_hidden_layers')} layers", f"hidden {get('hidden_size')}",
             f"{heads} heads / {get('num_key_value_heads') or heads} KV heads",
             f"vocab {get('vocab_size')}"]
    if experts := get("n_routed_experts", "num_experts", "num_local_experts"):
        parts.append(f"{experts} experts, {get('num_experts_per_tok')} active")
    return f"{type(config).__name__}, {source}: {', '.join(parts)}"


def build_hf(config, tp: int, tokens: int, *, source: str = "") -> Built:
    """``config``'s causal LM in bf16 under fake tensors, sharded over the fake default group
    (``tp`` ranks) by transformers' own TP machinery; the step is a forward over ``tokens``
    tokens (``use_cache=False``) returning the logits."""
    transformers = _transformers()
    from transformers.distributed import DistributedConfig

    cls = causal_lm_class(config)
    dtype = torch.bfloat16
    config.dtype = dtype
    transformers.logging.set_verbosity_error()  # its rank-0 notes are not inspect's output
    dist_config, _, meshes = cls.prepare_distribute_model(
        DistributedConfig(tp_size=tp, tp_plan="auto") if tp > 1 else None)
    # from_pretrained's own init context, less its meta device: fake tensors take its place
    contexts = [c for c in cls.get_init_context(dtype, False, False, None)
                if not isinstance(c, torch.device)]
    mode = FakeTensorMode()
    try:
        with mode, warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            with contextlib.ExitStack() as stack:
                for c in contexts:
                    stack.enter_context(c)
                model = cls(config)
            params = parameter_count(model)
            model = cls.maybe_distribute_model(model, dist_config, meshes)
            model.tie_weights()
            model.eval()
            ids = torch.zeros(1, tokens, dtype=torch.long)
    except Exception as e:
        raise ValueError(f"--hf {config.model_type}: building or sharding {cls.__name__} "
                         f"failed: {first_line(e)}") from None

    def logits(input_ids):
        return model(input_ids=input_ids, use_cache=False).logits

    sharding = ("its base_model_tp_plan, as from_pretrained(distributed_config="
                "DistributedConfig(tp_plan='auto')) does") if tp > 1 else "none (TP 1)"
    what = (f"{cls.__name__} ({describe(config, source)}): {parameters_text(params)} "
            "parameters, "
            f"bf16, sharded by {sharding}; forward over {tokens} tokens")
    return Built(fn=logits, args=(ids,), mode=mode, what=what, parameters=params, model=model)
