"""The single source of the package version (read by pyproject.toml and the Colab cells)."""

__version__ = "0.2.0.dev0"
