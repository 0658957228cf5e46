"""`./dev bench` = `python -m bench`: run every benchmark script (each in its own process) and
assemble BENCHMARKS.md from bench/results/*.json.

    python -m bench [--quick] [--only a,b] [--skip a,b] [--no-run]

--quick passes each script its small-run options; --no-run only re-assembles BENCHMARKS.md from
the JSON already in bench/results/. Every script's output goes to bench/results/<name>.log.
A script that fails, or does not (re)write its JSON, is reported as such in BENCHMARKS.md: a
figure is never carried over silently from an older run.
"""

from __future__ import annotations

import argparse
import sys

from bench.common import ROOT
from bench.suite import NAMES, OUT, assemble, run


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    ap = argparse.ArgumentParser(prog="python -m bench", description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="smaller runs of every script")
    ap.add_argument("--only", default="", help="comma-separated benchmark names")
    ap.add_argument("--skip", default="", help="comma-separated benchmark names")
    ap.add_argument("--no-run", action="store_true", help="only assemble BENCHMARKS.md")
    args = ap.parse_args(argv)
    names = [n for n in args.only.split(",") if n] if args.only else list(NAMES)
    names = [n for n in names if n not in set(args.skip.split(","))]
    unknown = set(names) - set(NAMES)
    if unknown:
        sys.exit(f"unknown benchmark(s): {', '.join(sorted(unknown))}; known: {', '.join(NAMES)}")
    status = {} if args.no_run else run(names, args.quick)
    OUT.write_text(assemble(status, args.quick, argv))
    print(f"wrote {OUT.relative_to(ROOT)}")
    if any(s["rc"] != 0 for s in status.values()):
        sys.exit(1)


if __name__ == "__main__":
    main()
