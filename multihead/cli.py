"""The ``multihead`` command: a table of commands, each running one job function.

A job is ``function(options)`` (or ``function()``): the annotation of ``options``, a dataclass,
declares the command's flags once (``multihead._flags``), and the parsed flags reach the job as
that record. A new command is one entry in a table here; a new ``train`` application is one
module and one entry in ``multihead.apps.TASKS``. Only the command being run has its job
imported, so ``multihead --help`` and ``--version`` answer without importing torch.
"""

from __future__ import annotations

import argparse
import importlib
import sys
import textwrap
import typing
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from . import _flags
from ._version import __version__

DESCRIPTION = """\
multihead: multi-head attention for PyTorch, from the command line.

Look inside a pretrained model (explain, heads), continue a prompt (generate), test a
compressed KV cache on long inputs (kv), turn sentences into vectors (embed), train the
example applications (train), ship a model (export, serve) and measure speed (bench, doctor).
Everything runs offline on the CPU; a GPU is used when present."""

EPILOG = """\
examples:
  multihead explain "The animal didn't cross the street because it was too tired" --focus it
  multihead generate --model smollm2 --chat "What is the capital of France?"
  multihead heads "The keys to the cabinet are on the table" --model smollm2
  multihead kv --model smollm2 --lengths 2000 --keep 1.0,0.25 --trials 4
  multihead train forecast --quick --out forecast-run
  multihead bench kernels --quick

'multihead COMMAND --help' lists a command's options and their defaults."""


@dataclass(frozen=True)
class Job:
    """A command that runs ``target`` (``"module:function"``); ``description`` opens its
    --help (default: the summary)."""

    target: str
    summary: str
    description: str = ""


@dataclass(frozen=True)
class Group:
    """A command with sub-commands (called ``dest`` in its help): ``commands`` is their table,
    or ``"module:function"`` giving a registry's entries as ``{name: (summary, options
    record)}``, each of which runs ``run(name, options)``."""

    summary: str
    commands: dict[str, Job | Group] | str
    description: str = ""
    run: str = ""
    dest: str = "command"


BENCHMARKS: dict[str, Job | Group] = {
    "kernels": Job(
        "multihead.bench.kernels:run_suite",
        "time multihead against torch SDPA, the naive formula and FlexAttention",
    ),
    "embed": Job(
        "multihead.bench.embed:run_embed_bench",
        "sentence-embedding throughput against sentence-transformers",
    ),
    "decode": Job(
        "multihead.bench.decode:run_decode_bench",
        "greedy decoding tokens/s of a GPT-2-small-shaped model against transformers "
        "generate() (B=1 and B=8, prompt 128, 128 new tokens)",
    ),
    "kv": Job(
        "multihead.bench.kv:run_kv_bench",
        "KV-cache compression on a real causal LM: the scored prompt against the plain and the "
        "eager one, decoding steps, cache bytes and peak memory against the full cache",
    ),
    "explain": Job(
        "multihead.bench.explain:run_explain_bench",
        "token attributions: ERASER faithfulness on VADER against Captum's integrated "
        "gradients, subject-verb agreement on SmolLM2, seconds and memory per method",
    ),
    "hf": Job(
        "multihead.bench.hf:run_hf_bench",
        "transformers models on attn_implementation='multihead' against sdpa, eager and flex",
    ),
    "serve": Job(
        "multihead.bench.serve:command",
        "load-test multihead serve against a FastAPI + sentence-transformers server",
    ),
    "train": Job(
        "multihead.apps.throughput:compare",
        "training samples/s of the train apps: eager fp32 against compiled, bf16 autocast, "
        "both, and --precision auto, with graph breaks and the measured matmul peaks",
    ),
    "context-parallel": Job(
        "multihead.bench.context:run_context_bench",
        "one L=131072 sequence across 1, 2, 4 processes (memory and time)",
    ),
}

COMMANDS: dict[str, Job | Group] = {
    "explain": Job(
        "multihead.apps.explain:run",
        "show what every head of a pretrained model attends to in TEXT",
        "Run TEXT through a pretrained model with attention weights on; print, for every layer\n"
        "and head, the token the focus word attends to most; write figures (every head, and one\n"
        "head named in its title: --layer/--head, or the one most fixed on one other word) and\n"
        "an HTML head view that works offline.",
    ),
    "heads": Job(
        "multihead.apps.heads:run",
        "rank every head of a model by what ablating it does to TEXT",
        "Score every head of the model in --model (a causal LM or an encoder transformers\n"
        "loads) by ablating it alone: the increase of the next-token loss on TEXT for a causal\n"
        "LM, 1 - cosine of the mean-pooled last hidden state for an encoder. Writes\n"
        "OUT/heads.json and a layers x heads heatmap, and prints the top ten heads.",
    ),
    "embed": Job("multihead.apps.embed:run", "sentence embeddings, one per line of FILE"),
    "kv": Job(
        "multihead.apps.kv:run",
        "long-input retrieval with the KV cache compressed: accuracy per policy, keep, length",
        "Hide a pass key (or several keys) in filler text of each --lengths, run the model\n"
        "once per trial, then decode the answer with the cache compressed by each policy at\n"
        "each --keep or --budget (multihead.kv, scores from the attention kernel; --chunk N\n"
        "runs each compressed prompt N tokens at a time). Prints accuracy, cache MiB, prefill\n"
        "seconds and ms per decoding step; writes OUT/kv.json and OUT/kv.png.",
    ),
    "generate": Job(
        "multihead.apps.generate:run",
        "continue a prompt with a causal LM ('smollm2', 'gemma3', a .gguf file or a model "
        "folder), printing the text as it is produced",
        "Continue PROMPT with the causal LM in --model, printing the text as it is produced:\n"
        "the library's own decoders for a folder of theirs (multihead train lm, GPT-2, Llama),\n"
        "transformers' generate() on attn_implementation='multihead' for 'smollm2', 'gemma3',\n"
        "a .gguf file or any other causal LM folder. PROMPT '-', or none with a pipe, reads the\n"
        "prompt from standard input.",
    ),
    "cache": Group(
        "the models converted from GGUF files into the user's cache: list them, remove them",
        {
            "list": Job("multihead.apps.cache:list_command", "each converted model and its size"),
            "remove": Job(
                "multihead.apps.cache:remove_command", "remove converted models (NAME ... or --all)"
            ),
        },
        dest="action",
    ),
    "data": Group(
        "download the data sets the train applications read into the user's cache",
        {"download": Job("multihead.data:download_command", "fetch one, its digests checked")},
        dest="action",
    ),
    "train": Group(
        "train an example application with its baselines (TASK --help: its options); runs "
        "under torchrun for several processes",
        "multihead.apps:tasks",
        "Train one of the example applications and its baselines in the same run, then print\n"
        "their test metrics side by side. DIR receives the saved model, metrics.json and the\n"
        "figures, written whole when the run ends. Several processes:\n"
        "  torchrun --nproc-per-node N $(which multihead) train TASK --out DIR",
        run="multihead.apps:train",
        dest="task",
    ),
    "export": Group(
        "export a model for other runtimes",
        {
            "onnx": Job(
                "multihead.export.onnx:run",
                "BERT-family model, or GPT-2 / Llama decoder with past and present key/value, "
                "-> ONNX with dynamic batch and sequence axes",
            )
        },
        dest="format",
    ),
    "serve": Job(
        "multihead.serve:run",
        "HTTP service: embeddings (TEI and OpenAI formats), attention, metrics",
    ),
    "bench": Group(
        "benchmarks: " + ", ".join(BENCHMARKS),
        BENCHMARKS,
        "Measure speed against the usual alternatives, in one process on the same inputs. "
        "Each benchmark prints a table and writes results.json (and a PNG where it has one).",
        dest="benchmark",
    ),
    "doctor": Job(
        "multihead.bench.doctor:run",
        "is the fused C++ kernel built (or why not), the CPU's instruction sets and its "
        "measured fp32/bf16 matmul peaks",
    ),
    "walkthrough": Job(
        "multihead.apps.walkthrough:run",
        "walk through multi-head attention on 'cat catches mouse', step by step",
    ),
}


def _resolve(target: str) -> Callable[..., Any]:
    module, name = target.split(":")
    return getattr(importlib.import_module(module), name)


def _path(argv: list[str]) -> list[str]:
    """The commands ``argv`` names, outermost first (``bench kernels`` -> both)."""
    path: list[str] = []
    table: object = COMMANDS  # a registry's entries (a str) are known once it is imported
    for arg in argv:
        if arg.startswith("-"):
            continue
        if table is None or (isinstance(table, dict) and arg not in table):
            break
        path.append(arg)
        entry = table.get(arg) if isinstance(table, dict) else None
        table = entry.commands if isinstance(entry, Group) else None
    return path


def _describe(text: str) -> str:
    """A description as written when it has line breaks of its own, else wrapped."""
    return text if "\n" in text else textwrap.fill(text[0].upper() + text[1:], 88)


def _add_job(parser: argparse.ArgumentParser, job: Callable, record: type | None, *args) -> None:
    """``parser`` runs ``job(*args, options)``, ``options`` the ``record`` its flags fill."""
    if record is not None:
        _flags.add_arguments(parser, record)
    parser.set_defaults(job=job, job_args=args, record=record)


def _add_commands(parser: argparse.ArgumentParser, group: Group, path: list[str] | None) -> None:
    """Sub-commands for every entry of ``group``; flags only for those on ``path`` (every
    one when ``path`` is None)."""
    commands = parser.add_subparsers(
        dest=group.dest, required=True, metavar=group.dest.upper(),
        parser_class=_flags.CommandParser,
    )  # fmt: skip
    table = group.commands  # or a registry's {name: (summary, record)}
    for name, entry in (table if isinstance(table, dict) else _resolve(table)()).items():
        summary = entry[0] if isinstance(entry, tuple) else entry.summary
        own = "" if isinstance(entry, tuple) else entry.description
        sub = commands.add_parser(name, help=summary, description=_describe(own or summary))
        if path is not None and path[:1] != [name]:
            continue
        rest = None if path is None else path[1:]
        if isinstance(entry, tuple):  # a registry's entry: run(name, options)
            _add_job(sub, _resolve(group.run), entry[1], name)
        elif isinstance(entry, Group):
            _add_commands(sub, entry, rest)
        else:  # the job's options record: the annotation of its ``options`` parameter
            job = _resolve(entry.target)
            _add_job(sub, job, typing.get_type_hints(job).get("options"))


def build_parser(argv: list[str] | None = None) -> argparse.ArgumentParser:
    """The whole command line. Given ``argv``, only the commands it names get their flags
    (and their jobs imported): ``--help`` alone lists the commands from this table."""
    parser = _flags.CommandParser(prog="multihead", description=DESCRIPTION, epilog=EPILOG)
    parser.add_argument(
        "--version", action="version", version=f"multihead {__version__}", help="print the version"
    )
    _add_commands(parser, Group("", COMMANDS), None if argv is None else _path(argv))
    return parser


def _check_model_source(argv: list[str]) -> None:
    """A ``--model`` that names a causal LM source ("smollm2", "gemma3", a .gguf path) is
    resolved before the command's job is imported (``multihead.sources``, the standard library
    alone), so a missing file or package is named before torch loads, in every command."""
    from . import sources

    for i, arg in enumerate(argv):
        value = arg.partition("=")[2] if arg.startswith("--model=") else None
        if arg == "--model" and i + 1 < len(argv):
            value = argv[i + 1]
        if value is not None and sources.is_llm_source(value):
            sources.resolve(value)


def main(argv: list[str] | None = None) -> int:
    """Run the command ``argv`` names; the exit status: the job's own when it returns an int,
    else 0; 2 for an error the user can fix; 130 after Ctrl-C."""
    argv = sys.argv[1:] if argv is None else list(argv)
    command = (_path(argv) or ["multihead"])[0]
    try:
        _check_model_source(argv)
        args = build_parser(argv).parse_args(argv)
        options = [] if args.record is None else [_flags.record_from(args.record, args)]
        result = args.job(*args.job_args, *options)
    except (ValueError, FileNotFoundError, ModuleNotFoundError) as err:
        print(f"multihead {command}: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        # Ctrl-C: one line, no traceback, the shell's exit status for SIGINT (128 + 2); what
        # the command writes is written whole or not at all, so nothing is half-written
        print(f"multihead {command}: interrupted", file=sys.stderr)
        return 130
    return result if type(result) is int else 0


if __name__ == "__main__":
    sys.exit(main())
