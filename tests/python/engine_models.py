"""Random-weight Hugging Face checkpoints made with transformers (test-only) for engine tests."""
import json
import pathlib


def write_word_tokenizer(path: pathlib.Path, vocab_size: int, eos_id: int = 1) -> None:
    """A WordLevel tokenizer.json ("t0".."tN" split on whitespace) so the engine can load the folder."""
    from tokenizers import Tokenizer, models, pre_tokenizers, decoders

    vocab = {f"t{i}": i for i in range(vocab_size)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({"eos_token": f"t{eos_id}", "bos_token": None}))


def make_llama(path: pathlib.Path, seed: int = 0, **overrides):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = dict(vocab_size=320, hidden_size=64, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, head_dim=16, max_position_embeddings=512, rms_norm_eps=1e-5,
               tie_word_embeddings=False, initializer_range=0.08, eos_token_id=1, bos_token_id=None,
               rope_theta=10000.0)
    cfg.update(overrides)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(**cfg)).float().eval()
    model.save_pretrained(path, safe_serialization=True)
    write_word_tokenizer(path, cfg["vocab_size"], eos_id=1)
    return model


def hf_greedy(model, prompt_ids, n_new):
    import torch

    with torch.no_grad():
        out = model.generate(torch.tensor([prompt_ids]), max_new_tokens=n_new, min_new_tokens=n_new, do_sample=False,
                             eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt_ids):].tolist()
