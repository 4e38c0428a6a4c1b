"""One record per token count from every rank's results (``merge_ranks``), and the
provenance each record carries (``environment``): what ``bench.json`` holds.

Per variant: median / p10 / p90 of the step (its slowest rank's), whether that range
overlaps the baseline's (``within_noise_of_inductor``), the all_reduces issued
(counted at run time: NCCL's and the lowered implementations'), the output error against the
eager reference, and, when the ``no-comm`` floor ran, ``exposed_comm_ms``: the variant's
median minus the floor's, the communication the step still waits for. ``no-comm`` itself is
``"wrong_by_design": true``.
"""

from __future__ import annotations

import os
import statistics

from fxcoalesce.apps.bench.report import BASELINE, within_noise
from fxcoalesce.apps.bench.variants import FLOOR, WRONG_BY_DESIGN


def percentile(values: list[float], q: float) -> float:
    """The ``q``-th percentile (0-100) by linear interpolation between the sorted values."""
    s = sorted(values)
    pos = (len(s) - 1) * q / 100
    lo = int(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def merge_ranks(per_rank: list[list[dict]], opt, env: dict) -> list[dict]:
    """One record per token count from every rank's results: a step takes as long as its
    slowest rank; counts are rank 0's (each rank's are kept when they differ)."""
    records = []
    for i, tokens in enumerate(opt.tokens):
        ranks = [res[i] for res in per_rank]
        variants, notes = {}, list(ranks[0]["notes"])
        for name, f in ranks[0]["variants"].items():
            steps = [max(vals) for vals in zip(*(rk["variants"][name]["times_us"]
                                                 for rk in ranks))]
            launches = [rk["variants"][name]["all_reduce_launches"] for rk in ranks]
            v = {"median_ms": statistics.median(steps) / 1e3,
                 "p10_ms": percentile(steps, 10) / 1e3, "p90_ms": percentile(steps, 90) / 1e3,
                 "all_reduce_launches": launches[0], "bytes": f["bytes"],
                 "max_abs_err": max(rk["variants"][name]["max_abs_err"] for rk in ranks),
                 "other_collectives": f["other_collectives"], "compile_s": f["compile_s"],
                 "compile_cache": f.get("compile_cache"),
                 "steps_ms": [round(s / 1e3, 4) for s in steps]}
            if f.get("lowered"):
                v["lowered"] = f["lowered"]
            if f.get("hidden_kernels") is not None:
                v["hidden_kernels"] = f["hidden_kernels"]
            if name in WRONG_BY_DESIGN:
                v["wrong_by_design"] = True
            if f["options"]:
                v["inductor_options"] = f["options"]
            if f.get("trace"):
                v["trace"] = f["trace"]
            if f["failed_tiers"]:
                v["failed_option_tiers"] = f["failed_tiers"]
            if f["reports"]:
                v["report_all_reduce"] = f["reports"]
                v["report_predicted_comm_us"] = f["predicted_comm_us"]
                v["report_pass_ms"] = f["pass_ms"]  # rank 0's: inside its compile
            if len(set(launches)) > 1:
                v["all_reduce_launches_per_rank"] = launches
                notes.append(f"{name}: ranks issued different all_reduce counts {launches}")
            if name == "fxcoalesce" and not f["reports"]:
                notes.append("fxcoalesce: no report recorded, so the pass did not run")
            if opt.cudagraphs and f["cudagraph_skips"] and name != "eager":
                notes.append(f"{name}: Inductor skipped CUDA graphs for {f['cudagraph_skips']} "
                             "graph(s) (its log says why)")
            if f["graphs"] != 1 and name != "eager":
                notes.append(f"{name}: dynamo made {f['graphs']} graphs on its first call, "
                             "expected 1")
            if any(rk["variants"][name]["recompiled"] for rk in ranks):
                notes.append("dynamo compiled again during timing (a variant recompiled)")
            notes += variant_notes(name, f)
            variants[name] = v
        add_exposed_comm(variants)
        mark_noise(variants)
        records.append({
            "model": opt.model, "step": opt.step, "tp": opt.tp, "tokens": tokens,
            "layers": opt.layers, "dim": opt.dim, "backend": opt.backend, "device": opt.device,
            "cudagraphs": opt.cudagraphs, "nccl_mode": opt.nccl_mode,
            "dtype": str(opt.dtype).removeprefix("torch."), "steps": opt.steps,
            "calls_per_sample": opt.calls_per_sample,
            "warmup": opt.rounds_before_timing, **env, "variants": variants,
            "skipped": ranks[0]["skipped"], "notes": sorted(set(notes)),
            "gain": predicted_vs_measured(variants), "command": opt.command})
    return records


def variant_notes(name: str, f: dict) -> list[str]:
    """What a reader must know of variant ``name`` from its facts ``f``: no-comm's results
    are wrong on purpose; an anchor that did not do what it stands for."""
    lowered = sum((f.get("lowered") or {}).values())
    if name == FLOOR:
        note = ("no-comm: WRONG RESULTS BY DESIGN (every all_reduce replaced by x * world "
                "size): the floor, what the step costs if all_reduces were free")
        if f["all_reduce_launches"]:
            note += f"; yet it issued {f['all_reduce_launches']} all_reduce(s): not the floor"
        return [note]
    if name == "inductor-one-shot" and not lowered:
        return ["inductor-one-shot: no all_reduce ran as symm_mem.one_shot_all_reduce (each "
                "is over 128 KiB, or Inductor could not place its input in symmetric "
                "memory): it measured plain Inductor"]
    return []


def mark_noise(variants: dict) -> None:
    """``within_noise_of_inductor`` of every other variant: whether its p10-p90 step time
    overlaps the baseline's (``report.within_noise``), when the baseline ran."""
    base = variants.get(BASELINE)
    for name, v in variants.items():
        if base is not None and name != BASELINE:
            v[f"within_noise_of_{BASELINE}"] = within_noise(v, base)


def add_exposed_comm(variants: dict) -> None:
    """``exposed_comm_ms`` of every variant: its median minus the no-comm floor's (when the
    floor ran)."""
    floor = variants.get(FLOOR)
    if floor is None:
        return
    for v in variants.values():
        v["exposed_comm_ms"] = round(v["median_ms"] - floor["median_ms"], 6)


def predicted_vs_measured(variants: dict) -> dict | None:
    """fxcoalesce's step-time saving over plain Inductor, as its report predicted it (exposed
    communication before minus after) and as measured (median against median)."""
    ours, plain = variants.get("fxcoalesce"), variants.get("inductor")
    if not ours or not plain or not ours.get("report_predicted_comm_us"):
        return None
    pred = ours["report_predicted_comm_us"]
    predicted = sum(p["before"]["exposed"] - p["after"]["exposed"] for p in pred) / 1e3
    measured = plain["median_ms"] - ours["median_ms"]
    return {"predicted_ms": round(predicted, 4), "measured_ms": round(measured, 4),
            "error": round((measured - predicted) / predicted, 3) if predicted else None,
            "model": pred[0]["model"]}


def environment(device: str) -> dict:
    """Provenance of every record: torch, date, host, the cost profile fxcoalesce reads
    (``FXCOALESCE_PROFILE``, or "default"), and GPU, GPU count, CUDA, NCCL and driver
    versions (None off CUDA)."""
    import platform
    from datetime import datetime, timezone

    import torch

    env = {"torch": torch.__version__,
           "date": datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
           "host": {"cpus": os.cpu_count(), "machine": platform.machine()},
           "gpu": None, "gpus": 0, "cuda": None, "nccl": None, "driver": None,
           **profile_used()}
    if device == "cuda":
        env["gpu"] = torch.cuda.get_device_name(0)
        env["gpus"] = torch.cuda.device_count()
        env["cuda"] = torch.version.cuda
        try:
            env["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
        except (AttributeError, RuntimeError):
            pass
        env["driver"] = driver_version()
    return env


def driver_version() -> str | None:
    """The NVIDIA driver's version: nvidia-smi's, else the kernel module's (Linux)."""
    import subprocess

    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version",
                              "--format=csv,noheader"], capture_output=True, text=True,
                             timeout=20).stdout.split("\n")[0].strip()
        if out:
            return out
    except (OSError, subprocess.SubprocessError):
        pass
    try:  # "NVRM version: NVIDIA UNIX x86_64 Kernel Module  580.159.04  ..."
        with open("/proc/driver/nvidia/version") as f:
            words = f.readline().split()
    except OSError:
        return None
    return next((w for w in words if w[:1].isdigit() and "." in w), None)


def profile_used() -> dict:
    """``{"profile": path or "default", "profile_sha256": ...}``: what the fxcoalesce variant
    (and the report's predictions) read; a profile that cannot be read is named with why
    the default model was used instead (the backend warns alike)."""
    from fxcoalesce.compiler import PROFILE_ENV
    from fxcoalesce.config import CostModel, ProfileError

    path = os.environ.get(PROFILE_ENV)
    if not path:
        return {"profile": "default", "profile_sha256": None}
    try:
        digest = CostModel.from_profile(path).profile.digest
    except ProfileError as e:
        return {"profile": f"default ({PROFILE_ENV}={path} unusable: {e})",
                "profile_sha256": None}
    return {"profile": path, "profile_sha256": digest}
