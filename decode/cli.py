"""`pdserve decode` = `python -m decode`: the OpenAI server with the decode role's connector."""

from __future__ import annotations

import argparse

from prefill.role import add_role_args, run_role


def add_args(parser: argparse.ArgumentParser) -> None:
    add_role_args(parser, "decode")


def main(args: argparse.Namespace) -> int:
    return run_role(args, "decode")
