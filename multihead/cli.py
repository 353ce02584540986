"""Command-line front end: argument parsing only; each command calls into the package."""

from __future__ import annotations

import argparse
import sys


def _demo(args: argparse.Namespace) -> int:
    from .demo import run

    run()
    return 0


def _bench(args: argparse.Namespace) -> int:
    from .bench import run_suite

    run_suite(quick=args.quick, only=args.only, repeats=args.repeats, out_dir=args.out)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="multihead", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    demo = commands.add_parser(
        "demo", help="walk through multi-head attention on 'cat catches mouse', step by step"
    )
    demo.set_defaults(func=_demo)
    bench = commands.add_parser(
        "bench", help="time multihead against torch SDPA, the naive formula and FlexAttention"
    )
    bench.add_argument("--quick", action="store_true", help="small sizes, under a minute")
    bench.add_argument("--only", nargs="+", metavar="WORKLOAD", help="run only these workloads")
    bench.add_argument("--repeats", type=int, default=None, help="timed repeats per contender")
    bench.add_argument("--out", default="bench-results", help="folder for results.json/.png")
    bench.set_defaults(func=_bench)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
