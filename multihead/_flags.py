"""Command-line flags declared once, as the fields of an options record.

Each command's job takes one options record (a dataclass). A field made with ``option(...)``
is a flag (``--name-with-dashes`` unless ``flag`` names it), one made with ``argument(...)``
is a positional argument, and a field whose type is itself a record adds that record's flags.
The annotation says the rest: ``bool`` is a switch, ``X | None`` an optional X (for a
positional argument too: it may be left out),
``tuple[X, ...]`` one or more X, ``Literal[...]`` a choice. ``add_arguments`` gives a parser
the flags and ``record_from`` builds the record from what it parsed: nothing copies an option
by hand. Imports nothing heavy, so ``multihead --help`` answers at once.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import functools
import re
import sys
import types
import typing
from collections.abc import Callable, Sequence
from typing import Any, Literal

__all__ = [
    "CommandParser",
    "HelpFormatter",
    "add_arguments",
    "argument",
    "option",
    "positive_int",
    "record_from",
    "required",
]


def option(
    default: Any,
    help: str,
    *,
    flag: str | None = None,
    metavar: str | None = None,
    choices: Sequence[Any] | Callable[[], Sequence[Any]] | None = None,
    parse: Callable[[str], Any] | None = None,
) -> Any:
    """A record field that is a flag. ``choices`` may be a function, asked when the parser is
    built (a registry's current entries); ``parse`` turns the text into the value."""
    if isinstance(default, (list, dict, set)):
        raise TypeError(f"give a tuple as a default, not a {type(default).__name__}")
    cli = {"help": help, "flag": flag, "metavar": metavar, "choices": choices, "parse": parse}
    return dataclasses.field(default=default, metadata={"cli": cli})


def required(help: str, *, flag: str | None = None, metavar: str | None = None) -> Any:
    """A record field that is a flag the command cannot run without."""
    cli = {"help": help, "flag": flag, "metavar": metavar, "required": True}
    return dataclasses.field(metadata={"cli": cli})


def argument(help: str, *, metavar: str | None = None) -> Any:
    """A record field that is a positional argument (in field order)."""
    return dataclasses.field(
        metadata={"cli": {"help": help, "metavar": metavar, "positional": True}}
    )


def positive_int(text: str) -> int:
    """argparse type: an int >= 1 (0 repeats or sentences would measure nothing)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 1, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 1, got {value}")
    return value


def _fields(record: type) -> list[tuple[dataclasses.Field, Any]]:
    hints = typing.get_type_hints(record)
    return [(f, hints[f.name]) for f in dataclasses.fields(record) if f.init]


def _unwrap(tp: Any) -> Any:
    """``X | None`` -> X."""
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        inner = [a for a in typing.get_args(tp) if a is not type(None)]
        return inner[0] if len(inner) == 1 else str
    return tp


def _parsing(tp: Any, cli: dict[str, Any]) -> dict[str, Any]:
    """argparse's keywords for a field of type ``tp``."""
    tp = _unwrap(tp)
    kwargs: dict[str, Any] = {}
    if typing.get_origin(tp) in (tuple, list):
        kwargs["nargs"] = "+"
        tp = typing.get_args(tp)[0]
    if typing.get_origin(tp) is Literal:
        kwargs["choices"] = typing.get_args(tp)
        tp = type(kwargs["choices"][0])
    choices = cli.get("choices")
    if choices is not None:
        kwargs["choices"] = tuple(choices() if callable(choices) else choices)
    parse = cli.get("parse")
    kwargs["type"] = _reporting(parse) if parse is not None else tp
    return kwargs


def _reporting(parse: Callable[[str], Any]) -> Callable[[str], Any]:
    """``parse`` whose ``ValueError`` reaches the user as its own message: argparse replaces a
    ``type=`` function's ``ValueError`` by "invalid <function name> value"."""

    @functools.wraps(parse)
    def run(text: str) -> Any:
        try:
            return parse(text)
        except ValueError as error:
            raise argparse.ArgumentTypeError(str(error)) from None

    return run


def add_arguments(parser: argparse.ArgumentParser, record: type) -> None:
    """Give ``parser`` the flags and arguments of ``record``'s fields (see the module)."""
    for field, tp in _fields(record):
        cli = field.metadata.get("cli")
        if dataclasses.is_dataclass(tp):
            add_arguments(parser, tp)
            continue
        if cli is None:
            continue
        names = {"help": cli["help"], "metavar": cli.get("metavar")}
        if cli.get("positional"):
            optional = _unwrap(tp) is not tp  # ``X | None``: may be left out (None)
            parsing = _parsing(tp, cli)
            if optional:  # one value or none; several (a tuple) or none
                parsing.update(nargs="*" if parsing.get("nargs") == "+" else "?", default=None)
            parser.add_argument(field.name, **names, **parsing)
            continue
        flag = cli["flag"] or "--" + field.name.replace("_", "-")
        default = None if field.default is dataclasses.MISSING else field.default
        if _unwrap(tp) is bool:
            action = "store_false" if default else "store_true"
            parser.add_argument(flag, dest=field.name, action=action, help=cli["help"])
            continue
        if isinstance(default, tuple):
            default = list(default)
        required = {"required": True} if cli.get("required") else {"default": default}
        parser.add_argument(flag, dest=field.name, **names, **required, **_parsing(tp, cli))


def record_from(record: type, parsed: argparse.Namespace) -> Any:
    """The ``record`` that ``parsed`` (from a parser given ``add_arguments(record)``) holds."""
    values = {}
    for field, tp in _fields(record):
        if dataclasses.is_dataclass(tp):
            values[field.name] = record_from(tp, parsed)
        elif field.metadata.get("cli") is not None:
            value = getattr(parsed, field.name)
            values[field.name] = tuple(value) if isinstance(value, list) else value
    return record(**values)


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Descriptions as written, and every option's default shown after its help: the
    defaults a user would otherwise look up in the source. Switches, options without a
    default (None) and helps that already state theirs are left as they are."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        default = action.default
        if (
            default is None
            or action.nargs == 0  # a switch: off unless given
            or default == argparse.SUPPRESS
            or "(default" in text
            or not action.option_strings
        ):
            return text
        if isinstance(default, (list, tuple)):
            default = " ".join(str(d) for d in default)
        return f"{text} (default: {str(default).replace('%', '%%')})"


class CommandParser(argparse.ArgumentParser):
    """A parser with defaults in its help; a sub-command's parser reports an option it does
    not know with its own usage (and the nearest option it has), not the top-level usage
    argparse would give, and before a missing required option."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("formatter_class", HelpFormatter)
        super().__init__(*args, **kwargs)
        self._unknown: list[str] = []

    def parse_known_args(self, args=None, namespace=None):  # type: ignore[override]
        args = sys.argv[1:] if args is None else list(args)
        self._unknown = [] if self._subparsers else _unknown_options(self, args)
        parsed, extras = super().parse_known_args(args, namespace)
        unknown = [a for a in extras if a.startswith("-")]
        if extras:
            self.error(_unrecognized(self, extras, unknown[0] if unknown else None))
        return parsed, extras

    def error(self, message: str):  # type: ignore[override]
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
