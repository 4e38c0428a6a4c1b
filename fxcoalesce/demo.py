"""``fxcoalesce demo``: placeholder until the EAGLE-3 demo lands — inspects neox-tiny."""

from __future__ import annotations

import argparse


def run_demo(args) -> int:
    from fxcoalesce.cli import cmd_inspect

    return cmd_inspect(argparse.Namespace(list=False, model="neox-tiny", tp=4, tokens=3,
                                          step="forward", hand_merged=False,
                                          bucket_cap_mb=512.0, out=None,
                                          layers=None))
