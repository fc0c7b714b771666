"""`python -m proxy ...` is `pdserve proxy ...`."""

import sys

from proxy.cli import run

sys.exit(run())
