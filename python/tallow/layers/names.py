"""Checkpoint weight names: required-weight lookups with clear errors, and the text model's weights of
multimodal checkpoints under the plain causal-LM names."""
from __future__ import annotations

import re

# Prefixes under which multimodal checkpoints (Gemma3ForConditionalGeneration, Mistral3ForConditionalGeneration,
# ...) keep their language model, as (pattern, replacement): transformers >= 4.52 / 5 save
# model.language_model.* and lm_head.*; older ones language_model.model.* and language_model.lm_head.*.
_TEXT_PREFIXES = (
    (re.compile(r"^model\.language_model\."), "model."),
    (re.compile(r"^language_model\.model\."), "model."),
    (re.compile(r"^language_model\.lm_head\."), "lm_head."),
)
# Non-text towers of multimodal checkpoints: dropped.
_OTHER_TOWERS = re.compile(r"^(model\.)?(vision_tower|vision_model|multi_modal_projector|audio_tower|"
                           r"embed_vision|embed_audio|visual)\.")


class MissingWeightError(KeyError, ValueError):
    """A weight the model file needs is not in the checkpoint (a ValueError too, for the CLI's clean errors)."""

    def __str__(self):  # KeyError would quote the message
        return str(self.args[0])


def require(w: dict, name: str):
    t = w.get(name)
    if t is None:
        raise MissingWeightError(f"the checkpoint has no weight {name!r} (a different architecture, or an "
                                 f"incomplete download?)")
    return t


def text_name(name: str):
    """A checkpoint name under the plain causal-LM names (model.layers.*, model.embed_tokens.*, model.norm.*,
    lm_head.*): a multimodal checkpoint's language-model prefixes mapped, None for another tower's tensor."""
    if _OTHER_TOWERS.match(name):
        return None
    for pat, rep in _TEXT_PREFIXES:
        new, n = pat.subn(rep, name)
        if n:
            return new
    return name


def text_weights(weights: dict) -> dict:
    """`weights` with a multimodal checkpoint's language-model names mapped to causal-LM names
    (model.layers.*, model.embed_tokens.*, model.norm.*, lm_head.*) and other towers dropped. Plain
    causal-LM checkpoints come back unchanged (the same dict)."""
    if "model.embed_tokens.weight" in weights:
        return weights
    out = {}
    for name, t in weights.items():
        if _OTHER_TOWERS.match(name):
            continue
        for pat, rep in _TEXT_PREFIXES:
            new, n = pat.subn(rep, name)
            if n:
                name = new
                break
        out[name] = t
    return out
