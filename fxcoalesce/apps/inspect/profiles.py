"""What each cost profile predicts a traced step's all_reduces cost, before and after the
pipeline, each profile labelled with where and how it was measured.

    rows = predictions(traced.before, traced.after, tp=8, profile="my_profile.json")

The profiles: the user's own (``fxcoalesce calibrate --out FILE``; ``--profile`` or
``FXCOALESCE_PROFILE``), the ones measured for the repository (``MEASURED``, under
``benchmarks/results``; found beside an editable install), and the default ring model, which
is a model, not a measurement. Each prediction is the report's own (``cost.predict``: the
sum of every all_reduce's time from the profile's curve at its bytes, and the part compute
issued before its wait does not hide). A profile measured at another world size than the
trace is read as is and says so: the bytes of each all_reduce are the step's, the time of a
call is that of the ranks it was measured on.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

from torch.fx import GraphModule

from fxcoalesce.analysis import analyze
from fxcoalesce.config import CostModel
from fxcoalesce.cost import predict as _predict

RESULTS = Path(__file__).resolve().parents[3] / "benchmarks" / "results"
MEASURED = (
    "gpu_h200x2_2026-11-30/calibrate_nvlink_overlap.json",
    "gpu_h200x2_2026-11-30/calibrate_p2poff_overlap.json",
    "profile_gloo2_cpu.json",
)
"""The repository's measured profiles (``benchmarks/results``), each with its command."""
DEFAULT_LABEL = ("default, uncalibrated: a ring over PCIe, compute a CPU roofline (NCCL's "
                 "tuner constants, 20 GB/s; a model, not a measurement)")
MODES = {"nvlink": "over NVLink", "p2p-off": "NCCL_P2P_DISABLE=1 (through host memory, "
         "PCIe-like)"}
SHORT_MODES = {"nvlink": "NVLink", "p2p-off": "P2P off"}


@dataclass(frozen=True, slots=True)
class Prediction:
    name: str
    """A short name: '2 x H200, NVLink', 'default model'."""
    label: str
    """Where and how the profile was measured (or that it is the default model)."""
    source: str
    """The profile file, "default" for the ring model."""
    world_size: int | None
    """Ranks the profile was measured on (None: the model, at any world size)."""
    before: dict
    after: dict
    """Predicted µs per step: ``total``, ``hidden`` under compute, ``exposed``."""
    chose: bool = False
    """The pipeline chose the rewrite with this profile."""

    def figures(self) -> str:
        b, a = self.before, self.after
        return (f"{b['total']:.1f} -> {a['total']:.1f} µs (exposed {b['exposed']:.1f} -> "
                f"{a['exposed']:.1f})")

    def to_dict(self) -> dict:
        return {"name": self.name, "label": self.label, "source": self.source,
                "world_size": self.world_size, "before_us": self.before,
                "after_us": self.after, "chose_the_rewrite": self.chose}


def name(data: dict, kind: str) -> str:
    """'2 x H200, NVLink': ranks, GPU (or backend and CPU), NCCL mode."""
    world = data.get("world_size")
    if data.get("gpu"):
        text = f"{world} x {str(data['gpu']).removeprefix('NVIDIA ')}"
        if mode := data.get("nccl_mode"):
            text += f", {SHORT_MODES.get(mode, mode)}"
    else:
        text = f"{world} {data.get('backend')} ranks, {str(data.get('device', 'cpu')).upper()}"
    return f"your profile ({text})" if kind == "your profile" else text


def label(data: dict) -> str:
    """Where and how a profile (calibrate's JSON) was measured, from its own fields."""
    parts = [str(data.get("backend")) + (f" {data['nccl']}" if data.get("nccl") else "")]
    if data.get("gpu"):
        parts.append(str(data["gpu"]))
    if mode := data.get("nccl_mode"):
        parts.append(MODES.get(mode, mode))
    parts.append("CUDA graphs" if data.get("cudagraphs") else "an eager loop")
    parts += [f"torch {data['torch']}"] if data.get("torch") else []
    parts += [str(data["date"])] if data.get("date") else []
    if "overlap" in data:
        parts.append(f"overlap efficiency {data['overlap']['efficiency']} (measured)")
    if data.get("command"):  # a path of the machine it ran on: its file name only
        command = re.sub(r"(?<=\s)/\S*/(?=[^/\s]+)", "", str(data["command"]))
        parts.append(f"by `{command}`")
    return ", ".join(parts)


def profile_paths(user: str | None) -> list[tuple[Path, str]]:
    """(path, kind) of every profile to predict with: the user's first, then the measured
    ones that are here (an installed copy without the repository has none)."""
    paths = [(Path(user), "your profile")] if user else []
    return paths + [(RESULTS / rel, "measured") for rel in MEASURED if (RESULTS / rel).is_file()]


def shown(path: Path | str) -> str:
    """A profile's path, relative to the repository when it is one of its own."""
    try:
        return str(Path(path).resolve().relative_to(RESULTS.parents[1]))
    except ValueError:
        return str(path)


def predictions(before: GraphModule, after: GraphModule, tp: int, *,
                profile: str | None = None, predict_with=None) -> list[Prediction]:
    """One prediction per profile (the user's, the measured ones, the default model) of the
    step's all_reduce time before and after the pipeline. The pipeline chose its rewrite
    with ``profile`` (the user's), else with the default model: that row says so.
    ``predict_with(analysis, cost, tp)`` replaces ``cost.predict`` (a composed report's
    graphs: ``compose.predict_composed``)."""
    predict = predict_with or _predict
    graphs = analyze(before), analyze(after)
    rows = []
    for path, kind in profile_paths(profile):
        cost = CostModel.from_profile(path)
        data = json.loads(path.read_text())
        rows.append(Prediction(name(data, kind), f"{label(data)}; {shown(path)}", str(path),
                               cost.profile.world_size,
                               *(predict(g, cost, tp) for g in graphs),
                               chose=kind == "your profile"))
    default = CostModel()
    rows.append(Prediction("default model", DEFAULT_LABEL, "default", None,
                           *(predict(g, default, tp) for g in graphs), chose=profile is None))
    return rows


def read_as_is(rows: list[Prediction], tp: int) -> str | None:
    """The note for profiles measured at another world size than the trace's, if any."""
    worlds = sorted({p.world_size for p in rows if p.world_size not in (None, tp)})
    if not worlds:
        return None
    at = " or ".join(map(str, worlds))
    return (f"measured at {at} ranks, read as is at TP {tp}: each all_reduce's bytes are "
            f"this step's, the time of a call is that of the ranks measured (a ring over "
            f"{tp} ranks makes {2 * (tp - 1)} hops, over {worlds[0]} ranks "
            f"{2 * (worlds[0] - 1)}); `fxcoalesce calibrate --tp {tp}` on your machine "
            "measures yours")
