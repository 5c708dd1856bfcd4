"""The package version, in the lowest layer so that every module (e.g. a checkpoint's provenance) can read it."""

__version__ = "0.1.0"
