"""``fxcoalesce demo`` (the README's first command): every line it prints comes from a
measurement or a report, its verdicts are the sign test's, and the README shows its lines.

The unit tests render the demo's lines from made-up records (cheap); the slow one runs the
demo itself, as ``.ci/run`` does from a base install, and checks its figures against the
models' shapes and the README's block."""

import json
import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from fxcoalesce.apps import demo

ROOT = Path(__file__).resolve().parents[1]


def bench_record(plain_steps=None, ours_steps=None) -> dict:
    """Part 1's record; by default fxcoalesce faster in 13 of 15 rounds, the rounds so noisy
    that the p10-p90 ranges overlap."""
    plain_steps = plain_steps or [8.0 + 4 * (i % 3) for i in range(15)]
    ours_steps = ours_steps or [x - 2 if i < 13 else x + 2 for i, x in enumerate(plain_steps)]

    def variant(steps, launches, nbytes, **extra):
        s = sorted(steps)
        return {"median_ms": s[len(s) // 2], "p10_ms": s[1], "p90_ms": s[-2],
                "steps_ms": steps, "all_reduce_launches": launches, "bytes": nbytes,
                "max_abs_err": 1e-7, **extra}
    return {"tokens": 3, "tp": 2, "backend": "gloo", "device": "cpu", "steps": len(plain_steps),
            "warmup": 10, "variants": {
                "inductor": variant(plain_steps, 9, 6912),
                "fxcoalesce": variant(ours_steps, 5, 3840, report_all_reduce=[{"lower_bound": 5}],
                                      report_pass_ms=[{"pipeline": 30.0, "ladder": 1.5,
                                                       "exchange": 4.0, "total": 35.5}])}}


def test_merge_lines_give_launches_and_bytes_then_the_sign_tests_verdict():
    rec = bench_record()
    plain, ours = rec["variants"]["inductor"], rec["variants"]["fxcoalesce"]
    assert ours["p90_ms"] >= plain["p10_ms"]  # the ranges overlap: they would say "noise"
    lines = demo.merge_lines(rec)
    labels = [ln.split(":")[0].strip() for ln in lines[1:]]
    assert labels[:4] == ["all_reduce launches per step", "all_reduce bytes per step",
                          "step time, median", "fxcoalesce, round by round"]
    text = "\n".join(lines)
    assert "9 plain torch.compile -> 5 fxcoalesce (counted at run time; lower bound 5)" in text
    assert "all_reduce bytes per step        : 6912 -> 3840" in text
    assert (f"{plain['median_ms']:.2f} ms plain torch.compile, {ours['median_ms']:.2f} ms "
            f"fxcoalesce ({plain['median_ms'] / ours['median_ms']:.2f}x)") in text
    assert "fxcoalesce, round by round       : faster in 13 of 15 rounds (sign test p = " \
        "0.0037)" in text
    assert "noise" not in text and "overlap" not in text
    assert "35.5 ms (pipeline 30.0 ms, agreeing 5.5 ms) for its 1 graph" in text
    assert " s plain" not in text  # no compile totals: they follow the load


@pytest.mark.parametrize("wins, said", [
    (12, "not faster beyond the noise (faster in 12 of 15 rounds, sign test p = 0.018)"),
    (2, "slower: plain torch.compile faster in 13 of 15 rounds (sign test p = 0.0037)"),
])
def test_merge_verdict_where_fxcoalesce_is_not_faster(wins, said):
    plain = [8.0 + 4 * (i % 3) for i in range(15)]
    ours = [x - 2 if i < wins else x + 2 for i, x in enumerate(plain)]
    line = demo.merge_lines(bench_record(plain, ours))[4]
    assert line == f"  fxcoalesce, round by round       : {said}"


def race_ranks(greedy_ms: float = 100.0, tree_ms: float = 150.0, accepted: float = 1.25,
               greedy_wins: int | None = None) -> list[dict]:
    """Two ranks of the CPU's short look: the medians, 10 rounds (noisy; greedy ahead in
    ``greedy_wins`` of them, else as the medians say), the tree's walk."""
    jitter = [1.0 + 0.3 * (i % 3) for i in range(10)]
    rounds = [(greedy_ms / 1e3 * j, tree_ms / 1e3 * j) for j in jitter]
    if greedy_wins is not None:
        rounds = [(g, accepted * g * (1.5 if i < greedy_wins else 0.5))
                  for i, (g, _) in enumerate(rounds)]
    r = {"rank": 0, "world": 2, "backend": "gloo", "device_name": "cpu", "tokens": [5, 6, 7],
         "answer_s": 6.4, "tree": (1, 1, 2), "accepted": {"accepted_length": accepted,
                                                         "steps": 48},
         "greedy_step_s": greedy_ms / 1e3, "tree_step_s": tree_ms / 1e3, "rounds": rounds}
    return [r, {**r, "rank": 1}]


def test_race_lines_say_first_what_was_measured_and_never_call_greedy_speculative():
    lines = demo.race_lines(race_ranks(), 3)
    assert lines[0] == ("  measured here                    : greedy decoding is faster, 1.20x: "
                        "10.0 tokens/s greedy, 8.3 with the smallest tree (in 10 of 10 rounds, "
                        "sign test p = 0.00098)")
    text = "\n".join(lines)
    assert "a greedy step, median            : 100 ms for 1 token" in text
    assert ("the smallest tree's step, median : 150 ms (1 draft token, 2 verified) for 1.25 "
            "tokens, its accepted length along the answer below (12 draft tokens accepted in 48 "
            "steps)") in text
    answer = next(ln for ln in lines if ln.startswith("  the answer"))
    assert "3 tokens decoded greedily, uncompiled, in 6.4 s; ranks agree: True" in answer
    assert not any("speculative" in ln for ln in lines if "--tree" not in ln)


@pytest.mark.parametrize("tree_ms, greedy_wins, said", [
    (110.0, None, "the smallest tree is faster, 1.14x: 10.0 tokens/s greedy, 11.4 with the "
                  "smallest tree (in 10 of 10 rounds, sign test p = 0.00098)"),
    (125.0, 5, "neither is faster beyond the noise: 10.0 tokens/s greedy, 10.0 with the "
               "smallest tree (greedy faster in 5 of 10 rounds, sign test p = 0.62)"),
    (150.0, 9, "neither is faster beyond the noise: 10.0 tokens/s greedy, 8.3 with the "
               "smallest tree (greedy faster in 9 of 10 rounds, sign test p = 0.011)"),
])
def test_race_lines_follow_the_measurement(tree_ms, greedy_wins, said):
    """The verdict is the rounds' sign test, whatever the medians' ratio says."""
    lines = demo.race_lines(race_ranks(tree_ms=tree_ms, greedy_wins=greedy_wins), 3)
    assert lines[0].endswith(f": {said}")


def run_summary(chosen: str | None = None, greedy_compiled: bool = True) -> dict:
    """``specdecode.summarize`` of a full run with the default tree (``chosen`` None), or as
    the demo sizes it: a tree ("tree") or greedy ("greedy") chosen from measurement."""
    step = "decode" if chosen == "greedy" else "spec"
    run = {"all_reduce_per_call": {step: {"before": 61, "after": 61, "lower_bound": 61}},
           "verdict": {step: "already at its bound: the all_reduces form dependency chains, "
                             "and no exact rewrite can merge links of a chain"},
           "pass_ms": {step: {"pipeline": 800.0, "ladder": 0.0, "exchange": 600.0,
                              "total": 1400.0}},
           "mean_accepted": 2.28, "tokens_per_s": {"speculative": 3.5, "target_greedy": 6.3},
           "speedup_vs_target_greedy": 0.55, "ranks_agree": True,
           "settings": {"greedy_compiled": greedy_compiled}}
    if chosen:
        run["tree_choice"] = {"label": "4 tokens, depth 3, top-k 1", "source": "measured",
                              "reason": "tree (1,3,4) fastest: ...",
                              "greedy_chosen": chosen == "greedy"}
    return run


RESULT = {"spec_tokens": 64, "same_tokens": True}


def test_spec_lines_carry_the_reports_verdict():
    lines = demo.spec_lines(run_summary(), RESULT, 2, stopped=False)
    assert lines[0] == ("  all_reduce per speculative step  : 61 -> 61 (lower bound 61); the "
                        "report: already at its bound: the all_reduces form dependency chains, "
                        "and no exact rewrite can merge links of a chain")
    assert ("  fxcoalesce inside the compile    : 1400.0 ms (pipeline 800.0 ms, agreeing 600.0 "
            "ms) for the speculative step's graph") in lines
    assert not any("all_reduce" in ln for ln in demo.spec_lines(run_summary(), RESULT, 1,
                                                                 stopped=False))


def test_spec_lines_say_when_greedy_ran_uncompiled():
    lines = demo.spec_lines(run_summary(greedy_compiled=False), RESULT, 2, stopped=False)
    line = next(ln for ln in lines if ln.startswith("  tokens per"))
    assert "3.5 speculative, 6.3 target-only greedy, uncompiled (0.55x;" in line


def test_spec_lines_say_which_tree_and_why_first_and_a_greedy_choice_is_greedy():
    tree = demo.spec_lines(run_summary("tree"), RESULT, 2, stopped=False)
    assert tree[0] == "  tree                             : 4 tokens, depth 3, top-k 1 (measured)"
    assert tree[1].endswith(": tree (1,3,4) fastest: ...")
    assert tree[2].startswith("  all_reduce per speculative step  : 61 -> 61")
    greedy = demo.spec_lines(run_summary("greedy"), RESULT, 2, stopped=False)
    assert greedy[2].startswith("  all_reduce per greedy decode step: 61 -> 61")
    assert "for the greedy decode step's graph" in greedy[-1]
    assert not any(ln.startswith("  mean accepted") for ln in greedy)
    assert not any("speculative" in ln for ln in greedy)


def test_the_inspect_example_is_what_the_command_prints():
    """The demo's last line, traced in-process, is a line of ``fxcoalesce inspect``'s own
    output for the same command (fake tensors: seconds)."""
    import shlex

    found, seconds = demo.inspect_example()
    assert found.startswith("all_reduce launches  ") and seconds > 0
    proc = subprocess.run([sys.executable, "-m", "fxcoalesce.apps.cli",
                           *shlex.split(demo.INSPECT_EXAMPLE)[1:]], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    table = dict(re.findall(r"^  (all_reduce launches|verdict) +(.+)$", proc.stdout, re.M))
    assert found == (f"all_reduce launches  {table['all_reduce launches']}, "
                     f"{table['verdict']}"), proc.stdout
    lines = demo.inspect_lines(found, seconds)
    assert lines[-1].startswith(f"  {demo.INSPECT_EXAMPLE} ")
    assert lines[-1].endswith(f"   traced just now, {seconds:.1f} s: {found}")


def readme_demo_block() -> list[str]:
    text = (ROOT / "README.md").read_text().split("<!-- demo output", 1)[1]
    return text.split("```\n", 2)[1].splitlines()


def labels(lines: list[str]) -> list[str]:
    """The aligned labels (``  label   : value``) of the demo's figure lines, in order."""
    return [m.group(1).strip() for ln in lines if (m := re.match(r"  (\S[^:]{20,}?) +: ", ln))]


def test_readme_shows_the_demos_lines():
    """The README's block has every label the demo prints on a CPU, in the demo's order."""
    printed = demo.merge_lines(bench_record()) + demo.race_lines(race_ranks(), 3)
    want = labels(printed)
    shown = labels(readme_demo_block())
    assert [s for s in shown if s in want] == want, shown
    assert readme_demo_block()[0].startswith("1/2 merging all_reduces: neox-tiny, ")


def test_the_recorded_gpu_line_is_its_files_and_the_readmes():
    """The demo's GPU line is read from the recorded run, tree included, says it is recorded
    and where, and the README shows the line the demo prints today."""
    line = demo.recorded_gpu_line()
    d = json.loads((Path(demo.__file__).resolve().parents[2] / demo.RECORDED_GPU).read_text())
    tree = ",".join(str(d["tree"][k]) for k in ("top_k", "depth", "total_tokens"))
    assert line.startswith("  recorded on 1 x H100")
    assert f"{d['speedup_vs_target_greedy']:.2f}x over greedy" in line
    assert f"accepted length {d['mean_accepted']:.2f}, tree ({tree}), TP {d['tp']}" in line
    assert line.endswith(f"[{demo.RECORDED_GPU}]")
    assert line.strip() in [ln.strip() for ln in readme_demo_block()]


def test_the_demo_on_a_cpu_prints_the_race_then_the_answer_then_inspect(monkeypatch, capsys,
                                                                        tmp_path):
    """``fxcoalesce demo`` on a CPU: part 2 says what it measured first, then the recorded GPU
    line, then the answer; it ends with how to ask the same of one's own model. The ranks,
    the weights and the trace are stood in for here (the slow test runs them)."""
    from fxcoalesce.apps import launch
    from fxcoalesce.apps.spec.specdecode import SpecOptions

    class Tokenizer:
        eos_id = 2

        def decode(self, tokens):
            assert tokens == [5, 6, 7]
            return "Blue light."

    options = SpecOptions(gguf="", draft="", prompts=((1,),), codegen="eager")
    monkeypatch.setattr(demo, "smollm2_job", lambda args, prompt: demo.SmolJob(
        options, Tokenizer(), full=False))
    spawned = []

    def spawn(fn, world, args, **kw):
        spawned.append(args[-1])  # full
        return [{"merge": {"rank": r}, "spec": s} for r, s in enumerate(race_ranks())]
    monkeypatch.setattr(launch, "spawn", spawn)
    found = "all_reduce launches  5 -> 3  (lower bound 3), reached the lower bound"
    monkeypatch.setattr(demo, "inspect_example", lambda say=None: (found, 1.5))
    args = SimpleNamespace(tp=2, device="cpu", backend=None, codegen=None, tokens=None,
                           prompt=None, draft=None, tree=None, quiet=True,
                           out=str(tmp_path / "o"), command_line="")
    assert demo.run_demo(args) == 0
    assert spawned == [False]
    out = capsys.readouterr().out.splitlines()
    start = out.index(next(ln for ln in out if ln.startswith("2/2 EAGLE-3 on a real model")))
    assert out[start + 1].startswith("  measured here                    : greedy decoding is "
                                     "faster")
    assert out[start + 2] == demo.recorded_gpu_line()
    assert ["  Q: Why is the sky blue?", "  A: Blue light."] == out[out.index(
        "  Q: Why is the sky blue?"):][:2]
    assert out[-6].startswith("wall time ")
    assert out[-5].startswith("Your own model: `fxcoalesce inspect` says what fxcoalesce "
                              "would merge in it")
    assert out[-2].startswith(f"  {demo.INSPECT_EXAMPLE} ")
    assert out[-2].endswith(f"   traced just now, 1.5 s: {found}")
    assert out[-1] == f"wrote {tmp_path / 'o' / 'demo.json'}"
    data = json.loads((tmp_path / "o" / "demo.json").read_text())
    assert data["speculative"]["text"] == "Blue light."
    assert data["speculative"]["greedy_step_s"] == 0.1
    # the commands it shows parse as written, their placeholders filled in
    from fxcoalesce.apps.cli import parser

    for line in out[-4:-1]:
        command = line.strip().split("   ")[0].replace("<model type or config.json>", "cohere")
        parsed = parser().parse_args(command.replace(" N", " 8").split()[1:])
        assert (parsed.cmd, parsed.tp) == ("inspect", 8), command


@pytest.mark.slow
def test_demo_as_ci_runs_it(tmp_path):
    """The whole demo: the merge model's launches from its shape (one all_reduce for the
    embedding, two per parallel block summed into one), a sign test's verdict, the CPU's
    race with its recorded GPU line, and the README's block has the same lines."""
    from fxcoalesce import models

    layers = models.args_of(demo.MERGE_MODEL).n_layers
    proc = subprocess.run([sys.executable, "-m", "fxcoalesce.apps.cli", "demo", "--out",
                           str(tmp_path)], cwd=ROOT, capture_output=True, text=True,
                          timeout=900)
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert (f"{1 + 2 * layers} plain torch.compile -> {1 + layers} fxcoalesce (counted at run "
            f"time; lower bound {1 + layers})") in out
    assert re.search(r"fxcoalesce, round by round       : (faster in|not faster beyond the "
                     r"noise \(faster in|slower: plain torch.compile faster in) \d+ of "
                     f"{demo.MERGE_ROUNDS} rounds", out), out
    assert re.search(r"measured here                    : (greedy decoding is faster|the "
                     r"smallest tree is faster|neither is faster beyond the noise)", out), out
    assert "ranks agree: True" in out and "decoded greedily" in out
    assert "Warning" not in proc.stderr and "leaked" not in proc.stderr, proc.stderr
    assert labels(out.splitlines()) == labels(readme_demo_block())
    data = json.loads((tmp_path / "demo.json").read_text())
    assert data["speculative"]["text"] and data["speculative"]["text"] in out
    ending = out.splitlines()[-5:-1]  # how to ask the same of one's own model (then "wrote")
    found, seconds = re.search(r"traced just now, ([\d.]+) s: (.+)$", ending[-1]).group(2, 1)
    assert ending == demo.inspect_lines(found, float(seconds))
    shown = readme_demo_block()[-4:]  # the README's block ends the same (the time aside)
    assert [re.sub(r"[\d.]+ s:", "", ln) for ln in ending] == \
        [re.sub(r"[\d.]+ s:", "", ln) for ln in shown]
