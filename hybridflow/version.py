"""The package version (its own module: low layers read it without the public API)."""

__version__ = "0.1.0"
