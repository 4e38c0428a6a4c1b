"""``Config`` checks every field when it is made: a wrong type or value is a clear
``TypeError`` or ``ValueError`` there, not a surprise at the first compiled call."""

import os
from pathlib import Path

import pytest

from fxcoalesce.config import Config, CostModel, ProfileError


@pytest.mark.parametrize("kwargs, error, message", [
    # regression: a non-empty string counted as true
    ({"reassociate": "no"}, TypeError, "reassociate must be True or False, not 'no'"),
    ({"strict": 1}, TypeError, "strict must be True or False, not 1"),
    ({"slack_aware": None}, TypeError, "slack_aware must be True or False, not None"),
    ({"check_ranks": "yes"}, TypeError, "check_ranks must be True or False, not 'yes'"),
    # regression: True was taken as a cap of 1 MB
    ({"bucket_cap_mb": True}, TypeError, "bucket_cap_mb must be a number of MB, not True"),
    ({"bucket_cap_mb": "64"}, TypeError, "bucket_cap_mb must be a number of MB, not '64'"),
    # regression: "Value after * must be an iterable" at the first compile
    ({"passes": None}, TypeError, "passes must be a tuple (or list) of pass names, e.g. "
     "('bucket',), not None"),
    ({"disable": ("slice", 1)}, TypeError, "disable must be a tuple (or list) of pass names, "
     "e.g. ('bucket',), not ('slice', 1)"),
    ({"passes": {"bucket"}}, TypeError, "passes must be a tuple (or list) of pass names, e.g. "
     "('bucket',), not {'bucket'}"),  # a set has no order
    ({"disable": "slice"}, ValueError, "disable is a tuple of pass names, e.g. ('bucket',), "
     "not the string 'slice'"),
    ({"codegen": None}, ValueError, "codegen must be 'inductor' or 'eager', not None"),
    # regression: these two failed only at the first call, inside BackendCompilerFailed
    ({"cost": "ring"}, TypeError, "cost must be a CostModel (e.g. CostModel.from_profile("
     "'profile.json')), not 'ring'"),
    ({"dump_dir": 123}, TypeError, "dump_dir must be a directory (str or os.PathLike) or None, "
     "not 123"),
    ({"dump_dir": ""}, ValueError, "dump_dir is empty; None (the default) dumps nothing"),
    # regression: a misspelt pass was taken, and failed only when the backend was made
    ({"passes": ("bucket", "linarity")}, ValueError, "unknown pass name 'linarity' in passes; "
     "did you mean 'linearity'? known: bucket, fuse_norm, linearity, lower, schedule, slice, split"),
    ({"disable": ["Schedule"]}, ValueError, "unknown pass name 'Schedule' in disable; did you "
     "mean 'schedule'? known: bucket, fuse_norm, linearity, lower, schedule, slice, split"),
    ({"passes": ("nope",)}, ValueError, "unknown pass name 'nope' in passes; known: bucket, "
     "fuse_norm, linearity, lower, schedule, slice, split"),
    # regression: Python's own "unexpected keyword argument", with no hint
    ({"reasociate": False}, TypeError, "Config() got an unexpected keyword argument "
     "'reasociate'; did you mean 'reassociate'?"),
    ({"bucket_cap": 64}, TypeError, "Config() got an unexpected keyword argument 'bucket_cap'; "
     "did you mean 'bucket_cap_mb'?"),
    ({"speed": "max"}, TypeError, "Config() got an unexpected keyword argument 'speed'; its "
     "fields: passes, disable, bucket_cap_mb, reassociate, strict, codegen, dump_dir, "
     "slack_aware, check_ranks, agree_timeout_s, cost, dump_passes, run_checks, token_split, "
     "lower"),
])
def test_config_refuses(kwargs, error, message):
    with pytest.raises(error) as info:
        Config(**kwargs)
    assert str(info.value) == message


def test_a_misspelt_field_names_the_closest_everywhere_a_config_is_made():
    """``dataclasses.replace`` and ``CostModel`` take the same hint; the signature stays."""
    import dataclasses
    import inspect

    with pytest.raises(TypeError, match=r"^Config\(\) got an unexpected keyword argument "
                       r"'strictt'; did you mean 'strict'\?$"):
        dataclasses.replace(Config(), strictt=True)
    with pytest.raises(TypeError, match=r"^CostModel\(\) got an unexpected keyword argument "
                       r"'bandwidth_gbs'; did you mean 'bandwidth_gbps'\?$"):
        CostModel(bandwidth_gbs=10.0)
    assert "reassociate" in inspect.signature(Config).parameters
    assert Config(reassociate=False).reassociate is False


def test_default_passes_are_the_registry():
    """``Config`` checks names against ``DEFAULT_PASSES`` (it imports no pass): it must list
    every registered pass."""
    from fxcoalesce.config import DEFAULT_PASSES
    from fxcoalesce.passes import PASSES

    assert sorted(DEFAULT_PASSES) == sorted(PASSES)


def test_a_list_of_pass_names_is_kept_as_a_tuple():
    cfg = Config(passes=["bucket", "schedule"], disable=["schedule"])
    assert cfg.passes == ("bucket", "schedule") and cfg.disable == ("schedule",)
    assert cfg.enabled_passes == ("bucket",)
    assert hash(cfg) == hash(Config(passes=("bucket", "schedule"), disable=("schedule",)))


def test_right_types_are_taken(tmp_path):
    cfg = Config(reassociate=False, strict=True, slack_aware=False, check_ranks=True,
                 bucket_cap_mb=64, codegen="eager", dump_dir=Path(tmp_path),
                 cost=CostModel(base_us=1.0))
    assert os.fspath(cfg.dump_dir) == str(tmp_path) and cfg.bucket_cap_bytes == 64 << 20



def test_a_directory_is_not_a_profile(tmp_path):
    """Regression: ``FXCOALESCE_PROFILE=/tmp`` was reported as "no such file"."""
    with pytest.raises(ProfileError) as info:
        CostModel.from_profile(tmp_path)
    assert str(info.value) == (f"cost profile {tmp_path}: a directory, not a profile file; "
                               "make one with `fxcoalesce calibrate --tp N --out PATH`")
