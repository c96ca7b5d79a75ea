"""The package version: one place, read by the package, its run summaries and its exports."""
__version__ = "0.1.0"
