"""``python -m lowbit ...``: the LowBit command line (see :mod:`lowbit.cli`)."""

import sys

from .cli import main

if __name__ == "__main__":
    sys.exit(main())
