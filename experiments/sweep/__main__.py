"""``python -m experiments.sweep``: the command line of :mod:`experiments.sweep.cli`, also each child's entry."""

import sys

from experiments.sweep.cli import main

if __name__ == "__main__":
    sys.exit(main())
