"""tallow's version: the one place it is written. pyproject.toml reads it at build time (scikit-build-core's
regex metadata provider) and ``tallow.__version__`` / ``tallow --version`` import it."""

__version__ = "0.1.0"
