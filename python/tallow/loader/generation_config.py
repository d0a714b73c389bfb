"""Sampling defaults from a model's generation_config.json, as vLLM takes them (--generation-config
auto): temperature, top_p, top_k, min_p and repetition_penalty, where the file sets them, become the
defaults a request overrides. A value that is no valid sampling parameter is left out with a
warning; an unreadable file gives no defaults (generation still works)."""
from __future__ import annotations

import json
import logging
import math
import os
from typing import Optional

log = logging.getLogger("tallow.loader")

SAMPLING_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


def sampling_defaults(path: Optional[str]) -> dict:
    """{field: value} of the sampling keys the generation_config.json at ``path`` sets (None: no file)."""
    from tallow.engine.sampling_params import SamplingParams

    if not path or not os.path.isfile(path):
        return {}
    try:
        with open(path, encoding="utf-8") as f:
            gen = json.load(f)
    except (OSError, ValueError) as e:
        log.warning("%s is not readable JSON (%s); no sampling defaults taken from it", path, e)
        return {}
    if not isinstance(gen, dict):
        return {}
    out = {}
    for key in SAMPLING_KEYS:
        value = gen.get(key)
        if value is None:
            continue
        if key == "top_k" and isinstance(value, float) and value.is_integer():
            value = int(value)
        ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
        if ok:
            try:
                SamplingParams(**{key: value})
            except (ValueError, TypeError):
                ok = False
        if not ok:
            log.warning("%s: %s=%r is not a valid sampling parameter; left out", path, key, value)
            continue
        out[key] = value
    return out
