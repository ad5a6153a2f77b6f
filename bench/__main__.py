"""`python -m bench`: list the benches (run one with `python -m bench.micro.NAME`);
`python -m bench --all [options]` runs every system on every workload (bench.suite.runner).

Owns: the command line's entry point and the listing. Must not: define or run a bench itself.
"""

from __future__ import annotations

import importlib
import pkgutil
import sys

from bench import micro


def main() -> int:
    if "--all" in sys.argv[1:]:
        from bench.suite import runner

        return runner.main([a for a in sys.argv[1:] if a != "--all"])
    for module in sorted(pkgutil.iter_modules(micro.__path__), key=lambda m: m.name):
        if module.name.startswith("_"):
            continue
        bench = importlib.import_module(f"bench.micro.{module.name}")
        doc = bench.__doc__ or ""
        summary = doc.strip().splitlines()[0] if doc.strip() else ""
        print(f"python -m bench.micro.{module.name:<10} {summary}")
    print("python -m bench --all              every system on every workload: bench/RESULTS.md (bench.suite)")
    print("python -m bench.suite.profile      where the CPU goes in each workload: bench/results/profiles/")
    print("python -m bench.faults             the fault suite (bench/results/faults.md)")
    print("python -m bench.faults --nemesis   faults at random, a standby router (bench/results/issue38/)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
