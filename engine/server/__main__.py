"""`python -m engine.server MODEL_DIR …` = `pdserve serve MODEL_DIR …`."""

import sys

from engine.server.cli import main

if __name__ == "__main__":
    sys.exit(main())
