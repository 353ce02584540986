"""MkDocs hook: writes the CLI reference page from ``multihead.cli.build_parser()``.

The page is generated at every build (``on_files``), never kept in git, so it cannot drift
from the parser: every command and sub-command (``bench kernels``, ``export onnx``, ...) gets
its usage, its description and a table of its arguments with their help, choices and defaults.
``tests/test_docs.py`` checks that every parser and every positional choice appears.
"""

from __future__ import annotations

import argparse
import re
from collections.abc import Iterator

PAGE = "reference/cli.md"
WIDTH = 88  # usage lines wrap here, whatever the terminal of the machine that builds the site

# characters Markdown would read as markup in help texts (`*_GroundTruth.txt`, `<`, `|`)
_MARKUP = re.compile(r"([\\`*_<>\[\]|])")


def parsers(
    parser: argparse.ArgumentParser, name: str = "multihead"
) -> Iterator[tuple[str, argparse.ArgumentParser]]:
    """Every parser of the command line with its full command name, depth first, in the
    order the parser lists its sub-commands."""
    yield name, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub, child in action.choices.items():
                yield from parsers(child, f"{name} {sub}")


def _escape(text: str) -> str:
    return _MARKUP.sub(r"\\\1", text)


def _usage(parser: argparse.ArgumentParser) -> str:
    formatter = parser.formatter_class(prog=parser.prog, width=WIDTH)
    formatter.add_usage(parser.usage, parser._actions, parser._mutually_exclusive_groups)
    return formatter.format_help().strip()


def _text(text: str) -> list[str]:
    """A description or epilog: indented lines (example commands) become a console block,
    the rest Markdown text with markup characters escaped."""
    out: list[str] = []
    block: list[str] = []
    for line in text.splitlines():
        if line.startswith(" ") and line.strip():
            block.append(line.strip())
            continue
        if block:
            out += ["", "```console", *block, "```", ""]
            block = []
        out.append(_escape(line))
    if block:
        out += ["", "```console", *block, "```"]
    return out


def _help(parser: argparse.ArgumentParser, action: argparse.Action) -> str:
    """The action's help with argparse's %-placeholders expanded, without the default that
    the command's own formatter appends (the table has a column for it)."""
    if not action.help:
        return ""
    plain = argparse.HelpFormatter(prog=parser.prog)
    return " ".join(plain._expand_help(action).split())


def _default(action: argparse.Action) -> str:
    default = action.default
    if default is None or default is False or default == argparse.SUPPRESS:
        return ""
    if isinstance(default, (list, tuple)):
        default = " ".join(str(d) for d in default)
    return f"`{default}`"


def _name(action: argparse.Action) -> str:
    if action.option_strings:
        flags = ", ".join(action.option_strings)
        if action.nargs == 0:
            return f"`{flags}`"
        metavar = action.metavar or (action.dest.upper() if not action.choices else None)
        if metavar is None:
            metavar = "{" + ",".join(map(str, action.choices)) + "}"
        more = " ..." if action.nargs in ("+", "*") else ""
        return f"`{flags} {metavar}{more}`"
    return f"`{action.metavar or action.dest}`"


def _arguments(parser: argparse.ArgumentParser) -> list[str]:
    rows = []
    for action in parser._actions:
        if isinstance(action, (argparse._HelpAction, argparse._SubParsersAction)):
            continue
        text = _escape(_help(parser, action))
        if action.choices and not isinstance(action.choices, dict):
            choices = ", ".join(f"`{c}`" for c in action.choices)
            text += f" One of {choices}."
        if action.required and action.option_strings:
            text += " Required."
        rows.append(f"| {_name(action)} | {text.strip()} | {_default(action)} |")
    if not rows:
        return []
    return ["| argument | what it does | default |", "|---|---|---|", *rows, ""]


def _subcommands(parser: argparse.ArgumentParser, name: str) -> list[str]:
    lines = []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for choice in action._choices_actions:
                anchor = f"{name} {choice.dest}".replace(" ", "-")
                lines.append(f"- [`{name} {choice.dest}`](#{anchor}): {_escape(choice.help)}")
    return [*lines, ""] if lines else []


def render(parser: argparse.ArgumentParser) -> str:
    """The whole reference page, in Markdown."""
    lines = [
        "# Command-line reference",
        "",
        "Generated from `multihead.cli.build_parser()` each time the site is built; "
        "`multihead COMMAND --help` prints the same information.",
        "",
    ]
    for name, sub in parsers(parser):
        depth = name.count(" ")
        anchor = name.replace(" ", "-")
        lines += [f"{'#' * min(depth + 2, 4)} `{name}` {{ #{anchor} }}", ""]
        lines += ["```text", _usage(sub), "```", ""]
        if sub.description:
            lines += [*_text(sub.description), ""]
        lines += _arguments(sub)
        lines += _subcommands(sub, name)
        if sub.epilog:
            lines += [*_text(sub.epilog), ""]
    return "\n".join(lines).rstrip() + "\n"


def on_files(files, config):
    """MkDocs event: add the generated page to the site's files."""
    from mkdocs.structure.files import File

    from multihead.cli import build_parser

    files.append(File.generated(config, PAGE, content=render(build_parser())))
    return files
