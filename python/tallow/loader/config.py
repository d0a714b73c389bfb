"""Moved to tallow.config (ModelConfig is common to the package); this alias goes once every import is updated."""
import sys, tallow.config  # noqa: E401
sys.modules[__name__] = sys.modules["tallow.config"]
