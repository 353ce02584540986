"""The ``multihead`` command: parses the command line and calls the job that does the work (the
jobs live in ``multihead.apps``, ``multihead.bench``, ``multihead.export`` and
``multihead.serve``)."""

from __future__ import annotations

import argparse
import difflib
import re
import sys
import textwrap

from ._version import __version__

DESCRIPTION = """\
multihead: multi-head attention for PyTorch, from the command line.

Look inside a pretrained model (explain), turn sentences into vectors (embed), train the
example applications (train), ship a model (export, serve) and measure speed (bench, doctor).
Everything runs offline on the CPU; a GPU is used when present."""

EPILOG = """\
examples:
  multihead explain "The animal didn't cross the street because it was too tired" --focus it
  multihead train forecast --quick --out forecast-run
  multihead bench kernels --quick

'multihead COMMAND --help' lists a command's options and their defaults."""


class _HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Descriptions as written, and every option's default shown after its help: the
    defaults a user would otherwise look up in the source. Flags (default False), options
    without a default (None) and helps that already state theirs are left as they are."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        default = action.default
        if (
            default is None
            or default is False
            or default == argparse.SUPPRESS
            or "(default" in text
            or not action.option_strings
        ):
            return text
        if isinstance(default, (list, tuple)):
            default = " ".join(str(d) for d in default)
        return f"{text} (default: {str(default).replace('%', '%%')})"


class _Parser(argparse.ArgumentParser):
    """The top-level parser: help with defaults on it and on every sub-command's parser."""

    def __init__(self, *args, **kwargs) -> None:
        kwargs.setdefault("formatter_class", _HelpFormatter)
        super().__init__(*args, **kwargs)


class _CommandParser(_Parser):
    """A sub-command's parser: an option it does not know is reported with this command's
    usage (and the nearest option it has), not with the top-level usage argparse would give,
    and before a missing required option."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._unknown: list[str] = []

    def parse_known_args(self, args=None, namespace=None):
        args = sys.argv[1:] if args is None else list(args)
        self._unknown = [] if self._subparsers else _unknown_options(self, args)
        parsed, extras = super().parse_known_args(args, namespace)
        unknown = [a for a in extras if a.startswith("-")]
        if extras:
            self.error(_unrecognized(self, extras, unknown[0] if unknown else None))
        return parsed, extras

    def error(self, message: str):
        if self._unknown and message.startswith("the following arguments are required"):
            message = _unrecognized(self, self._unknown, self._unknown[0])
        super().error(message)


_NUMBER = re.compile(r"^-\d+$|^-\d*\.\d+$")


def _unknown_options(parser: argparse.ArgumentParser, args: list[str]) -> list[str]:
    """The arguments that look like options ``parser`` does not have (a unique prefix of one
    of its long options counts as that option, as argparse allows)."""
    known = parser._option_string_actions
    unknown = []
    for arg in args:
        if arg == "--":
            break
        name = arg.split("=", 1)[0]
        if not arg.startswith("-") or arg == "-" or _NUMBER.match(arg) or name in known:
            continue
        if name.startswith("--") and any(o.startswith(name) for o in known):
            continue
        unknown.append(arg)
    return unknown


def _unrecognized(parser: argparse.ArgumentParser, extras: list[str], first: str | None) -> str:
    message = f"unrecognized arguments: {' '.join(extras)}"
    if first is None:
        return message
    known = [o for o in parser._option_string_actions if o.startswith("--")]
    close = difflib.get_close_matches(first.split("=", 1)[0], known, n=1, cutoff=0.6)
    return message + (f" (did you mean {close[0]}?)" if close else "")


def _command(
    commands: argparse._SubParsersAction, name: str, summary: str, description: str | None = None
) -> argparse.ArgumentParser:
    """A sub-command: ``summary`` is its line in the list of commands, ``description`` (default:
    the summary) opens its own --help, wrapped unless it has line breaks of its own."""
    text = description or summary
    if "\n" not in text:
        text = textwrap.fill(text[0].upper() + text[1:], 88)
    return commands.add_parser(name, help=summary, description=text)


def _positive_int(text: str) -> int:
    """argparse type: an int >= 1 (0 repeats or sentences would measure nothing)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 1, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 1, got {value}")
    return value


def _generate(args: argparse.Namespace) -> int:
    from .apps import generate

    def write(piece: str) -> None:
        sys.stdout.write(piece)
        sys.stdout.flush()  # each piece as soon as its tokens are produced

    generate.check_options(args.max_new_tokens, args.temperature, args.top_k, args.top_p)
    generate.run(
        args.model,
        args.prompt,
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        seed=args.seed,
        write=write,
    )
    sys.stdout.write("\n")
    return 0


def _walkthrough(args: argparse.Namespace) -> int:
    from .apps.demo import run

    if args.command == "demo":  # the name before 0.2.0, kept working
        print(
            "note: 'multihead demo' is now 'multihead walkthrough' ('make demo' is another "
            "thing: it installs and explains a sentence on a real model)",
            file=sys.stderr,
        )
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
    if (args.model is None) != (args.text is None):
        raise SystemExit("bench decode: --model and --text go together (a trained model folder "
                         "and held-out text for the quality rows)")  # fmt: skip
    run_decode_bench(
        repeats=args.repeats or 3,
        shape=shape,
        out_dir=args.out,
        model=args.model,
        text=args.text,
    )
    return 0


def _bench_hf(args: argparse.Namespace) -> int:
    from .bench.hf import run_hf_bench

    run_hf_bench(repeats=args.repeats or 3, quick=args.quick, out_dir=args.out)
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
        "bench takes a sub-command first (kernels, embed, decode, serve, train, "
        f"context-parallel): use 'multihead bench {' '.join([sub, *rest])}'. "
        f"Received: {' '.join(argv)}"
    )


def _doctor(args: argparse.Namespace) -> int:
    from .bench.doctor import run

    return 0 if run(measure=not args.no_measure).built else 1


def _explain(args: argparse.Namespace) -> int:
    from .apps.explain import run

    run(
        args.text,
        focus=args.focus,
        out_dir=args.out,
        model_path=args.model,
        layer=args.layer,
        head=args.head,
    )
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
    from ._progress import stages
    from .export import check_opset, check_target, graph_spec, load_for_export, to_onnx

    check_target(args.out)  # before the model loads and the export runs
    check_opset(args.opset)
    with stages("export onnx", ("loading the model", "exporting and checking")) as (bar, _):
        bar.begin("loading the model")
        model = load_for_export(args.model)
        bar.begin("exporting and checking")
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
        arch=args.arch,
        vocab_size=args.vocab_size,
    )
    metrics = run(args.task, options)
    if metrics:  # empty on every process but the first under torchrun
        from .apps.summary import summarize

        print(summarize(metrics, options.out))
    return 0


def _data_download(args: argparse.Namespace) -> int:
    from .data import DownloadError, download

    try:
        download(args.dataset, source=args.source)
    except DownloadError as err:  # the network or the mirror: not a usage error
        print(f"multihead data download: error: {err}", file=sys.stderr)
        return 1
    return 0


def _add_data(commands: argparse._SubParsersAction) -> None:
    """``multihead data download NAME [--from URL]``: one call to ``multihead.data.download``."""
    from .data import DATASETS, ENV

    data = _command(commands, "data", "download the data sets the train applications read")
    actions = data.add_subparsers(dest="action", required=True, metavar="ACTION")
    download = _command(
        actions,
        "download",
        "fetch a data set into the cache, each file checked against its SHA-256 digest",
        "Fetch a data set into ~/.cache/multihead/data (the folder $" + ENV + " names, when\n"
        "set). Every file is checked against the SHA-256 digest recorded in multihead and\n"
        "written whole; files already there and intact are kept.\n"
        + "\n".join(
            textwrap.fill(f"{name}: {d.about}", 88, initial_indent="  ", subsequent_indent="    ")
            for name, d in DATASETS.items()
        ),
    )
    download.add_argument("dataset", choices=sorted(DATASETS), metavar="NAME",
                          help=f"the data set: {', '.join(sorted(DATASETS))}")  # fmt: skip
    download.add_argument(
        "--from",
        dest="source",
        metavar="URL",
        help="a mirror: a base URL (or a folder) holding the same files by name "
        "(default: the data set's public source)",
    )
    download.set_defaults(func=_data_download)


def build_parser() -> argparse.ArgumentParser:
    from .bench.suite import QUICK_SECONDS

    parser = _Parser(prog="multihead", description=DESCRIPTION, epilog=EPILOG)
    parser.add_argument(
        "--version", action="version", version=f"multihead {__version__}", help="print the version"
    )
    commands = parser.add_subparsers(
        dest="command", required=True, metavar="COMMAND", parser_class=_CommandParser
    )
    for name, summary in (
        ("walkthrough", "walk through multi-head attention on 'cat catches mouse', step by step"),
        ("demo", "the former name of walkthrough"),
    ):
        _command(commands, name, summary).set_defaults(func=_walkthrough)
    bench = _command(
        commands,
        "bench",
        "benchmarks: kernels, embed, decode, hf, serve, train, context-parallel",
        "Measure speed against the usual alternatives, in one process on the same inputs. "
        "Each benchmark prints a table and writes results.json (and a PNG where it has one).",
    )
    benches = bench.add_subparsers(dest="benchmark", required=True, metavar="BENCHMARK")

    def add_bench(
        name: str, help_text: str, func, *, repeats: bool = True
    ) -> argparse.ArgumentParser:
        sub = _command(benches, name, help_text)
        sub.add_argument(
            "--out", default="bench-results", metavar="DIR", help="folder for the results"
        )
        if repeats:
            sub.add_argument(
                "--repeats",
                type=_positive_int,
                default=None,
                help="timed repeats per contender (default: 3; kernels: 5, with --quick 3)",
            )
        sub.set_defaults(func=func)
        return sub

    kernels = add_bench(
        "kernels",
        "time multihead against torch SDPA, the naive formula and FlexAttention",
        _bench_kernels,
    )
    kernels.add_argument(
        "--quick",
        action="store_true",
        help=f"a smoke test: small sizes, about {QUICK_SECONDS} s on 2 CPU cores (the first run "
        "on a machine also builds the fused C++ kernel, once); warm-up and call overhead "
        "dominate its ratios, so they are not for comparison",
    )
    kernels.add_argument("--only", nargs="+", metavar="WORKLOAD", help="run only these workloads")
    embed = add_bench(
        "embed", "sentence-embedding throughput against sentence-transformers", _bench_embed
    )
    embed.add_argument("--sentences", type=_positive_int, default=2000, help="sentences to embed")
    embed.add_argument(
        "--threads", type=int, default=None, help="torch/onnxruntime threads (default: all)"
    )
    embed.add_argument(
        "--model", metavar="PATH", help="BERT-family model folder (default: all-MiniLM-L6-v2)"
    )
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
    decode.add_argument(
        "--model", metavar="DIR", help="trained GPT-2/Llama folder: quality rows of bf16/int8"
    )
    decode.add_argument("--text", metavar="FILE", help="held-out UTF-8 text for --model")
    hf = add_bench(
        "hf",
        "transformers models on attn_implementation='multihead' against sdpa, eager (with and "
        "without output_attentions) and flex_attention: Llama-like L=4096, a sliding window "
        "of 256 at L=8192, Gemma-2 soft-capping at L=2048, capture's memory at L=6144",
        _bench_hf,
    )
    hf.add_argument("--quick", action="store_true", help="1/16 of the lengths: a smoke test")
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
    serve_bench.add_argument(
        "--threads", type=int, default=None, help="torch/onnxruntime threads (default: all)"
    )
    serve_bench.add_argument(
        "--model", metavar="PATH", help="BERT-family model folder (default: all-MiniLM-L6-v2)"
    )
    train_bench = add_bench(
        "train",
        "training samples/s of the train apps: eager fp32 against compiled, bf16 autocast, "
        "both, and --precision auto, with graph breaks and the measured matmul peaks",
        _bench_train,
        repeats=False,
    )
    train_bench.add_argument("--tasks", nargs="+", default=["sentiment", "forecast", "crossmodal"],
                             choices=("sentiment", "forecast", "crossmodal"),
                             help="apps to time (default all three)")  # fmt: skip
    train_bench.add_argument("--variants", nargs="+",
                             default=["eager", "compiled", "bf16", "compiled-bf16", "auto"],
                             choices=("eager", "compiled", "bf16", "compiled-bf16", "auto"),
                             help="step variants; auto is --precision auto, which times the "
                             "task's step in fp32 and bf16 first (default all five)")  # fmt: skip
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
        help="process counts",
    )
    doctor = _command(
        commands,
        "doctor",
        "is the fused C++ kernel built (or why not), the CPU's instruction sets and its "
        "measured fp32/bf16 matmul peaks",
    )
    doctor.add_argument(
        "--no-measure", action="store_true", help="skip timing the matmul peaks (a few seconds)"
    )
    doctor.set_defaults(func=_doctor)
    gen = _command(
        commands,
        "generate",
        "continue a prompt with a GPT-2/Llama model folder, printing the text as it is produced",
    )
    gen.add_argument("prompt", metavar="PROMPT", help="the text to continue")
    gen.add_argument("--model", metavar="DIR", required=True,
                     help="a decoder folder (e.g. one written by multihead train lm)")  # fmt: skip
    gen.add_argument("--max-new-tokens", type=_positive_int, default=50, help="tokens to add")
    gen.add_argument("--temperature", type=float, default=0.0,
                     help="0: greedy; above 0: sample at this temperature")  # fmt: skip
    gen.add_argument("--top-k", type=_positive_int, default=None,
                     help="sample among the k most likely tokens")  # fmt: skip
    gen.add_argument(
        "--top-p", type=float, default=None, help="sample from the fewest tokens reaching p"
    )
    gen.add_argument("--seed", type=int, default=0, help="seed of the sampling")
    gen.set_defaults(func=_generate)
    explain = _command(
        commands,
        "explain",
        "show what every head of a pretrained model attends to in TEXT",
        "Run TEXT through a pretrained model with attention weights on; print, for every layer\n"
        "and head, the token the focus word attends to most; write figures (every head, and one\n"
        "head named in its title: --layer/--head, or the one most fixed on one other word) and\n"
        "an HTML head view that works offline.",
    )
    explain.add_argument("text", metavar="TEXT", help="the sentence to explain")
    explain.add_argument("--focus", metavar="WORD", help="the word to follow (default: last)")
    explain.add_argument(
        "--out",
        default="explain-out",
        metavar="DIR",
        help="folder for the figures (its parent must exist)",
    )
    explain.add_argument(
        "--model",
        metavar="PATH",
        help="model folder: BERT family, GPT-2 or Llama, or any architecture transformers "
        "loads with its tokenizer.json (the hf extra) (default: all-MiniLM-L6-v2)",
    )
    explain.add_argument(
        "--layer",
        type=int,
        metavar="N",
        help="draw this layer in head.png and head_surface.png, counted from 0 (default: the "
        "layer of the head most fixed on one other word)",
    )
    explain.add_argument(
        "--head",
        type=int,
        metavar="N",
        help="draw this head of that layer, counted from 0 (default: the head most fixed on one "
        "other word; with --layer alone, that layer's)",
    )
    explain.set_defaults(func=_explain)
    embed = _command(commands, "embed", "sentence embeddings, one per line of FILE")
    embed.add_argument("file", metavar="FILE", help="UTF-8 text, one sentence per line")
    embed.add_argument(
        "--out", required=True, metavar="OUT.npy", help="where to save them (its folder must exist)"
    )
    embed.add_argument(
        "--model", metavar="PATH", help="BERT-family model folder (default: all-MiniLM-L6-v2)"
    )
    embed.add_argument(
        "--max-tokens",
        type=_positive_int,
        default=1536,
        help="tokens per packed row",
    )
    embed.add_argument(
        "--ray", action="store_true", help="run on Ray Data: an actor pool, each with the model"
    )
    embed.add_argument("--workers", type=_positive_int, default=2, help="Ray actors")
    embed.add_argument(
        "--ray-address", metavar="ADDR", help="an existing Ray cluster (default: start one here)"
    )
    embed.add_argument(
        "--ray-batch-size",
        type=_positive_int,
        default=256,
        help="lines per Ray batch",
    )
    embed.set_defaults(func=_embed)
    _add_data(commands)
    train = _command(
        commands,
        "train",
        "train an application (sentiment, forecast, crossmodal, lm) with baselines; "
        "runs under torchrun for several processes",
        "Train one of the example applications and its baselines in the same run, then print\n"
        "their test metrics side by side. DIR receives the saved model, metrics.json and the\n"
        "figures, written whole when the run ends. Several processes:\n"
        "  torchrun --nproc-per-node N $(which multihead) train TASK --out DIR",
    )
    train.add_argument(
        "task",
        choices=("sentiment", "forecast", "crossmodal", "lm"),
        metavar="TASK",
        help="the application: sentiment, forecast, crossmodal or lm (a decoder on --data text)",
    )
    train.add_argument(
        "--out",
        required=True,
        metavar="DIR",
        help="folder for model and metrics: new or empty, in a folder that exists; written "
        "whole when the run ends",
    )
    train.add_argument(
        "--overwrite", action="store_true", help="replace a previous run in DIR when this one ends"
    )
    train.add_argument(
        "--quick",
        action="store_true",
        help="a small version, for a first look and the tests: under half a minute "
        "(forecast, crossmodal) to about 2 minutes (sentiment, lm) on 2 CPU cores",
    )
    train.add_argument(
        "--data",
        metavar="PATH",
        help="sentiment: a folder of *_GroundTruth.txt files or one such file; lm: any UTF-8 "
        "text file or folder (default: the VADER ground truth in the cache, which "
        "'multihead data download vader' fetches)",
    )
    train.add_argument("--seed", type=int, default=0, help="seed for data, init and order")
    train.add_argument("--precision", choices=("auto", "fp32", "bf16", "fp16"), default="auto",
                       help="autocast dtype; auto: bf16 where the model's own training step "
                       "measures faster in bf16 on this machine (timed once, on the first "
                       "batch), else fp32 (fp16 on CUDA only)")  # fmt: skip
    train.add_argument("--compile", action="store_true", help="torch.compile the train step")
    train.add_argument("--epochs", type=_positive_int, help="override the task's number of epochs")
    train.add_argument(
        "--max-steps", type=_positive_int, help="stop after this many optimizer steps"
    )
    train.add_argument("--arch", choices=("gpt2", "llama"), default="gpt2",
                       help="lm: the decoder's shape")  # fmt: skip
    train.add_argument("--vocab-size", type=_positive_int, default=None,
                       help="lm: the BPE vocabulary (default: the recipe's)")  # fmt: skip
    train.add_argument("--no-baselines", action="store_true", help="skip the baselines")
    train.add_argument("--no-progress", action="store_true", help="no progress bars")
    train.set_defaults(func=_train)
    export = _command(commands, "export", "export a model for other runtimes")
    formats = export.add_subparsers(dest="format", required=True, metavar="FORMAT")
    onnx = _command(
        formats,
        "onnx",
        "BERT-family model, or GPT-2 / Llama decoder with past and present key/value, "
        "-> ONNX with dynamic batch and sequence axes",
    )
    onnx.add_argument(
        "--model",
        metavar="PATH",
        help="model folder: BERT family, GPT-2 or Llama, or any architecture transformers "
        "loads with its tokenizer.json (the hf extra) (default: all-MiniLM-L6-v2)",
    )
    onnx.add_argument(
        "--out",
        required=True,
        metavar="FILE.onnx",
        help="where to write it (its folder must exist)",
    )
    onnx.add_argument(
        "--weights", action="store_true", help="also output every layer's per-head weights"
    )
    onnx.add_argument("--opset", type=int, default=18, help="ONNX opset version")
    onnx.set_defaults(func=_export)
    serve = _command(
        commands, "serve", "HTTP service: embeddings (TEI and OpenAI formats), attention, metrics"
    )
    serve.add_argument(
        "--model", metavar="PATH", help="BERT-family model folder (default: all-MiniLM-L6-v2)"
    )
    serve.add_argument(
        "--runtime", choices=["torch", "onnx"], default="torch", help="what runs the model"
    )
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
        help="seconds to send a request's header, else the connection closes",
    )
    serve.add_argument(
        "--body-timeout",
        type=float,
        default=30.0,
        metavar="S",
        help="seconds to send a request's body after its header, else 408",
    )
    serve.add_argument(
        "--drain-timeout",
        type=float,
        default=20.0,
        metavar="S",
        help="on SIGTERM, requests still queued after S seconds get 503",
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
    serve.add_argument(
        "--threads", type=int, default=None, help="torch/onnxruntime threads (default: all)"
    )
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
