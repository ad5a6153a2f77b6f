"""`python -m bench`: list the benches in this package (run one with `python -m bench.NAME`)."""

from __future__ import annotations

import importlib
import pkgutil
import sys
from pathlib import Path


def main() -> int:
    here = Path(__file__).parent
    for module in sorted(pkgutil.iter_modules([str(here)]), key=lambda m: m.name):
        if module.name.startswith("_"):
            continue
        doc = importlib.import_module(f"bench.{module.name}").__doc__ or ""
        summary = doc.strip().splitlines()[0] if doc.strip() else ""
        print(f"python -m bench.{module.name:<10} {summary}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
