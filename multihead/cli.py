"""Command-line front end: argument parsing only; each command calls into the package."""

from __future__ import annotations

import argparse
import sys


def _positive_int(text: str) -> int:
    """argparse type: an int >= 1 (0 repeats or sentences would measure nothing)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 1, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 1, got {value}")
    return value


def _demo(args: argparse.Namespace) -> int:
    from .demo import run

    run()
    return 0


def _bench(args: argparse.Namespace) -> int:
    if args.decode:
        from .bench.decode import QUICK, DecodeShape, run_decode_bench

        shape = QUICK if args.quick else DecodeShape()
        run_decode_bench(repeats=args.repeats or 3, shape=shape, out_dir=args.out)
        return 0
    if args.embed:
        from .bench.embed import run_embed_bench

        run_embed_bench(count=args.sentences, repeats=args.repeats or 3, out_dir=args.out)
        return 0
    from .bench import run_suite

    run_suite(quick=args.quick, only=args.only, repeats=args.repeats, out_dir=args.out)
    return 0


def _explain(args: argparse.Namespace) -> int:
    from .explain import run

    run(args.text, focus=args.focus, out_dir=args.out, model_path=args.model)
    return 0


def _embed(args: argparse.Namespace) -> int:
    from .embed import run

    run(args.file, args.out, model_path=args.model, max_tokens=args.max_tokens)
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
    bench.add_argument(
        "--repeats", type=_positive_int, default=None, help="timed repeats per contender"
    )
    bench.add_argument("--out", default="bench-results", help="folder for results.json/.png")
    bench.add_argument(
        "--embed",
        action="store_true",
        help="instead: sentence-embedding throughput against sentence-transformers",
    )
    bench.add_argument(
        "--sentences", type=_positive_int, default=2000, help="sentences for --embed (default 2000)"
    )
    bench.add_argument(
        "--decode",
        action="store_true",
        help="instead: greedy decoding tokens/s of a GPT-2-small-shaped model against "
        "transformers generate() (B=1 and B=8, prompt 128, 128 new tokens)",
    )
    bench.set_defaults(func=_bench)
    explain = commands.add_parser(
        "explain", help="show what every head of a pretrained model attends to in TEXT"
    )
    explain.add_argument("text", metavar="TEXT", help="the sentence to explain")
    explain.add_argument("--focus", metavar="WORD", help="the word to follow (default: last)")
    explain.add_argument("--out", default="explain-out", metavar="DIR", help="folder for figures")
    explain.add_argument(
        "--model", metavar="PATH", help="model folder: BERT family, GPT-2 or Llama (config.json)"
    )
    explain.set_defaults(func=_explain)
    embed = commands.add_parser("embed", help="sentence embeddings, one per line of FILE")
    embed.add_argument("file", metavar="FILE", help="UTF-8 text, one sentence per line")
    embed.add_argument("--out", required=True, metavar="OUT.npy", help="where to save them")
    embed.add_argument("--model", metavar="PATH", help="BERT-family model folder")
    embed.add_argument(
        "--max-tokens",
        type=_positive_int,
        default=1536,
        help="tokens per packed row (default 1536)",
    )
    embed.set_defaults(func=_embed)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError, ModuleNotFoundError) as err:
        print(f"multihead {args.command}: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
