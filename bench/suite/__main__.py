"""`python -m bench.suite [options]`: the same as `python -m bench --all [options]` (bench.suite.runner).

Owns the entry point only. Must not: do anything but call `runner.main`.
"""

from __future__ import annotations

import sys

from bench.suite.runner import main

if __name__ == "__main__":
    sys.exit(main())
