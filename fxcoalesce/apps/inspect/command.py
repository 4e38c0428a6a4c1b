"""``fxcoalesce inspect``: build the step at its door (zoo, factory, Hugging Face), trace it,
and print the report the backend wrote for it, with each profile's predicted communication."""

from __future__ import annotations

import re
import sys
import time
import traceback
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import NoReturn

from fxcoalesce.config import Config, CostModel
from fxcoalesce.report import merge_line, split_line

from fxcoalesce.apps.defaults import parameters_text
from fxcoalesce.apps.inspect.check import CheckCost, check_cost
from fxcoalesce.apps.inspect.compose import Composed, compose, only_picked, plan_layers
from fxcoalesce.apps.inspect.profiles import predictions, read_as_is
from fxcoalesce.apps.trace import Traced

def door(args) -> str:
    """"hf", "factory" or "zoo": which front door ``args`` name."""
    if args.hf:
        return "hf"
    return "factory" if ":" in args.model else "zoo"


def _table(rows: list[tuple[str, object]]) -> str:
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"  {k:<{width}}  {v}" for k, v in rows)


def config_of(args) -> Config:
    """The backend's config for the trace: the user's profile (``--profile``, else
    ``FXCOALESCE_PROFILE``) chooses the rewrite when given."""
    cost = CostModel.from_profile(args.profile) if args.profile else CostModel()
    return Config(bucket_cap_mb=args.bucket_cap_mb, cost=cost)


def trace(args, say: Callable[[str], None]) -> tuple[Traced, str]:
    """The traced step and its one-line description, from the door ``args`` name (the
    report composed from one layer of each kind, unless ``args.all_layers``)."""
    t, title, _ = trace_composed(args, say)
    return t, title


def trace_composed(args, say: Callable[[str], None]
                   ) -> tuple[Traced, str, Composed | None]:
    """:func:`trace`, and how its report was composed (None: every layer was traced)."""
    from fxcoalesce.apps.trace import trace_model

    cfg = config_of(args)
    kind = door(args)
    if kind == "zoo":
        try:
            t = trace_model(args.model, tp=args.tp, tokens=args.tokens, step=args.step,
                            hand_merged=args.hand_merged, config=cfg, layers=args.layers,
                            say=say)
        except ValueError:
            raise
        except Exception as e:
            _failed(args, e, None, say)
        return t, (f"{args.model}{' (hand-merged)' if args.hand_merged else ''}  "
                   f"step={args.step}  TP={args.tp}  tokens={args.tokens}"), None
    from fxcoalesce.apps.launch import init_fake_group

    t0 = time.perf_counter()
    group = init_fake_group(args.tp)
    if kind == "hf":
        from fxcoalesce.apps.inspect.hf import build_hf

        say(f"building {args.hf} under fake tensors, sharded over {args.tp} fake ranks ...")
        built = build_hf(args.hf_config, args.tp, args.tokens, source=args.hf_source)
    else:
        from fxcoalesce.apps.inspect.factory import build_factory

        say(f"calling {args.model} on the meta device, sharding it over {args.tp} fake "
            "ranks ...")
        built = build_factory(args.model, args.tp, group)
    title = f"{built.what}  TP={args.tp}"
    config = getattr(built.model, "config", None) if kind == "hf" else None
    plan = None if getattr(args, "all_layers", False) else plan_layers(built.model, config)
    say(f"  built in {time.perf_counter() - t0:.1f} s ({parameters_text(built.parameters)} "
        "parameters, no weights)"
        + (f"; {plan.text().split(', and composed')[0]}" if plan else ""))
    if plan is not None:
        with only_picked(plan, config):
            before, after, report = _trace_built(args, built, cfg, say,
                                                 f"{len(plan.picked)} of its {plan.depth} layers")
        composed = compose(before, after, report, plan, cost=cfg.cost)
        if not isinstance(composed, str):
            return (Traced(before, after, composed.report, time.perf_counter() - t0), title,
                    composed)
        say(f"  the report cannot be composed from them: {composed}; tracing every layer")
    before, after, report = _trace_built(args, built, cfg, say, "its step")
    return Traced(before, after, report, time.perf_counter() - t0), title, None


def _trace_built(args, built, cfg: Config, say: Callable[[str], None], what: str):
    """``trace_step`` of ``built``, with progress (a line every ``HEARTBEAT_S``)."""
    from fxcoalesce.apps.progress import Phase
    from fxcoalesce.apps.trace import trace_step

    try:
        with warnings.catch_warnings(), Phase(
                say, f"tracing {what}: Dynamo, AOTAutograd and the pipeline", prefix="  ",
                done="traced"):
            # transformers' MoE checks the torch version through an lru_cache: dynamo's note
            # about it (once per call site) is about their code, and not the user's to act on
            warnings.filterwarnings("ignore", message="Dynamo detected a call to a "
                                    "`functools.lru_cache`-wrapped function")
            return trace_step(built.fn, built.args, built.mode, config=cfg)
    except Exception as e:
        _failed(args, e, built, say)


def _failed(args, e: Exception, built, say: Callable[[str], None]) -> NoReturn:
    """Raise the one-line ValueError for a trace that failed with ``e``: where in the model
    (found by running ``built``'s step eagerly under its fake tensors), the call, the shapes
    and, for a shard that does not fit, what TP degree to choose (``failure``)."""
    from fxcoalesce.apps.inspect.failure import explain, locate

    if args.verbose:
        traceback.print_exception(e)
    located = None
    if built is not None:
        say("  finding where it failed: running the step eagerly under fake tensors ...")
        try:
            located = locate(built.fn, built.args, built.mode, built.model)
        except Exception:  # the explanation is a courtesy: the trace's own error stands
            located = None
    raise ValueError(explain(e, name=args.hf or args.model, tp=args.tp, located=located,
                             verbose=args.verbose)) from None


def _no_all_reduce(args, t: Traced) -> None:
    """A step without any all_reduce has nothing for fxcoalesce: one line, not a table."""
    r = t.report
    if r.all_reduce["before"]:
        return
    other = ", ".join(f"{k} {v}" for k, v in r.other_collectives.items())
    why = ("at TP 1 nothing is sharded (give --tp N)" if args.tp == 1 else
           "its sharding sums nothing over the ranks"
           + (f" (it issues {other})" if other else ""))
    raise ValueError(f"{args.hf or args.model}: its step issues no all_reduce, so fxcoalesce "
                     f"has nothing to merge: {why}")


def _check(args, t: Traced) -> CheckCost:
    """What the run-time check adds to the step, as a run sends it (``check``)."""
    from fxcoalesce.collectives import program_sequence, sequence_after

    rewritten = (sequence_after(t.before, t.after, t.report)
                 != program_sequence(t.before.graph))
    return check_cost(t.after, args.tp, rewritten=rewritten,
                      run_checks=config_of(args).run_checks)


def launches_text(a: dict) -> str:
    """'9 -> 5  (lower bound 5)': the table's all_reduce launches, from a report's
    ``all_reduce``."""
    return f"{a['before']} -> {a['after']}  (lower bound {a['lower_bound']})"


def run_inspect(args, say: Callable[[str], None]) -> int:
    from fxcoalesce.pipeline import graph_text

    # DOT without --out goes to stdout, so that it pipes into `dot`; the table goes aside
    out = sys.stderr if args.format == "dot" and not args.out else sys.stdout
    sys.stdout.flush()  # what --trace printed comes first, also when both go to one pipe
    t, title, composed = trace_composed(args, say)
    _no_all_reduce(args, t)
    r = t.report
    check = _check(args, t)
    rows = predictions(t.before, t.after, args.tp, profile=args.profile,
                       predict_with=composed.predict if composed else None)
    print(title, file=out)
    if composed:
        print(f"  {composed.plan.text()}", file=out)
    for line in (table_lines if args.verbose else summary_lines)(t, check, rows, args.tp,
                                                                 composed is not None):
        print(line, file=out)
    if args.out:
        directory = Path(args.out)
        directory.mkdir(parents=True, exist_ok=True)
        extra = {"model": args.hf or args.model, "door": door(args), "title": title,
                 "world_size": args.tp, "tokens": args.tokens, "step": args.step,
                 "hand_merged": args.hand_merged, "layers": args.layers,
                 "trace_s": round(t.seconds, 2), "run_time_check": check.to_dict(),
                 "composed": ({"text": composed.plan.text(), "layers": composed.plan.depth,
                               "traced": composed.plan.picked,
                               "stands_for": composed.plan.weights}
                              if composed else None),
                 "predicted_per_profile": [p.to_dict() for p in rows]}
        (directory / "report.json").write_text(r.to_json(**extra) + "\n")  # a last line
        (directory / "before.txt").write_text(graph_text(t.before, r.modules))
        (directory / "after.txt").write_text(graph_text(t.after, r.modules))
        print(f"wrote {directory}/report.json, before.txt, after.txt"
              + (" (the graphs of the traced layers)" if composed else ""))
    draw_model(args, t, title,
               bound=composed.traced.all_reduce["lower_bound"] if composed else None)
    return 0


def _bytes_text(a: dict, check: CheckCost) -> str:
    sent = a["bytes_after"] + check.bytes
    return f"{a['bytes_before']} -> {sent}" + (
        f"  ({a['bytes_after']} + {check.bytes} of the run-time check)" if check.bytes else "")


def _merge_lines(r, composed: bool, limit: int, parts: bool = True) -> list[str]:
    """What the pipeline merged, one line a bucket, at most ``limit`` (then "... N more");
    ``parts`` False: not the token split's parts (the default view gives them one row)."""
    lines = [merge_line(b) for b in r.buckets if parts or b.get("kind") != "split"]
    if composed:  # FX names are the traced layers': the module paths are the model's own
        lines = [re.sub(r"  \[[^\]]*\]$", "", line) for line in lines]
    if not lines:
        return []
    shown = lines if len(lines) <= limit else lines[:limit - 1]
    out = ["  what it merged (module paths" + ("" if composed else ", FX names in brackets")
           + "):"] + [f"    {line}" for line in shown]
    if len(shown) < len(lines):
        out.append(f"    ... {len(lines) - len(shown)} more (-v, or --out DIR: report.json)")
    return out


def summary_lines(t: Traced, check: CheckCost, rows, tp: int, composed: bool) -> list[str]:
    """The default view, at most 15 lines (``-v``: :func:`table_lines`): the counts, the
    verdict, one predicted time (the profile the rewrite was chosen with, named), what
    merged, the time it took."""
    r = t.report
    a = r.all_reduce
    other = ", ".join(f"{k} x{v}" for k, v in r.other_collectives.items()) or "none"
    chosen = next(p for p in rows if p.chose)
    far = " (measured at {} ranks, read as is)".format(chosen.world_size) if (
        chosen.world_size not in (None, tp)) else ""
    source = (f"{chosen.name}{far}" if chosen.source != "default" else
              "the default model (uncalibrated: a ring over PCIe at 20 GB/s; `fxcoalesce "
              "calibrate` measures yours)")
    b, f = chosen.before, chosen.after
    predicted = (f"{b['total']:.1f} -> {f['total']:.1f} µs of all_reduce a step, "
                 f"{b['exposed']:.1f} -> {f['exposed']:.1f} not hidden by compute; from "
                 f"{source}, which chose the rewrite")
    lines = [_table([
        ("all_reduce launches", launches_text(a)),
        ("all_reduce bytes", _bytes_text(a, check)),
        ("run-time check", check.text().split("; Config(")[0]),
        ("other collectives", f"{other}; {len(r.buckets)} bucket(s)"),
        ("verdict", r.verdict),
        *([("token split", split)] if (split := split_line(r.decisions)) else []),
        ("predicted", predicted),
    ])]
    lines += _merge_lines(r, composed, 4, parts=False)
    warned = f"; {len(r.warnings)} warning(s)" if r.warnings else ""
    lines.append(f"  traced in {t.seconds:.1f} s, the passes {r.total_ms:.1f} ms{warned}; -v: "
                 "every profile's prediction, the passes' times, the warnings")
    return lines


def table_lines(t: Traced, check: CheckCost, rows, tp: int, composed: bool) -> list[str]:
    """``-v``: every row, every merge line, each profile's prediction and where it was
    measured, every warning."""
    r = t.report
    a = r.all_reduce
    lines = [_table([
        ("all_reduce launches", launches_text(a)),
        ("all_reduce bytes", _bytes_text(a, check)),
        ("run-time check", check.text()),
        ("buckets", len(r.buckets)),
        ("other collectives", r.other_collectives or "none"),
        ("graph nodes", f"{r.nodes['before']} -> {r.nodes['after']}"),
        ("pipeline time", f"{r.total_ms:.1f} ms in all"
                          + (" for the traced layers" if composed else "")
                          + f" (analysis {r.analysis_ms:.1f} ms, "
                          + ", ".join(f"{p['name']} {p['ms']:.1f} ms" for p in r.passes)
                          + ")"),
        ("trace time", f"{t.seconds:.1f} s"),
        ("verdict", r.verdict),
    ])]
    lines += _merge_lines(r, composed, 10 ** 6)
    lines += prediction_lines(rows, tp)
    return lines + [f"  warning: {w}" for w in r.warnings]


def prediction_lines(rows, tp: int) -> list[str]:
    """Each profile's predicted communication per step, then where each was measured."""
    far = read_as_is(rows, tp)
    width = max(len(p.name) for p in rows)
    lines = [f"  predicted all_reduce time per step at TP {tp}, before -> after (exposed: what "
             "compute issued before each wait does not hide):"]
    for p in rows:
        mark = " *" if far and p.world_size not in (None, tp) else ""
        chose = "  (the rewrite was chosen with it)" if p.chose else ""
        lines.append(f"    {p.name:<{width}}  {p.figures()}{mark}{chose}")
    lines.append("  where each profile comes from:")
    lines += [f"    {p.name}: {p.label}" for p in rows]
    return lines + ([f"  * {far}"] if far else [])


def draw_model(args, t: Traced, title: str, bound: int | None = None) -> None:
    """The pictures ``--format dot|svg|png`` and ``--timeline`` ask for, of ``t``'s graphs
    (``bound``: theirs, where the report is composed from traced layers)."""
    from fxcoalesce.viz.dag import find_collective_dag
    from fxcoalesce.viz.picture import collective_picture, to_dot

    if args.format != "txt":
        before = find_collective_dag(t.before)
        panels = collective_picture(before, find_collective_dag(t.after, origins=before),
                                    collapse=args.collapse,
                                    bound=bound or t.report.all_reduce["lower_bound"])
        dot = to_dot(panels, title)
        if not args.out:
            print(dot, end="")
        else:
            (Path(args.out) / "collectives.dot").write_text(dot)
            print(f"wrote {args.out}/collectives.dot")
            if args.format in ("svg", "png"):
                from fxcoalesce.viz.draw import render_picture

                path = Path(args.out) / f"collectives.{args.format}"
                engine = render_picture(panels, path, args.format, title=title)
                print(f"wrote {path} (drawn by {engine})")
    if args.timeline:
        from fxcoalesce.viz.draw import draw_timelines
        from fxcoalesce.viz.timeline import predict_timeline

        pred = t.report.predicted_comm_us  # the timeline uses the report's cost model
        cost = (Config().cost if pred["model"] == "default"
                else CostModel.from_profile(pred["model"]))
        world = pred["world_size_assumed"]
        timelines = [predict_timeline(gm, cost, world, f"{name}, predicted")
                     for name, gm in (("before", t.before), ("after", t.after))]
        draw_timelines(timelines, Path(args.out) / "timeline.png", unit="µs (predicted)")
        for tl in timelines:
            print(f"  {tl.summary()}")
        print(f"  predicted: {timelines[0].assumes}")
        print(f"wrote {args.out}/timeline.png")


def draw_trace(args) -> None:
    from fxcoalesce.viz.draw import draw_timelines, read_chrome_trace

    timeline = read_chrome_trace(args.trace)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    draw_timelines([timeline], Path(args.out) / "trace_timeline.png", unit="µs (profiler)")
    print(f"  {timeline.summary()}")
    print(f"wrote {args.out}/trace_timeline.png")
