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
    from .apps.demo import run

    run()
    return 0


def _bench_kernels(args: argparse.Namespace) -> int:
    from .bench import run_suite

    run_suite(quick=args.quick, only=args.only, repeats=args.repeats, out_dir=args.out)
    return 0


def _bench_embed(args: argparse.Namespace) -> int:
    from .bench.embed import run_embed_bench

    run_embed_bench(
        count=args.sentences,
        repeats=args.repeats or 3,
        out_dir=args.out,
        model_path=args.model,
        onnx_path=args.onnx,
        threads=args.threads,
    )
    return 0


def _bench_decode(args: argparse.Namespace) -> int:
    from .bench.decode import QUICK, DecodeShape, run_decode_bench

    shape = QUICK if args.quick else DecodeShape()
    run_decode_bench(repeats=args.repeats or 3, shape=shape, out_dir=args.out)
    return 0


def _bench_serve(args: argparse.Namespace) -> int:
    from .bench.serve import run_serve_bench

    report = run_serve_bench(
        requests=args.requests,
        clients=args.clients,
        threads=args.threads,
        model_path=args.model,
        out_dir=args.out,
    )
    return 0 if report["ok"] else 1


def _bench_train(args: argparse.Namespace) -> int:
    import json
    from pathlib import Path

    from .apps.throughput import compare
    from .bench.doctor import diagnose

    report = compare(args.tasks, args.variants, steps=args.steps, data=args.data,
                     cpu=diagnose(measure=False).cpu)  # fmt: skip
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "train.json").write_text(json.dumps(report, indent=2) + "\n")
    print(f"written: {out / 'train.json'}")
    return 0


def _bench_context(args: argparse.Namespace) -> int:
    from .bench.context import run_context_bench

    run_context_bench(
        quick=args.quick, processes=args.processes, repeats=args.repeats, out_dir=args.out
    )
    return 0


# The flags that chose a benchmark before 0.2.0, and the sub-command that replaced each; a
# bare option after `bench` (`--quick`, `--only`) belonged to the kernel suite.
_OLD_BENCH_FLAGS = {
    "--embed": "embed",
    "--decode": "decode",
    "--serve": "serve",
    "--context-parallel": "context-parallel",
}


def _old_bench_call(argv: list[str]) -> str | None:
    """The error for a pre-0.2.0 `bench --FLAG` call, or None for a current one."""
    if len(argv) < 2 or argv[0] != "bench" or not argv[1].startswith("-"):
        return None
    if argv[1] in ("-h", "--help"):
        return None
    chosen = [_OLD_BENCH_FLAGS[a] for a in argv[1:] if a in _OLD_BENCH_FLAGS]
    if len(chosen) > 1:
        return (
            "bench runs one benchmark at a time: expected one sub-command, use "
            + " and ".join(f"'multihead bench {c}'" for c in chosen)
            + f" as separate runs. Received: {' '.join(argv)}"
        )
    sub = chosen[0] if chosen else "kernels"
    rest = [a for a in argv[1:] if a not in _OLD_BENCH_FLAGS]
    return (
        f"bench takes a sub-command first (kernels, embed, decode, serve, context-parallel): "
        f"use 'multihead bench {' '.join([sub, *rest])}'. Received: {' '.join(argv)}"
    )


def _doctor(args: argparse.Namespace) -> int:
    from .bench.doctor import run

    return 0 if run(measure=not args.no_measure).built else 1


def _explain(args: argparse.Namespace) -> int:
    from .apps.explain import run

    run(args.text, focus=args.focus, out_dir=args.out, model_path=args.model)
    return 0


def _embed(args: argparse.Namespace) -> int:
    from .apps.embed import run

    run(
        args.file,
        args.out,
        model_path=args.model,
        max_tokens=args.max_tokens,
        ray=args.ray,
        workers=args.workers,
        ray_address=args.ray_address,
        ray_batch_size=args.ray_batch_size,
    )
    return 0


def _export(args: argparse.Namespace) -> int:
    from .export import check_opset, check_target, graph_spec, load_for_export, to_onnx

    check_target(args.out)  # before the model loads and the export runs
    check_opset(args.opset)
    model = load_for_export(args.model)
    path = to_onnx(model, args.out, weights=args.weights, opset=args.opset)
    spec = graph_spec(model, weights=args.weights)
    print(f"wrote {path} ({spec.describe()}); onnx.checker: ok")
    return 0


def _serve(args: argparse.Namespace) -> int:
    import os

    from .serve import Access, Limits, run

    limits = Limits(
        max_batch_tokens=args.max_batch_tokens,
        max_wait_ms=args.max_wait_ms,
        max_client_batch_size=args.max_client_batch_size,
        max_concurrent_requests=args.max_concurrent_requests,
        payload_limit=args.payload_limit,
        max_response_mb=args.max_response_mb,
        header_timeout_s=args.header_timeout,
        body_timeout_s=args.body_timeout,
        drain_timeout_s=args.drain_timeout,
    )
    access = Access(
        api_key=args.api_key or os.environ.get("MULTIHEAD_API_KEY") or None,
        allowed_hosts=tuple(args.allowed_hosts),
        cors_origin=args.cors_origin,
    )
    run(
        model_path=args.model,
        runtime=args.runtime,
        onnx_path=args.onnx,
        host=args.host,
        port=args.port,
        limits=limits,
        access=access,
        threads=args.threads,
        say=lambda line: print(line, flush=True),
    )
    return 0


def _train(args: argparse.Namespace) -> int:
    from .apps import Options, run

    options = Options(
        out=args.out,
        quick=args.quick,
        data=args.data,
        seed=args.seed,
        precision=args.precision,
        compile=args.compile,
        epochs=args.epochs,
        max_steps=args.max_steps,
        baselines=not args.no_baselines,
        progress=not args.no_progress,
        overwrite=args.overwrite,
    )
    run(args.task, options)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="multihead", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    demo = commands.add_parser(
        "demo", help="walk through multi-head attention on 'cat catches mouse', step by step"
    )
    demo.set_defaults(func=_demo)
    bench = commands.add_parser(
        "bench", help="benchmarks: kernels, embed, decode, serve, context-parallel"
    )
    benches = bench.add_subparsers(dest="benchmark", required=True, metavar="BENCHMARK")

    def add_bench(
        name: str, help_text: str, func, *, repeats: bool = True
    ) -> argparse.ArgumentParser:
        sub = benches.add_parser(name, help=help_text)
        sub.add_argument("--out", default="bench-results", help="folder for the results")
        if repeats:
            sub.add_argument(
                "--repeats", type=_positive_int, default=None, help="timed repeats per contender"
            )
        sub.set_defaults(func=func)
        return sub

    kernels = add_bench(
        "kernels",
        "time multihead against torch SDPA, the naive formula and FlexAttention",
        _bench_kernels,
    )
    kernels.add_argument("--quick", action="store_true", help="small sizes, under a minute")
    kernels.add_argument("--only", nargs="+", metavar="WORKLOAD", help="run only these workloads")
    embed = add_bench(
        "embed", "sentence-embedding throughput against sentence-transformers", _bench_embed
    )
    embed.add_argument(
        "--sentences", type=_positive_int, default=2000, help="sentences (default 2000)"
    )
    embed.add_argument("--threads", type=int, default=None, help="torch/onnxruntime threads")
    embed.add_argument("--model", metavar="PATH", help="BERT-family model folder")
    embed.add_argument(
        "--onnx", metavar="FILE.onnx", help="time this exported graph (default: export)"
    )
    decode = add_bench(
        "decode",
        "greedy decoding tokens/s of a GPT-2-small-shaped model against transformers "
        "generate() (B=1 and B=8, prompt 128, 128 new tokens)",
        _bench_decode,
    )
    decode.add_argument("--quick", action="store_true", help="a small model, seconds")
    serve_bench = add_bench(
        "serve",
        "load-test multihead serve against a FastAPI + sentence-transformers server",
        _bench_serve,
        repeats=False,
    )
    serve_bench.add_argument("--requests", type=int, default=512, help="requests per client count")
    serve_bench.add_argument(
        "--clients", type=int, nargs="+", default=[1, 8, 32], help="concurrent clients"
    )
    serve_bench.add_argument("--threads", type=int, default=None, help="torch/onnxruntime threads")
    serve_bench.add_argument("--model", metavar="PATH", help="BERT-family model folder")
    train_bench = add_bench(
        "train",
        "training samples/s of the train apps: eager fp32 against compiled, bf16 autocast and "
        "both, with graph breaks and the measured matmul peaks",
        _bench_train,
        repeats=False,
    )
    train_bench.add_argument("--tasks", nargs="+", default=["sentiment", "forecast", "crossmodal"],
                             choices=("sentiment", "forecast", "crossmodal"),
                             help="apps to time (default all three)")  # fmt: skip
    train_bench.add_argument("--variants", nargs="+",
                             default=["eager", "compiled", "bf16", "compiled-bf16"],
                             choices=("eager", "compiled", "bf16", "compiled-bf16"),
                             help="step variants (default all four)")  # fmt: skip
    train_bench.add_argument(
        "--steps", type=_positive_int, default=20, help="steps per variant (2 untimed)"
    )
    train_bench.add_argument("--data", metavar="PATH", help="sentiment data (as for train)")
    context = add_bench(
        "context-parallel",
        "one L=131072 sequence across 1, 2, 4 processes (memory and time)",
        _bench_context,
    )
    context.add_argument("--quick", action="store_true", help="a short sequence, seconds")
    context.add_argument(
        "--processes",
        type=_positive_int,
        nargs="+",
        default=[1, 2, 4],
        metavar="P",
        help="process counts (default 1 2 4)",
    )
    doctor = commands.add_parser(
        "doctor",
        help="is the fused C++ kernel built (or why not), the CPU's instruction sets and its "
        "measured fp32/bf16 matmul peaks",
    )
    doctor.add_argument(
        "--no-measure", action="store_true", help="skip timing the matmul peaks (a few seconds)"
    )
    doctor.set_defaults(func=_doctor)
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
    embed.add_argument(
        "--ray", action="store_true", help="run on Ray Data: an actor pool, each with the model"
    )
    embed.add_argument("--workers", type=_positive_int, default=2, help="Ray actors (default 2)")
    embed.add_argument(
        "--ray-address", metavar="ADDR", help="an existing Ray cluster (default: start one here)"
    )
    embed.add_argument(
        "--ray-batch-size",
        type=_positive_int,
        default=256,
        help="lines per Ray batch (default 256)",
    )
    embed.set_defaults(func=_embed)
    train = commands.add_parser(
        "train",
        help="train an application (sentiment, forecast, crossmodal) with baselines; "
        "runs under torchrun for several processes",
    )
    train.add_argument("task", choices=("sentiment", "forecast", "crossmodal"))
    train.add_argument(
        "--out",
        required=True,
        metavar="DIR",
        help="folder for model and metrics: new or empty; written whole when the run ends",
    )
    train.add_argument(
        "--overwrite", action="store_true", help="replace a previous run in DIR when this one ends"
    )
    train.add_argument("--quick", action="store_true", help="a small version, seconds long")
    train.add_argument(
        "--data",
        metavar="PATH",
        help="sentiment: a folder of *_GroundTruth.txt files or one such file "
        "(default ../shared/data/vader-sentiment)",
    )
    train.add_argument("--seed", type=int, default=0, help="seed for data, init and order")
    train.add_argument("--precision", choices=("auto", "fp32", "bf16", "fp16"), default="auto",
                       help="autocast dtype; auto: bf16 where this machine's bf16 matmuls "
                       "measure faster than fp32, else fp32 (fp16 on CUDA only)")  # fmt: skip
    train.add_argument("--compile", action="store_true", help="torch.compile the train step")
    train.add_argument("--epochs", type=_positive_int, help="override the task's number of epochs")
    train.add_argument(
        "--max-steps", type=_positive_int, help="stop after this many optimizer steps"
    )
    train.add_argument("--no-baselines", action="store_true", help="skip the baselines")
    train.add_argument("--no-progress", action="store_true", help="no progress bar")
    train.set_defaults(func=_train)
    export = commands.add_parser("export", help="export a model for other runtimes")
    formats = export.add_subparsers(dest="format", required=True)
    onnx = formats.add_parser(
        "onnx",
        help="BERT-family model, or GPT-2 / Llama decoder with past and present key/value, "
        "-> ONNX with dynamic batch and sequence axes",
    )
    onnx.add_argument(
        "--model", metavar="PATH", help="model folder: BERT family, GPT-2 or Llama (config.json)"
    )
    onnx.add_argument("--out", required=True, metavar="FILE.onnx", help="where to write it")
    onnx.add_argument(
        "--weights", action="store_true", help="also output every layer's per-head weights"
    )
    onnx.add_argument("--opset", type=int, default=18, help="ONNX opset version (default 18)")
    onnx.set_defaults(func=_export)
    serve = commands.add_parser(
        "serve", help="HTTP service: embeddings (TEI and OpenAI formats), attention, metrics"
    )
    serve.add_argument("--model", metavar="PATH", help="BERT-family model folder")
    serve.add_argument("--runtime", choices=["torch", "onnx"], default="torch")
    serve.add_argument(
        "--onnx",
        metavar="FILE.onnx",
        help="with --runtime onnx: a graph from 'export onnx --weights' (default: export now)",
    )
    serve.add_argument("--host", default="127.0.0.1", help="address to listen on")
    serve.add_argument("--port", type=int, default=8080, help="0 picks a free port")
    serve.add_argument(
        "--max-batch-tokens", type=int, default=16384, help="most tokens in one model batch"
    )
    serve.add_argument(
        "--max-wait-ms", type=float, default=2.0, help="how long a request waits for company"
    )
    serve.add_argument(
        "--max-client-batch-size", type=int, default=32, help="most texts in one request"
    )
    serve.add_argument(
        "--max-concurrent-requests", type=int, default=512, help="more at once get 429"
    )
    serve.add_argument(
        "--payload-limit", type=int, default=2_000_000, help="most bytes per body (else 413)"
    )
    serve.add_argument(
        "--max-response-mb",
        type=float,
        default=16.0,
        help="most MB per response, else 413 asking for fewer layers, heads or tokens",
    )
    serve.add_argument(
        "--header-timeout",
        type=float,
        default=10.0,
        metavar="S",
        help="seconds to send a request's header, else the connection closes (default 10)",
    )
    serve.add_argument(
        "--body-timeout",
        type=float,
        default=30.0,
        metavar="S",
        help="seconds to send a request's body after its header, else 408 (default 30)",
    )
    serve.add_argument(
        "--drain-timeout",
        type=float,
        default=20.0,
        metavar="S",
        help="on SIGTERM, requests still queued after S seconds get 503 (default 20)",
    )
    serve.add_argument(
        "--api-key",
        default=None,
        metavar="KEY",
        help="require 'Authorization: Bearer KEY' on every route but /health "
        "(default: $MULTIHEAD_API_KEY; the environment keeps it out of the process list)",
    )
    serve.add_argument(
        "--allowed-hosts",
        nargs="+",
        default=[],
        metavar="NAME",
        help="Host names answered besides localhost, 127.0.0.1 and [::1] when listening on "
        "a loopback address ('*': any)",
    )
    serve.add_argument(
        "--cors-origin",
        default=None,
        metavar="ORIGIN",
        help="the browser origin (https://app.example, or '*') allowed to read answers; "
        "default: no CORS headers",
    )
    serve.add_argument("--threads", type=int, default=None, help="torch/onnxruntime threads")
    serve.set_defaults(func=_serve)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    old = _old_bench_call(sys.argv[1:] if argv is None else argv)
    if old is not None:
        print(f"multihead bench: error: {old}", file=sys.stderr)
        return 2
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError, ModuleNotFoundError) as err:
        print(f"multihead {args.command}: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        # Ctrl-C: one line, no traceback, the shell's exit status for SIGINT (128 + 2); what
        # the command writes is written whole or not at all, so nothing is half-written
        print(f"multihead {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
