"""``fxcoalesce demo`` (the README's first command): every line it prints comes from a
measurement or a report, and the README shows its lines.

The unit tests render the demo's lines from made-up records (cheap); the slow one runs the
demo itself, as ``.ci/run`` does from a base install, and checks its figures against the
models' shapes and the README's block."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

from fxcoalesce.apps import tour
from fxcoalesce.apps.spec.demo import SmolRun, smollm2_lines
from fxcoalesce.apps.spec.specdecode import SpecOptions

ROOT = Path(__file__).resolve().parents[1]


def bench_record(plain_ms=(8.0, 4.0, 16.0), ours_ms=(5.0, 3.0, 6.0)) -> dict:
    def variant(ms, launches, nbytes, **extra):
        return {"median_ms": ms[0], "p10_ms": ms[1], "p90_ms": ms[2],
                "all_reduce_launches": launches, "bytes": nbytes, "max_abs_err": 1e-7, **extra}
    return {"tokens": 3, "tp": 2, "backend": "gloo", "device": "cpu", "steps": 500, "warmup": 10,
            "variants": {"inductor": variant(plain_ms, 9, 6912), "fxcoalesce": variant(
                ours_ms, 5, 3840, report_all_reduce=[{"lower_bound": 5}],
                report_pass_ms=[{"pipeline": 30.0, "ladder": 1.5, "exchange": 4.0,
                                 "total": 35.5}])}}


def smol_run(chosen: str | None = None) -> SmolRun:
    """A run with the default tree (``chosen`` None), or as the demo sizes it: a tree
    ("tree") or greedy ("greedy") chosen from measurement."""
    step = "decode" if chosen == "greedy" else "spec"
    summary = {"all_reduce_per_call": {step: {"before": 61, "after": 61, "lower_bound": 61}},
               "verdict": {step: "already at its bound: the all_reduces form dependency "
                                 "chains, and no exact rewrite can merge links of a chain"},
               "pass_ms": {step: {"pipeline": 800.0, "ladder": 0.0, "exchange": 600.0,
                                  "total": 1400.0}},
               "mean_accepted": 2.28, "tokens_per_s": {"speculative": 3.5, "target_greedy": 6.3},
               "speedup_vs_target_greedy": 0.55, "ranks_agree": True}
    if chosen:
        summary["tree_choice"] = {"label": "4 tokens, depth 3, top-k 1", "source": "measured",
                                  "reason": "tree (1,3,4) fastest: ...",
                                  "greedy_chosen": chosen == "greedy"}
    options = SpecOptions(gguf="", draft="", prompts=((1, 2),), greedy_compiled=False,
                          tree="auto" if chosen else None)
    return SmolRun(summary, {"spec_tokens": 64, "same_tokens": True}, "text", False, options)


def test_merge_lines_come_from_the_record():
    lines = tour.merge_lines(bench_record())
    text = "\n".join(lines)
    assert "9 plain torch.compile -> 5 fxcoalesce (counted at run time; lower bound 5)" in text
    assert "all_reduce bytes per step        : 6912 -> 3840" in text
    assert ("8.00 ms (4.00-16.00) plain torch.compile, 5.00 ms (3.00-6.00) fxcoalesce: 1.60x, "
            "the ranges overlap: within noise") in text  # 3-6 ms overlaps 4-16 ms
    assert "35.5 ms (pipeline 30.0 ms, agreeing 5.5 ms) for its 1 graph" in text
    apart = "\n".join(tour.merge_lines(bench_record(ours_ms=(2.0, 1.5, 3.0))))
    assert "the ranges do not overlap" in apart and "within noise" not in apart
    assert " s plain" not in text  # no compile totals: they follow the load


def test_smollm2_lines_carry_the_reports_verdict():
    lines = smollm2_lines(smol_run(), tp=2)
    assert lines[0] == ("all_reduce per speculative step  : 61 -> 61 (lower bound 61); the "
                        "report: already at its bound: the all_reduces form dependency chains, "
                        "and no exact rewrite can merge links of a chain")
    assert "fxcoalesce inside the compile    : 1400.0 ms (pipeline 800.0 ms, agreeing 600.0 ms)" \
        " for the speculative step's graph" in lines
    assert not any("all_reduce" in ln for ln in smollm2_lines(smol_run(), tp=1))


def test_smollm2_lines_say_when_greedy_ran_uncompiled():
    line = next(ln for ln in smollm2_lines(smol_run(), tp=2) if ln.startswith("tokens per"))
    assert "3.5 speculative, 6.3 target-only greedy, uncompiled (0.55x;" in line


def test_smollm2_lines_say_which_tree_and_why_first():
    tree = smollm2_lines(smol_run("tree"), tp=2)
    assert tree[0] == "tree                             : 4 tokens, depth 3, top-k 1 (measured)"
    assert tree[1].endswith(": tree (1,3,4) fastest: ...")
    assert tree[2].startswith("all_reduce per speculative step  : 61 -> 61")
    greedy = smollm2_lines(smol_run("greedy"), tp=2)
    assert greedy[2].startswith("all_reduce per decode step       : 61 -> 61")
    assert "for the greedy decode step's graph" in greedy[-1]
    assert not any(ln.startswith("mean accepted") for ln in greedy)


def test_the_inspect_example_is_what_the_command_prints():
    """The demo's last line, traced in-process, is a line of ``fxcoalesce inspect``'s own
    output for the same command (fake tensors: seconds)."""
    import shlex

    found, seconds = tour.inspect_example()
    assert found.startswith("all_reduce launches  ") and seconds > 0
    proc = subprocess.run([sys.executable, "-m", "fxcoalesce.apps.cli",
                           *shlex.split(tour.INSPECT_EXAMPLE)[1:]], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    table = dict(re.findall(r"^  (all_reduce launches|verdict) +(.+)$", proc.stdout, re.M))
    assert found == (f"all_reduce launches  {table['all_reduce launches']}, "
                     f"{table['verdict']}"), proc.stdout
    lines = tour.inspect_lines(found, seconds)
    assert lines[-1].startswith(f"  {tour.INSPECT_EXAMPLE} ")
    assert lines[-1].endswith(f"   traced just now, {seconds:.1f} s: {found}")


def readme_demo_block() -> list[str]:
    text = (ROOT / "README.md").read_text().split("<!-- demo output", 1)[1]
    return text.split("```\n", 2)[1].splitlines()


def labels(lines: list[str]) -> list[str]:
    """The aligned labels (``  label   : value``) of the demo's figure lines, in order."""
    return [m.group(1).strip() for ln in lines if (m := re.match(r"  (\S[^:]{20,}?) +: ", ln))]


def test_readme_shows_the_demos_lines():
    """The README's block has every label the demo prints, in the demo's order."""
    # on 2 CPU cores the demo chooses greedy (benchmarks/NOTES.md, issue 34)
    printed = tour.merge_lines(bench_record()) + [f"  {ln}" for ln in
                                                  smollm2_lines(smol_run("greedy"), 2)]
    want = labels(printed)
    shown = labels(readme_demo_block())
    assert [s for s in shown if s in want] == want, shown
    assert readme_demo_block()[0].startswith("1/2 merging all_reduces: neox-tiny, ")


def test_the_recorded_gpu_line_is_its_files_and_the_readmes():
    """The demo's GPU line is read from the recorded run, tree included, and the README shows
    the line the demo prints today."""
    import json

    line = tour.recorded_gpu_line()
    d = json.loads((Path(tour.__file__).resolve().parents[2] / tour.RECORDED_GPU).read_text())
    tree = ",".join(str(d["tree"][k]) for k in ("top_k", "depth", "total_tokens"))
    assert f"{d['speedup_vs_target_greedy']:.2f}x over greedy" in line
    assert f"accepted length {d['mean_accepted']:.2f}, tree ({tree}), TP {d['tp']}" in line
    assert line.strip() in [ln.strip() for ln in readme_demo_block()]


@pytest.mark.slow
def test_demo_as_ci_runs_it():
    """The whole demo: the merge model's launches from its shape (one all_reduce for the
    embedding, two per parallel block summed into one), SmolLM2's tokens equal greedy, and
    the README's block has the same lines."""
    from fxcoalesce import models

    layers = models.args_of(tour.MERGE_MODEL).n_layers
    proc = subprocess.run([sys.executable, "-m", "fxcoalesce.apps.cli", "demo"], cwd=ROOT,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert (f"{1 + 2 * layers} plain torch.compile -> {1 + layers} fxcoalesce (counted at run "
            f"time; lower bound {1 + layers})") in out
    assert "tokens equal target greedy       : True" in out
    assert "ranks agree                      : True" in out
    assert "the report: already at its bound" in out
    assert "Warning" not in proc.stderr and "leaked" not in proc.stderr, proc.stderr
    assert labels(out.splitlines()) == labels(readme_demo_block())
    ending = out.splitlines()[-4:]  # how to ask the same of one's own model
    found, seconds = re.search(r"traced just now, ([\d.]+) s: (.+)$", ending[-1]).group(2, 1)
    assert ending == tour.inspect_lines(found, float(seconds))
    shown = readme_demo_block()[-4:]  # the README's block ends the same (the time aside)
    assert [re.sub(r"[\d.]+ s:", "", ln) for ln in ending] == \
        [re.sub(r"[\d.]+ s:", "", ln) for ln in shown]
