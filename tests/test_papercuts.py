"""Small things a new user met first (issue 51, item 5), each kept fixed."""

from __future__ import annotations

import pytest

from fxcoalesce import Config
from fxcoalesce.apps import cli
from fxcoalesce.apps.defaults import parameters_text


@pytest.mark.parametrize("argv, verbose, quiet", [
    (["inspect", "-q", "--model", "neox-tiny"], False, True),
    (["inspect", "--model", "neox-tiny", "--verbose"], True, False),
    (["bench", "-v", "-q"], True, True),
    (["-v", "inspect", "--model", "neox-tiny"], True, False),   # before the command, as ever
    (["-q", "demo"], False, True),
    (["inspect", "--model", "neox-tiny"], False, False),
])
def test_verbose_and_quiet_are_taken_after_the_command_too(argv, verbose, quiet):
    """Regression: ``fxcoalesce inspect -q ...`` was refused (give it before the command)."""
    args = cli._parse(cli.parser(), argv)
    assert (args.verbose, args.quiet) == (verbose, quiet)


def test_a_mistyped_zoo_name_gets_the_closest():
    from fxcoalesce import models

    with pytest.raises(ValueError, match=r"^unknown model 'neox-tiy'; did you mean 'neox-tiny'\? "
                                         r"choose one of: llama-tiny, neox-tiny"):
        models.family_of("neox-tiy")
    with pytest.raises(ValueError, match=r"^unknown model 'no-such-model'; choose one of: "):
        models.family_of("no-such-model")


def test_an_unknown_hf_type_suggests_model_types_only():
    """Regression: ``--hf notamodel`` suggested "EvollaModel" (a class name transformers 5.25
    lists among its model types)."""
    transformers = pytest.importorskip("transformers")
    from fxcoalesce.apps.inspect.hf import _unknown_type

    far = str(_unknown_type("notamodel", transformers, "notamodel"))
    assert far.endswith("knows no model type 'notamodel'") and "Model" not in far
    near = str(_unknown_type("gpt-neox", transformers, "gpt-neox"))
    assert "; close: gpt_neox" in near


def test_parameter_counts_read_at_any_size():
    """Regression: a 2.1M-parameter model printed "0.00B parameters"."""
    assert [parameters_text(n) for n in (1_026_410_000_000, 3_780_000_000, 2_100_000, 12_345,
                                         512)] == ["1026.41B", "3.78B", "2.1M", "12.3K", "512"]


def test_a_positional_config_argument_names_the_fix():
    """Regression: ``Config(False)`` gave Python's "takes 1 positional argument but 2 were
    given"."""
    with pytest.raises(TypeError, match=r"^Config\(\) takes keyword arguments only, e.g. "
                                        r"Config\(passes=\.\.\.\), not Config\(False\); its "
                                        r"fields: passes, "):
        Config(False)
