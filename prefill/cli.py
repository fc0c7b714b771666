"""`pdserve prefill` = `python -m prefill`: the OpenAI server with the prefill role's connector."""

from __future__ import annotations

import argparse

from prefill.role import add_role_args, run_role


def add_args(parser: argparse.ArgumentParser) -> None:
    add_role_args(parser, "prefill")


def main(args: argparse.Namespace) -> int:
    return run_role(args, "prefill")
