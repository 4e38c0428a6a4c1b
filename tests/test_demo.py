"""``fxcoalesce demo --out DIR``: demo.json holds the figures the demo prints."""

import json
from types import SimpleNamespace

from fxcoalesce.apps.demo import DemoOptions, write_demo_json


def rank_result(**extra) -> dict:
    return {"backend": "gloo", "all_reduce": {"before": 12, "after": 9, "lower_bound": 9,
                                              "bytes_before": 1, "bytes_after": 1},
            "verify_median_us": {"without pass": 18500.0, "with pass": 14800.0},
            "compile_s": {"without pass": 11.0, "with pass": 14.0}, "verify_calls": 31,
            "logits_max_abs_diff": 1.3e-6, "matches_greedy": True, "mean_accepted": 1.0,
            "tokens_per_s": 40.0, **extra}


def test_demo_json(tmp_path):
    args = SimpleNamespace(tp=2, out=str(tmp_path / "d"), command_line="fxcoalesce demo")
    path = write_demo_json([rank_result(), rank_result(matches_greedy=False)], DemoOptions(),
                           args)
    data = json.loads(path.read_text())
    assert path == tmp_path / "d/demo.json"
    assert (data["model"], data["tp"]) == ("kimi-k2-tiny", 2)
    assert data["all_reduce"] == {"before": 12, "after": 9, "lower_bound": 9}
    assert data["verify_ms"] == {"without": 18.5, "with": 14.8}
    assert data["compile_s"] == {"without": 11.0, "with": 14.0}  # kept out of verify_ms
    assert data["mean_accepted"] == 1.0
    assert data["logits_max_abs_diff"] == 1.3e-6
    assert data["tokens_equal_target_greedy"] is False  # every rank must match
    assert "text" not in data  # no tokenizer for kimi-k2-tiny


def test_demo_json_has_text_when_the_model_decodes_it(tmp_path):
    args = SimpleNamespace(tp=1, out=str(tmp_path), command_line="")
    path = write_demo_json([rank_result(text="Hello")], DemoOptions(), args)
    assert json.loads(path.read_text())["text"] == "Hello"
