"""Tokenizers: Hugging Face tokenizer folders and GGUF-embedded vocabularies as one ``Tokenizer``
(backed by the ``tokenizers`` library), and streaming detokenization.

    tok = Tokenizer.from_pretrained_dir("path/to/model")   # tokenizer.json or tokenizer.model
    tok = Tokenizer.from_gguf(GGUFFile("model.gguf"))      # or a path
    ids = tok.encode("Hello")                              # BOS added when the model asks for it
    detok = detokenizer_for(tok, prompt_ids=ids)            # an IncrementalDetokenizer or a faster
                                                           # exact one for byte-level vocabularies
    for t in generated: print(detok.add(t), end="")
    print(detok.finish())
"""
from tallow.tokenizer.detokenizer import IncrementalDetokenizer, detokenizer_for
from tallow.tokenizer.gguf_vocab import GGUFVocab, GGUFVocabError, vocab_from_gguf
from tallow.tokenizer.sentencepiece_model import SentencePieceModelError
from tallow.tokenizer.tokenizer import Tokenizer, TokenizerError


def __getattr__(name):
    # chat templates (jinja2) load on first use; the error class is the chat_template module's
    if name == "NoChatTemplateError":
        from tallow.tokenizer.chat_template import NoChatTemplateError

        return NoChatTemplateError
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def load_tokenizer(path) -> Tokenizer:
    """A model folder, tokenizer.json, tokenizer.model or .gguf file."""
    return Tokenizer.from_file(path)


__all__ = [
    "Tokenizer", "TokenizerError", "NoChatTemplateError", "IncrementalDetokenizer", "detokenizer_for", "GGUFVocab", "GGUFVocabError",
    "SentencePieceModelError", "vocab_from_gguf", "load_tokenizer",
]
