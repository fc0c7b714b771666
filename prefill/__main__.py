import argparse
import sys

from prefill.cli import add_args, main

parser = argparse.ArgumentParser(prog="python -m prefill")
add_args(parser)
sys.exit(main(parser.parse_args()))
