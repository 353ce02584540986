"""No module of the package imports, directly or through others, a module that imports it back.

The layering contract in pyproject.toml (``lint-imports``) keeps imports pointing down between
layers, but not inside one: ``models.families`` and ``models.kinds`` imported each other, and
``multihead.hf``'s ``__init__`` imported ``capture``, which imported the package back. grimp (the
graph import-linter reads) sees function-level imports too, and imports made only for type
annotations (under ``TYPE_CHECKING``) count as well: they never run, but they tie two modules
together just the same (``models.loading`` annotated with ``causal_lm.CausalLM`` while
``causal_lm`` imported ``loading`` back), so neither can be read or moved without the other.
"""

from __future__ import annotations

import grimp


def _circles(package: str) -> list[str]:
    """Every import a -> b from which b leads back to a, as the chain a -> b -> ... -> a."""
    graph = grimp.build_graph(package, exclude_type_checking_imports=False, cache_dir=None)
    circles = []
    for importer in sorted(graph.modules):
        for imported in sorted(graph.find_modules_directly_imported_by(importer)):
            back = graph.find_shortest_chain(importer=imported, imported=importer)
            if back is not None:
                circles.append(" -> ".join((importer, *back)))
    return circles


def test_the_package_imports_in_no_circle():
    assert _circles("multihead") == []


def test_an_import_for_annotations_only_closes_a_circle(tmp_path, monkeypatch):
    package = tmp_path / "annotated_circle"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "model.py").write_text("from .loader import load\n")
    (package / "loader.py").write_text(
        "from __future__ import annotations\n"
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n"
        "    from .model import Model\n"
        "def load() -> Model: ...\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    assert _circles("annotated_circle") == [
        "annotated_circle.loader -> annotated_circle.model -> annotated_circle.loader",
        "annotated_circle.model -> annotated_circle.loader -> annotated_circle.model",
    ]
