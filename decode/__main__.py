import argparse
import sys

from decode.cli import add_args, main

parser = argparse.ArgumentParser(prog="python -m decode")
add_args(parser)
sys.exit(main(parser.parse_args()))
