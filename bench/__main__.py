"""`python -m bench`: list the benches in this package (run one with `python -m bench.NAME`);
`python -m bench --all [options]` runs every system on every workload (bench.suite)."""

from __future__ import annotations

import importlib
import pkgutil
import sys
from pathlib import Path


def main() -> int:
    if "--all" in sys.argv[1:]:
        from bench import suite

        return suite.main([a for a in sys.argv[1:] if a != "--all"])
    here = Path(__file__).parent
    for module in sorted(pkgutil.iter_modules([str(here)]), key=lambda m: m.name):
        if module.name.startswith("_"):
            continue
        bench = importlib.import_module(f"bench.{module.name}")
        if not hasattr(bench, "main"):
            continue  # a helper module (bench.systems), not a bench
        doc = bench.__doc__ or ""
        summary = doc.strip().splitlines()[0] if doc.strip() else ""
        print(f"python -m bench.{module.name:<10} {summary}")
    print("python -m bench --all        every system on every workload: bench/RESULTS.md (see bench.suite)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
