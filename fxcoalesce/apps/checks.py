"""Checks of each subcommand's arguments, run right after parsing and before any trace,
model build or spawned rank: a mistake costs a second and one line, not a traceback from
inside a rank minutes later.

Each ``check_<command>(args)`` raises ``ValueError`` naming the mistake; the CLI prints it as
``fxcoalesce <command>: error: ...`` and exits 2. They read the model registry (names, sizes)
and ask torch how many GPUs it sees, but build nothing.
"""

from __future__ import annotations

import math
import os
import re
import tempfile
from pathlib import Path

from fxcoalesce.apps.defaults import DEFAULT_PROMPT, MERGE_MODEL, PRETRAINED
from fxcoalesce.apps.defaults import parameters_text
from fxcoalesce.apps.defaults import backend_of as _backend
from fxcoalesce.config import Config


def _at_least(minimum: int, why: str = "", **options: int) -> None:
    """Each ``--option`` (given by keyword) must be >= ``minimum``; ``why`` is added to the
    message when the reason is not obvious."""
    for name, value in options.items():
        if value < minimum:
            raise ValueError(f"--{name.replace('_', '-')} must be at least {minimum}, "
                             f"not {value}{f' ({why})' if why else ''}")


def _positive(unit: str = "", **options: float) -> None:
    """Each ``--option`` (given by keyword) must be a finite number > 0 (``unit`` follows the
    0 in the message)."""
    for name, value in options.items():
        option = f"--{name.replace('_', '-')}"
        if not value > 0:
            raise ValueError(f"{option} must be > 0{unit}, not {value}")
        if not math.isfinite(value):
            raise ValueError(f"{option} must be finite, not {value}")


def _model(name: str, tp: int, step: str) -> None:
    """``name`` is known, ``tp`` ranks can shard it (its ``apply_tp`` rules) and it has ``step``."""
    from fxcoalesce import models

    from fxcoalesce.apps.steps import steps_for

    models.family_of(name)  # "unknown model ...; choose one of: ..."
    if step not in steps_for(name):
        cached = [m for m in models.model_names() if step in steps_for(m)]
        raise ValueError(f"{name} has no {step!r} step (it needs a KV-cached model: "
                         f"{', '.join(cached)})")
    try:
        models.check_tp(name, tp)
    except ValueError as e:
        raise ValueError(f"{name}: {e}") from None


def _gpus(device: str, backend: str | None, tp: int, *, gloo_may_share: bool = False) -> None:
    """``--device cuda`` needs CUDA; ``--backend nccl`` needs CUDA tensors and a GPU per rank
    (``gloo_may_share``: the command runs gloo ranks on shared GPUs, as calibrate does)."""
    import torch

    cuda = torch.cuda.is_available()
    if device == "cuda" and not cuda:
        raise ValueError("--device cuda: torch sees no CUDA GPU (use --device cpu)")
    if backend != "nccl":
        return
    if not cuda:
        raise ValueError("--backend nccl: torch sees no CUDA GPU, and NCCL needs one per rank "
                         "(use --backend gloo)")
    if device != "cuda":
        raise ValueError("--backend nccl needs --device cuda (NCCL reduces GPU tensors only)")
    if (gpus := torch.cuda.device_count()) < tp:
        fewer = "use --backend gloo to share them" if gloo_may_share else f"use --tp {gpus}"
        raise ValueError(f"--backend nccl needs a GPU per rank: --tp {tp}, but torch sees "
                         f"{gpus} ({fewer})")


def _no_gloo_on_cuda(device: str, backend: str, tp: int, given: bool) -> None:
    """Model runs on CUDA need NCCL: every model's output head all_gathers its logits with
    ``funcol.all_gather_tensor`` (``models/tp.py``, ``all_gather_last_dim``), and over gloo
    that kills the ranks with SIGSEGV for CUDA tensors (torch 2.11, 2 ranks on one H200;
    ``dist.all_gather_into_tensor`` and host-staged tensors ran). calibrate, which only
    all_reduces, may run gloo on CUDA."""
    import torch

    if device != "cuda" or backend != "gloo" or tp < 2:
        return
    gpus = torch.cuda.device_count()
    why = ("gloo's functional all_gather of CUDA tensors, which the model's output head "
           "issues, kills the ranks with SIGSEGV (torch 2.11)")
    if given:
        raise ValueError(f"--backend gloo with --device cuda: {why}; use --backend nccl with "
                         f"a GPU per rank (torch sees {gpus}), or --device cpu")
    raise ValueError(f"--device cuda --tp {tp} on {gpus} GPU{'s' * (gpus != 1)} means gloo "
                     f"ranks (NCCL needs a GPU per rank), but {why}; use --tp {max(gpus, 1)} "
                     "or --device cpu")


def _unwritable(path: Path) -> str | None:
    """Why the directory ``path`` cannot be made or written into, None when it can: a file
    where a directory should be, or the nearest existing directory takes no new entries."""
    existing = next(p for p in (path, *path.parents) if p.exists())
    if not existing.is_dir():
        return f"{existing} is a file, not a directory"
    try:  # a probe, not os.access: root passes permission bits, not /proc or a read-only mount
        os.rmdir(tempfile.mkdtemp(prefix=".fxcoalesce-probe-", dir=existing))
    except OSError as e:
        return f"cannot write into {existing} ({e.strerror})"
    return None


def _no_file_above(out: str, path: Path) -> None:
    """The directories up to ``path`` exist or can be made, and can be written into."""
    if why := _unwritable(path):
        raise ValueError(f"--out {out}: {why}")


def _not_empty(out: str, what: str) -> None:
    """``--out ""`` names nothing (it used to make inspect write nothing, silently)."""
    if not out:
        raise ValueError(f"--out is empty; give {what}")


def _can_make_dir(out: str, command: str = "inspect",
                  files: str = "report.json, before.txt, after.txt") -> None:
    """``out`` is a directory or can become one (``command`` writes ``files`` into it)."""
    _not_empty(out, f"a directory ({command} writes {files} into it)")
    if Path(out).is_file():
        raise ValueError(f"--out {out} is a file; {command} writes a directory ({files})")
    _no_file_above(out, Path(out))


def _can_write_file(out: str, command: str = "bench") -> None:
    """``out`` can be written as a file (bench and calibrate write one JSON file)."""
    _not_empty(out, f"a file ({command} writes one JSON file)")
    if Path(out).is_dir():
        raise ValueError(f"--out {out} is a directory; {command} writes one JSON file")
    _no_file_above(out, Path(out).parent)


def _drawings(args) -> None:
    """What ``--format``, ``--timeline`` and ``--trace`` write needs ``--out`` and a renderer."""
    from fxcoalesce.viz.draw import NEEDS_A_RENDERER, NEEDS_MATPLOTLIB, has_matplotlib, renderer

    wants = [(args.format in ("svg", "png"), f"--format {args.format}",
              f"collectives.{args.format}"),
             (args.timeline, "--timeline", "timeline.png"),
             (bool(args.trace), "--trace", "trace_timeline.png")]
    for wanted, option, name in wants:
        if wanted and not args.out:
            raise ValueError(f"{option} writes {name}: give --out DIR")
    if args.format in ("svg", "png") and renderer() is None:
        raise ValueError(NEEDS_A_RENDERER.format(fmt=args.format))
    for wanted, option, _ in wants[1:]:
        if wanted and not has_matplotlib():
            raise ValueError(NEEDS_MATPLOTLIB.format(what=option))
    if args.trace and not Path(args.trace).is_file():
        kind = "a directory, not a trace file" if Path(args.trace).is_dir() else "no such file"
        raise ValueError(f"--trace {args.trace}: {kind}")


def _only_for(args, door: str) -> None:
    """Options that only one front door of inspect takes (zoo, factory, hf)."""
    zoo_only = [("--step verify", args.step != "forward"), ("--hand-merged", args.hand_merged)]
    given = [o for o, on in zoo_only if on] if door != "zoo" else []
    if door == "factory":
        given += [o for o, on in (("--layers", args.layers is not None),
                                  ("--tokens", args.tokens is not None)) if on]
    if door != "hf" and args.set:
        given.append("--set")
    if given:
        what = {"zoo": "a zoo model", "factory": "a factory",
                "hf": "a Hugging Face config"}[door]
        takes = {"--set": "--hf only", "--layers": "zoo models and --hf",
                 "--tokens": "zoo models and --hf; a factory's input shape sets it"}
        raise ValueError(f"{given[0]}: not for {what} ({takes.get(given[0], 'zoo models only')})")


def _profile(args) -> None:
    """``--profile`` (else ``$FXCOALESCE_PROFILE``) reads, and was measured at ``--tp`` ranks:
    the rewrite is chosen with it, as the backend would on that job."""
    from fxcoalesce.config import CostModel, ProfileError

    named = args.profile or os.environ.get("FXCOALESCE_PROFILE") or None
    option = "--profile" if args.profile else "FXCOALESCE_PROFILE"
    if named is None:
        return
    try:
        world = CostModel.from_profile(named).profile.world_size
    except ProfileError as e:
        raise ValueError(f"{option}: {e}") from None
    if world != args.tp:
        raise ValueError(f"{option} {named} was measured at world size {world}, but inspect "
                         f"traces --tp {args.tp}; calibrate with --tp {args.tp}, or inspect "
                         f"--tp {world}")
    args.profile = named


def check_inspect(args) -> None:
    from fxcoalesce.apps.inspect.command import door as door_of

    if args.list:
        return
    if args.model and args.hf:
        raise ValueError("--model and --hf name two models; give one")
    if not args.model and not args.hf and not args.trace:
        raise ValueError("--model or --hf is required (--list names the zoo's models)")
    door = door_of(args) if args.model or args.hf else None
    if door:
        _only_for(args, door)
        if door != "factory" and args.tokens is None:
            args.tokens = 3
        _at_least(1, tp=args.tp)
        if args.tokens is not None:
            _at_least(1, tokens=args.tokens)
        if args.layers is not None:
            _at_least(1, layers=args.layers)
        try:
            Config(bucket_cap_mb=args.bucket_cap_mb)
        except ValueError as e:
            raise ValueError(f"--bucket-cap-mb: {e}") from None
    if args.out is not None:
        _can_make_dir(args.out)
    if args.format != "txt" or args.timeline or args.trace:
        _drawings(args)
    if door == "zoo":
        _model(args.model, args.tp, args.step)
        if args.hand_merged:
            _hand_merged(args.model)
    elif door == "factory":
        from fxcoalesce.apps.inspect.factory import load_factory

        load_factory(args.model)  # imports it: a missing module or function is one line now
    elif door == "hf":
        from fxcoalesce.apps.inspect.hf import check_heads, hf_config, parse_overrides, source

        overrides = parse_overrides(args.set)
        args.hf_config = hf_config(args.hf, layers=args.layers, overrides=overrides)
        args.hf_source = source(args.hf, args.layers, args.set)
        check_heads(args.hf_config, args.tp)
    if door:
        _profile(args)



GiB = 1 << 30
RANKS_PER_CORE = 4
"""Most CPU ranks per core a run may start: each rank is a process that takes part in every
collective, and more than this leaves them waiting on each other (DESIGN.md: 8 gloo ranks
on 2 cores took ~21 ms per small all_reduce)."""


def _layers(name: str, layers: int | None) -> None:
    """``--layers`` makes a valid model (MoE models need at least 3 and their dense layers)."""
    from fxcoalesce import models

    try:
        models.args_of(name, layers)
    except ValueError as e:
        raise ValueError(f"--layers {layers}: {name}: {e}") from None


def _mem_available() -> int | None:
    """Bytes of memory the system can give new processes (Linux), None when unknown."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _fits(name: str, layers: int | None, tp: int, device: str) -> None:
    """The model fits where its ranks build it: each rank builds the whole model (bf16 on
    CUDA, fp32 on CPU) before keeping its 1/tp share, so the peak is the whole model per rank
    (CPU ranks share the memory and build at the same time; on CUDA each rank has a GPU of its
    own, as gloo on CUDA is refused), plus a margin."""
    import torch

    from fxcoalesce import models

    params = models.parameter_count(name, layers)
    whole = params * (2 if device == "cuda" else 4)
    what = (f"{name}{f' at --layers {layers}' if layers else ''}: {parameters_text(params)} "
            f"parameters, {whole / GiB:.1f} GiB in {'bf16' if device == 'cuda' else 'fp32'}; "
            f"each rank builds the whole model before keeping 1/{tp} of it, so ")
    if device == "cuda":
        need = whole * 1.1 + 2 * GiB  # + CUDA context, workspace, activations
        free = min(torch.cuda.mem_get_info(i)[0]
                   for i in range(min(tp, torch.cuda.device_count())))
        where = "each GPU (1 rank) needs"
    else:
        need, free = tp * whole * 1.1 + GiB, _mem_available()
        where = f"{tp} ranks need"
    if free is not None and need > free:
        raise ValueError(f"{what}{where} about {need / GiB:.1f} GiB but {free / GiB:.1f} GiB "
                         "is free (use fewer --layers)")


def _hostable(tp: int, device: str) -> None:
    """CPU ranks: at most RANKS_PER_CORE per core."""
    cores = os.cpu_count() or 1
    if device == "cpu" and tp > RANKS_PER_CORE * cores:
        raise ValueError(f"--tp {tp}: {tp} CPU ranks on {cores} core{'s' * (cores > 1)}; "
                         f"this machine hosts at most {RANKS_PER_CORE * cores} "
                         f"({RANKS_PER_CORE} per core)")


def check_bench(args) -> None:
    from fxcoalesce.apps.bench.variants import parse_variants

    _at_least(1, tp=args.tp, steps=args.steps)
    for tokens in args.tokens:
        _at_least(1, tokens=tokens)
    _at_least(0, warmup=args.warmup)
    if args.calls_per_sample is not None:
        _at_least(1, calls_per_sample=args.calls_per_sample)
    if args.layers is not None:
        _at_least(1, layers=args.layers)
    parse_variants(args.variants)
    if args.out is not None:
        _can_make_dir(args.out, "bench", "bench.json, bench.md, bench.png")
    if args.trace and not args.out:
        raise ValueError("--trace needs --out DIR (the traces are written there)")
    if args.cudagraphs and args.device != "cuda":
        raise ValueError("--cudagraphs needs --device cuda (CUDA graphs capture GPU work)")
    if args.nccl_mode and _backend(args) != "nccl":
        raise ValueError(f"--nccl-mode {args.nccl_mode} needs --backend nccl (it chooses how "
                         "NCCL moves data)")
    _model(args.model, args.tp, "forward")  # a dense model's verify step is its forward
    if args.layers is not None:
        _layers(args.model, args.layers)
    _gpus(args.device, args.backend, args.tp)
    _no_gloo_on_cuda(args.device, _backend(args), args.tp, args.backend is not None)
    _hostable(args.tp, args.device)
    _fits(args.model, args.layers, args.tp, args.device)


def _hand_merged(name: str) -> None:
    """``--hand-merged`` needs a model with hand-merged code (bench skips the variant instead)."""
    from fxcoalesce import models

    from fxcoalesce.apps.bench.variants import has_hand_merged

    if not has_hand_merged(name):
        having = [m for m in models.model_names() if has_hand_merged(m)]
        raise ValueError(f"--hand-merged: {name} has sequential blocks (each all_reduce feeds "
                         "the next block), so there is nothing to merge by hand; models with "
                         f"hand-merged code: {', '.join(having)}")


def _prompt(prompt: str) -> None:
    """The prompt is text the tokenizer can take: not empty, and UTF-8 on the command line
    (Python turns bytes that are not UTF-8 into lone surrogates, which tokenizers refuse)."""
    if not prompt.strip():
        raise ValueError("--prompt is empty")
    raw = os.fsencode(prompt)  # the bytes as given
    try:
        raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"--prompt is not UTF-8: byte {raw[e.start]:#04x} at offset {e.start} "
                         f"of {raw[:40]!r}; give the prompt as UTF-8 text (the terminal's "
                         "encoding may be another)") from None


def _weights() -> None:
    """The GGUF can be had: ``$FXCOALESCE_SMOLLM2_GGUF`` names a file, or the cache holds one
    or can take the fetched one. Its size and sha256 are checked when it is read."""
    from fxcoalesce.apps.spec import smollm2

    fix = (f"set {smollm2.CACHE_ENV} to a directory that can be written, or "
           f"{smollm2.GGUF_ENV} to the GGUF file")
    if named := os.environ.get(smollm2.GGUF_ENV):
        if not Path(named).is_file():
            kind = "a directory, not a file" if Path(named).is_dir() else "no such file"
            raise ValueError(f"{smollm2.GGUF_ENV}={named}: {kind}; {smollm2.GGUF_FIX}")
        return
    folder = smollm2.cache_dir() / "smollm2"
    if (folder / Path(smollm2.MEMBER).name).is_file():
        return
    where = (f"{smollm2.CACHE_ENV}={os.environ[smollm2.CACHE_ENV]}"
             if os.environ.get(smollm2.CACHE_ENV) else f"the weights cache {folder}")
    if why := _unwritable(folder):
        raise ValueError(f"{where}: {why}, and the weights are fetched there; {fix}")


def check_demo(args) -> None:
    _at_least(1, tp=args.tp)
    if args.tree is not None:
        from fxcoalesce.apps.spec.treechoice import parse_tree

        parse_tree(args.tree)  # ValueError naming what is wrong
    if args.tokens is not None:
        _at_least(2, "the first new token comes from the prefill, the others from verify steps",
                  tokens=args.tokens)
    if args.out is not None:
        _can_make_dir(args.out, "demo", "demo.json")
    _model(MERGE_MODEL, args.tp, "forward")  # part 1: the merge model's forward
    _model(PRETRAINED, args.tp, "verify")  # part 2: SmolLM2
    _gpus(args.device, args.backend, args.tp)
    _no_gloo_on_cuda(args.device, _backend(args), args.tp, args.backend is not None)
    _hostable(args.tp, args.device)
    from fxcoalesce.apps.spec.draft_head import head_path

    head_path(args.draft)
    _prompt(args.prompt or DEFAULT_PROMPT)
    _weights()


def check_train_draft(args) -> None:
    from fxcoalesce import models

    models.family_of(args.target)  # "unknown model ...; choose one of: ..."
    if args.target != PRETRAINED:
        raise ValueError(f"--target {args.target}: only {PRETRAINED} has pretrained weights "
                         "to distil from")
    _positive(minutes=args.minutes)
    if not 0 < args.gen_share <= 1:
        raise ValueError(f"--gen-share must be in (0, 1], not {args.gen_share}")
    _positive(lr=args.lr)
    if args.epochs is not None:
        _positive(epochs=args.epochs)
    _at_least(1, gen_batch=args.gen_batch, gen_tokens=args.gen_tokens,
              draft_vocab=args.draft_vocab, ttt_steps=args.ttt_steps,
              batch_tokens=args.batch_tokens)
    if args.prompts is not None:
        _at_least(1, prompts=args.prompts)
    _at_least(0, held_out=args.held_out)
    _can_make_dir(args.out, "train-draft", "config.json, safetensors shards, train_log.json")
    import torch

    if args.device is None:
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    _gpus(args.device, None, 1)
    _weights()


SIZE = re.compile(r"([-+]?(?:\d+\.?\d*|\.\d+)(?:e[-+]?\d+)?)\s*([kmg]?)(?:i?b)?", re.I)
"""A byte count as ``--max-bytes`` takes it: 1024, 64M, 1.5G, 16KiB (binary units)."""
NEGATIVE_SIZE = re.compile(r"^-(?:\d+\.?\d*|\.\d+)(?:e[-+]?\d+)?\s*[kmg]?(?:i?b)?$", re.I)
"""A negative ``SIZE``: argparse must take it for a value, not for an option."""
MAX_CALIBRATE_BYTES = 1 << 30
"""Largest ``calibrate --max-bytes``: twice the default bucket cap (512 MB), which is as
large as a bucketed all_reduce gets. Every rank holds a buffer of each size up to it at once
(3.5 times it: 3.5 GiB at the cap), and the largest sizes take most of the time."""


def _byte_count(option: str, text: str) -> int:
    """'64M', '16K', '1.5G', '1024' -> bytes; ValueError naming ``option`` otherwise."""
    match = SIZE.fullmatch(text.strip())
    if not match:
        raise ValueError(f"{option} {text}: not a byte count (e.g. 64M, 16K or 1024)")
    number, unit = match.groups()
    value = float(number) * {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30}[unit.lower()]
    if not math.isfinite(value):
        raise ValueError(f"{option} {text}: not a finite byte count")
    return int(value)


def _calibrate_memory(text: str, max_bytes: int, tp: int, device: str,
                      backend: str | None = None) -> None:
    """Every rank's buffers (a tensor of each size up to ``max_bytes``, kept for the whole
    run) fit: in available memory for CPU ranks, in each GPU's free memory for CUDA ranks
    (ranks beyond the GPU count share them; NCCL ranks also hold the other implementations'
    buffers: a symmetric buffer of the largest size, the fused op's inputs and workspace,
    and each captured graph's outputs, about 3 times the sizes' sum more). Each rank also
    needs about 0.5 GiB for torch (measured: 1.17 GiB per gloo rank at --max-bytes 256M,
    0.88 GiB of it buffers), 1 GiB on a GPU (context, the matmul probe)."""
    import torch

    from fxcoalesce.apps.bench.calibrate import sizes

    buffers = sum(sizes(max_bytes=max_bytes))
    if device == "cuda":
        gpus = torch.cuda.device_count()
        sharing = -(-tp // gpus)
        need = sharing * (buffers + GiB)
        if backend == "nccl":  # symmetric buffer, fused inputs and workspace, graphs' outputs
            need += 3 * buffers + 4 * max_bytes
        free = min(torch.cuda.mem_get_info(i)[0] for i in range(min(tp, gpus)))
        where = f"each GPU ({sharing} rank{'s' * (sharing > 1)}) needs"
    else:
        need, free = tp * (buffers + GiB // 2), _mem_available()
        where = f"{tp} ranks need"
    if free is not None and need > free:
        raise ValueError(f"--max-bytes {text}: every rank holds each size up to it at "
                         f"once, {buffers / GiB:.1f} GiB; {where} about {need / GiB:.1f} GiB "
                         f"but {free / GiB:.1f} GiB is free (use a smaller --max-bytes)")


CALIBRATE_IMPLS = ("nccl", "one_shot", "two_shot", "fused_add_rms_norm", "nccl_symm")
"""What ``calibrate --impls`` names (NCCL is always measured: the profile's own curve)."""


def _impls(text: str | None) -> tuple[str, ...] | None:
    """``--impls one_shot,nccl`` -> ('one_shot',) (NCCL is always measured); None: all."""
    if text is None:
        return None
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in CALIBRATE_IMPLS]
    if unknown or not names:
        raise ValueError(f"--impls: unknown implementation(s) {', '.join(map(repr, unknown))}; "
                         f"choose from: {', '.join(CALIBRATE_IMPLS)}" if unknown else
                         f"--impls names none; choose from: {', '.join(CALIBRATE_IMPLS)}")
    return tuple(n for n in dict.fromkeys(names) if n != "nccl")


def check_calibrate(args) -> None:
    _at_least(1, tp=args.tp)
    if args.tp < 2 and args.backend != "nccl":
        raise ValueError("--tp 1 needs --backend nccl --device cuda (an NCCL group of one rank: "
                         "what each implementation costs a call at world size 1); with "
                         f"{args.backend or 'gloo'} an all_reduce over one rank moves nothing")
    args.impls = _impls(getattr(args, "impls", None))
    if args.impls and (args.backend != "nccl" or args.device != "cuda"):
        raise ValueError(f"--impls {','.join(args.impls)} needs --backend nccl --device cuda "
                         "(symmetric memory: CUDA ranks of an NCCL group)")
    text = str(args.max_bytes)
    args.max_bytes = _byte_count("--max-bytes", text)
    if args.max_bytes <= 0:
        raise ValueError(f"--max-bytes must be positive, not {text}")
    if args.max_bytes < 8:
        raise ValueError(f"--max-bytes must be at least 8 (the smallest all_reduce measured), "
                         f"not {text}")
    if args.max_bytes > MAX_CALIBRATE_BYTES:
        raise ValueError(f"--max-bytes {text}: at most 1G (every rank holds a buffer of each "
                         "size up to it at once, 3.5 GiB at 1G; the largest bucket fxcoalesce "
                         "makes by default is 512 MB)")
    _positive(" seconds", budget=args.budget)
    _can_write_file(args.out, "calibrate")
    _gpus(args.device, args.backend, args.tp, gloo_may_share=True)
    _calibrate_memory(text, args.max_bytes, args.tp, args.device, args.backend)
