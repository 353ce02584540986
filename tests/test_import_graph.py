"""No module of the package imports, directly or through others, a module that imports it back.

The layering contract in pyproject.toml (``lint-imports``) keeps imports pointing down between
layers, but not inside one: ``models.families`` and ``models.kinds`` imported each other, and
``multihead.hf``'s ``__init__`` imported ``capture``, which imported the package back. grimp (the
graph import-linter reads) sees function-level imports too; imports made only for type
annotations (under ``TYPE_CHECKING``) are left out, since they never run.
"""

from __future__ import annotations

import grimp


def test_the_package_imports_in_no_circle():
    graph = grimp.build_graph("multihead", exclude_type_checking_imports=True)
    circles = []
    for importer in sorted(graph.modules):
        for imported in sorted(graph.find_modules_directly_imported_by(importer)):
            back = graph.find_shortest_chain(importer=imported, imported=importer)
            if back is not None:
                circles.append(" -> ".join((importer, *back)))
    assert circles == []
