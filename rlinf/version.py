"""The package version (one definition: ``rlinf.__version__`` and ``rlinf --version``)."""

__version__ = "0.1.0"
