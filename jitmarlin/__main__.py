"""`python -m jitmarlin ...` runs the `jitmarlin` command (see jitmarlin.cli)."""

import sys

from .cli import main

if __name__ == "__main__":
    sys.exit(main())
