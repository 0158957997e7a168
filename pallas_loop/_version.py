"""The one version source (read by pyproject.toml and by `pallas_loop.__version__`)."""

__version__ = "0.2.0"
