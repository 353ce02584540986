"""What kind of model a folder holds, read from its ``config.json`` alone, so that a command
given the wrong kind says what it found and what it takes before loading anything.

A Hugging Face folder names its family in ``model_type`` (``bert``, ``gpt2``, ``llama``,
``t5``, ...); a ``multihead.save`` folder has ``format_version`` and the saved class under
``model.class`` (BERT saved that way also has ``model_type``, so it reads as ``bert``). What a
command takes is read from the family registry (``Family.causal``), never from a list here.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from .families import Family, all_families, describe, family

__all__ = [
    "SAVED",
    "FolderKind",
    "check_encoder",
    "check_encoder_kind",
    "check_family_kind",
    "encoders",
    "folder_kind",
    "listed",
    "opened_by_multihead",
    "wrong_kind",
]

SAVED = "multihead.save"  # the kind of a multihead.save folder without a model_type


@dataclass(frozen=True)
class FolderKind:
    """``kind``: the config's ``model_type``, ``SAVED``, or None when config.json has neither
    field; ``saved_class``: the class a ``multihead.save`` folder holds."""

    folder: Path
    kind: str | None
    saved_class: str | None = None

    def describe(self) -> str:
        """What the folder holds, in words, with the config.json field that says so."""
        if self.kind == SAVED:
            return f"a multihead.save folder of {self.saved_class} (config.json model.class)"
        if self.kind is None:
            return "a config.json with neither model_type nor format_version"
        return describe(self.kind)

    @property
    def received(self) -> str:
        """The deciding config.json field as ``name=value``, for "Received:"."""
        if self.kind == SAVED:
            return f"model.class={self.saved_class!r}"
        return f"model_type={self.kind!r}"


def folder_kind(path: str | Path | None) -> FolderKind | None:
    """The kind of model in ``path``; None for None (the default model), for a path that is
    not a folder or a folder without config.json (the loader then names what is missing).

    Raises:
        ValueError: config.json is empty, not UTF-8, not JSON or not an object (named).
    """
    from .. import folder_reading

    if path is None:
        return None
    folder = Path(path)
    if not (folder / "config.json").is_file():
        return None
    config = folder_reading.read_config(folder)
    kind = config.get("model_type")
    if isinstance(kind, str):
        return FolderKind(folder, kind)
    model = config.get("model")
    if "format_version" in config and isinstance(model, dict):
        return FolderKind(folder, SAVED, str(model.get("class")))
    return FolderKind(folder, None)


def opened_by_multihead(source: str | Path | None) -> bool:
    """Whether the library's own models open a command's ``--model`` source (else transformers
    does, on the multihead attention): None (the default encoder), a ``multihead.save``
    folder, a folder whose ``model_type`` a family has, or a folder without a config.json that
    says (the loader then names what is missing). A GGUF file, one of the names
    ``multihead.sources.NAMES``, a folder of any other ``model_type`` and a path that is no
    folder are transformers' (whose loader names what is wrong with the path). The commands
    that run a model of either world (``explain``, ``generate``) decide by this alone."""
    from .. import sources

    if source is None:
        return True
    if sources.is_llm_source(source):
        return False
    found = folder_kind(source)
    if found is None:
        return Path(source).is_dir()
    return found.kind in (None, SAVED) or family(found.kind) is not None


def wrong_kind(found: FolderKind, command: str, supported: str) -> ValueError:
    """The error for ``command`` given a folder of a kind it does not take: what the folder
    holds, what the command supports, and the field that decided."""
    return ValueError(
        f"{found.folder} holds {found.describe()}, but {command} supports {supported}; give "
        f"it a folder of a kind it supports. Received: {found.received}"
    )


def listed(chosen: list[Family]) -> str:
    """Families as a message names them: "a BERT-family encoder (config.json model_type
    'bert') or a GPT-2 decoder (model_type 'gpt2')"."""
    parts = [f"{f.description} (model_type {f.model_type!r})" for f in chosen]
    if parts:
        parts[0] = parts[0].replace("(model_type", "(config.json model_type", 1)
    return " or ".join([", ".join(parts[:-1]), parts[-1]] if len(parts) > 1 else parts)


def encoders() -> str:
    """What ``multihead serve`` and ``embed`` take: the sentence encoders (every family that is
    not causal)."""
    chosen = [f for f in all_families() if not f.causal]
    return f"sentence encoders: {listed(chosen)}, as the default all-MiniLM-L6-v2"


def check_encoder_kind(path: str | Path | None, command: str) -> None:
    """Refuse, before loading, a folder that holds anything but a sentence encoder
    (``multihead serve`` and ``embed`` take only those)."""
    found = folder_kind(path)
    if found is None or found.kind is None:
        return
    known = None if found.kind == SAVED else family(found.kind)
    if known is None or known.causal:
        raise wrong_kind(found, command, encoders())


def check_family_kind(
    path: str | Path | None,
    command: str,
    supported: Callable[[], str],
    *,
    saved_classes: tuple[str, ...] = (),
) -> None:
    """Refuse, before loading, a folder no family opens: a ``model_type`` no family has, or a
    ``multihead.save`` folder of a class that is neither a family's model nor one of
    ``saved_classes``. ``supported()`` says what ``command`` takes."""
    found = folder_kind(path)
    if found is None or found.kind is None:
        return  # the loader names what is missing
    if found.kind == SAVED:
        ok = found.saved_class in {*saved_classes, *(f.saved_class for f in all_families())}
    else:
        ok = family(found.kind) is not None
    if not ok:
        raise wrong_kind(found, command, supported())


def check_encoder(model: object, path: str | Path | None, command: str) -> None:
    """Refuse, after loading, a ``multihead.save`` folder of a bare ``Bert`` module: its
    config.json says model_type 'bert', but without the tokenizer there is no text to run."""
    if getattr(model, "tokenizer", None) is None:  # a models.bert.Pretrained carries one
        raise ValueError(
            f"{path} holds a multihead.save folder of {type(model).__name__}, a model without "
            f"its tokenizer, but {command} supports {encoders()}; save the whole "
            "models.bert.Pretrained (model and tokenizer) instead. "
            f"Received: {type(model).__module__}.{type(model).__qualname__}"
        )
