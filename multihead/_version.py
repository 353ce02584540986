"""The package version, in one place: pyproject reads it (setuptools' dynamic ``attr``) and so do
``multihead.__version__`` and the files ``multihead.save`` writes. It imports nothing, so reading
it never loads the package."""

__version__ = "0.2.0"
