"""``fxcoalesce demo --out DIR``: demo.json holds the figures the demo prints."""

import json
from types import SimpleNamespace

import pytest

from fxcoalesce.apps.demo import DemoOptions, summary, write_demo_json


def rank_result(**extra) -> dict:
    return {"backend": "gloo", "all_reduce": {"before": 12, "after": 9, "lower_bound": 9,
                                              "bytes_before": 1, "bytes_after": 1},
            "verify_median_us": {"without pass": 18500.0, "with pass": 14800.0},
            "verify_p10_p90_us": {"without pass": (17000.0, 21000.0),
                                  "with pass": (13000.0, 16000.0)},
            "pass_ms": {"pipeline": 30.4, "ladder": 2.0, "exchange": 9.1, "total": 41.5},
            "verify_calls": 31,
            "logits_max_abs_diff": 1.3e-6, "matches_greedy": True, "mean_accepted": 1.0,
            "tokens_per_s": 40.0, "tokens": [1, 2], **extra}


def test_demo_json(tmp_path):
    args = SimpleNamespace(tp=2, out=str(tmp_path / "d"), command_line="fxcoalesce demo")
    path = write_demo_json([rank_result(), rank_result(matches_greedy=False)], DemoOptions(),
                           args)
    data = json.loads(path.read_text())
    assert path == tmp_path / "d/demo.json"
    assert (data["model"], data["tp"]) == ("kimi-k2-tiny", 2)
    assert data["all_reduce"] == {"before": 12, "after": 9, "lower_bound": 9}
    assert data["verify_ms"] == {"without": 18.5, "with": 14.8}
    # what the pass added inside its compile, not the compiles' totals (they follow the load)
    assert data["pass_ms"] == {"pipeline": 30.4, "ladder": 2.0, "exchange": 9.1, "total": 41.5}
    assert "compile_s" not in data
    assert data["verify_ms_p10_p90"] == {"without": [17.0, 21.0], "with": [13.0, 16.0]}
    assert data["verify_within_noise"] is False  # 13-16 ms against 17-21 ms
    assert data["mean_accepted"] == 1.0
    assert data["logits_max_abs_diff"] == 1.3e-6
    assert data["tokens_equal_target_greedy"] is False  # every rank must match
    assert "text" not in data  # no tokenizer for kimi-k2-tiny


def test_demo_json_has_text_when_the_model_decodes_it(tmp_path):
    args = SimpleNamespace(tp=1, out=str(tmp_path), command_line="")
    path = write_demo_json([rank_result(text="Hello")], DemoOptions(), args)
    assert json.loads(path.read_text())["text"] == "Hello"


@pytest.mark.parametrize("with_range, noise", [((13000.0, 16000.0), False),
                                               ((13000.0, 17000.0), True)])
def test_summary_prints_spreads_and_what_the_pass_cost_in_its_compile(with_range, noise):
    r = rank_result()
    r["verify_p10_p90_us"]["with pass"] = with_range
    text = summary([r], DemoOptions(), 2)
    assert ("18.50 ms (17.00-21.00) without the pass, 14.80 ms (13.00-"
            f"{with_range[1] / 1e3:.2f}) with it (31 calls each") in text
    assert text.count("within noise") == noise  # the ranges touch at 17 ms
    assert ("fxcoalesce inside the compile  : 41.5 ms (pipeline 30.4 ms, agreeing 11.1 ms) (a "
            "compile's total follows the load and the order of compiles: not compared)") in text
    assert " s without the pass" not in text  # no compile totals side by side


def test_the_main_jobs_last_lines_point_to_inspect(monkeypatch, capsys):
    """``fxcoalesce demo`` ends with how to ask the same of one's own model: the two doors of
    ``fxcoalesce inspect`` and what it said of a zoo model in this run. The ranks, the weights
    and the trace are stood in for here (tests/test_tour.py runs the trace and the demo)."""
    from fxcoalesce.apps import launch, tour
    from fxcoalesce.apps.spec import demo as spec_demo
    from fxcoalesce.apps.spec.demo import SmolRun
    from fxcoalesce.apps.spec.specdecode import SpecOptions

    options = SpecOptions(gguf="", draft="", prompts=((1,),), greedy_compiled=False,
                          codegen="eager")
    summary = {"all_reduce_per_call": {"spec": {"before": 61, "after": 61, "lower_bound": 61}},
               "verdict": {"spec": "already at its bound"}, "pass_ms": {},
               "mean_accepted": 2.0, "tokens_per_s": {"speculative": 3.0, "target_greedy": 6.0},
               "speedup_vs_target_greedy": 0.5, "ranks_agree": True, "backend": "gloo",
               "device": "cpu"}

    class Job:
        def describe(self, tp):
            return "speculative decoding: smollm2-135m"

        def finish(self, ranks):
            assert ranks == ["spec 0", "spec 1"]
            return SmolRun(summary, {"spec_tokens": 8, "same_tokens": True}, "Blue light.",
                           False, options)

    Job.options = options
    monkeypatch.setattr(spec_demo, "prepare_smollm2", lambda **kw: Job())
    monkeypatch.setattr(launch, "spawn", lambda fn, world, args, **kw: [
        {"merge": {"rank": r}, "spec": f"spec {r}"} for r in range(world)])
    found = "all_reduce launches  5 -> 3  (lower bound 3), reached the lower bound"
    monkeypatch.setattr(tour, "inspect_example", lambda say=None: (found, 1.5))
    args = SimpleNamespace(tp=2, device="cpu", backend=None, codegen=None, tokens=None,
                           prompt=None, draft=None, quiet=True, out=None, command_line="")
    assert tour.run_tour(args) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[-5].startswith("wall time ")
    assert out[-4].startswith("Your own model: `fxcoalesce inspect` says what fxcoalesce "
                              "would merge in it")
    assert out[-3].startswith("  fxcoalesce inspect --model path/to/file.py:factory --tp N ")
    assert out[-2].startswith("  fxcoalesce inspect --hf <model type or config.json> --tp N ")
    assert out[-1].startswith(f"  {tour.INSPECT_EXAMPLE} ")
    assert out[-1].endswith(f"   traced just now, 1.5 s: {found}")
    assert ["  Q: Why is the sky blue?", "  A: Blue light."] == out[out.index("  Q: Why is "
                                                                         "the sky blue?"):][:2]
    # the commands it shows parse as written, their placeholders filled in
    from fxcoalesce.apps.cli import parser

    for line in out[-3:]:
        command = line.strip().split("   ")[0].replace("<model type or config.json>", "cohere")
        args = parser().parse_args(command.replace(" N", " 8").split()[1:])
        assert (args.cmd, args.tp) == ("inspect", 8), command
