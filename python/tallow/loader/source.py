"""From the command line's model options to a local model and its weights.

``--m org/name`` downloads from the Hugging Face hub (``--f FILE`` picks one .gguf of a GGUF
repository; ``--m`` may also be a local path), ``--w DIR`` is a local Hugging Face folder
(config.json, tokenizer files, *.safetensors), ``--f PATH`` a local GGUF file.
:func:`resolve_model_source` says where the model is; :func:`load_weights` gives its weights as
tallow tensors under Hugging Face names. Config, tokenizer and chat-template parsing live
elsewhere (tallow/config.py, tokenizer/); they read the paths or the GGUFFile exposed here.
"""
from __future__ import annotations

import dataclasses
import os
from typing import Any

from tallow.loader import hub
from tallow.loader.gguf_reader import GGUFFile
from tallow.loader.safetensors_loader import INDEX_NAME, SafetensorsCheckpoint, find_safetensors

# Checkpoints this large get a progress bar while loading (mapping is instant; copies are not).
PROGRESS_BYTES = 2 << 30


class ModelSourceError(ValueError):
    """Model options that do not lead to a loadable model; the message says what to pass."""


class ModelSourceNotFoundError(ModelSourceError, FileNotFoundError):
    """A local path given for the model does not exist."""


@dataclasses.dataclass
class ModelSource:
    """Where a model lives locally. kind: "safetensors" (path = folder) or "gguf" (path = .gguf file)."""

    kind: str
    path: str
    repo_id: str | None = None
    revision: str | None = None
    _gguf: GGUFFile | None = dataclasses.field(default=None, repr=False, compare=False)

    @property
    def model_dir(self) -> str:
        """Folder with config.json, tokenizer and template files (for GGUF: the file's folder)."""
        return self.path if self.kind == "safetensors" else os.path.dirname(os.path.abspath(self.path))

    def file(self, name: str) -> str | None:
        """Path of `name` in model_dir, or None when absent."""
        p = os.path.join(self.model_dir, name)
        return p if os.path.isfile(p) else None

    @property
    def config_path(self) -> str | None:
        return self.file("config.json")

    @property
    def generation_config_path(self) -> str | None:
        return self.file("generation_config.json")

    @property
    def tokenizer_path(self) -> str | None:
        return self.file("tokenizer.json")

    @property
    def tokenizer_config_path(self) -> str | None:
        return self.file("tokenizer_config.json")

    @property
    def tokenizer_model_path(self) -> str | None:
        """SentencePiece tokenizer.model (older repos without tokenizer.json)."""
        return self.file("tokenizer.model")

    @property
    def chat_template_path(self) -> str | None:
        return self.file("chat_template.jinja")

    @property
    def gguf(self) -> GGUFFile | None:
        """The opened GGUF file (metadata, vocabulary, template) for a GGUF source, else None."""
        if self.kind != "gguf":
            return None
        if self._gguf is None:
            self._gguf = GGUFFile(self.path)
        return self._gguf

    def checkpoint(self) -> SafetensorsCheckpoint:
        if self.kind != "safetensors":
            raise ModelSourceError(f"{self.path}: a GGUF model has no safetensors checkpoint")
        return SafetensorsCheckpoint(self.path)


def _gguf_in_dir(d: str) -> list[str]:
    return sorted(f for f in os.listdir(d)
                  if f.endswith(".gguf") and "mmproj" not in f.lower() and os.path.isfile(os.path.join(d, f)))


def _local_dir_source(d: str, f: str | None = None, config_only: bool = False) -> ModelSource:
    if f is not None:
        return _local_gguf_source(f if os.path.isabs(f) or os.path.exists(f) else os.path.join(d, f))
    if os.path.isfile(os.path.join(d, INDEX_NAME)) or find_safetensors(d):
        return ModelSource("safetensors", d)
    ggufs = _gguf_in_dir(d)
    if len(ggufs) == 1:
        return _local_gguf_source(os.path.join(d, ggufs[0]))
    if ggufs:
        raise ModelSourceError(f"{d}: several GGUF files; choose one with --f FILE: {', '.join(ggufs)}")
    if config_only and os.path.isfile(os.path.join(d, "config.json")):
        return ModelSource("safetensors", d)  # load_format="dummy": the weights are made from the config
    raise ModelSourceError(f"{d}: no model weights in this directory (no *.safetensors, "
                           f"{INDEX_NAME} or *.gguf files)")


def _local_gguf_source(path: str) -> ModelSource:
    if not os.path.exists(path):
        raise ModelSourceNotFoundError(f"{path}: no such GGUF file")
    if os.path.isdir(path):
        return _local_dir_source(path)
    return ModelSource("gguf", path)


def resolve_model_source(m: str | None = None, w: str | None = None, f: str | None = None,
                         revision: str | None = None, config_only: bool = False) -> ModelSource:
    """Turn --m / --w / --f into a ModelSource, downloading from the hub when --m names a repository.

    - ``m="org/name"``: hub download (``f`` picks a .gguf in it); ``m`` may also be a local folder or file.
    - ``w=DIR``: local Hugging Face folder (a folder holding a single .gguf works too; ``f`` may name a
      .gguf inside it).
    - ``f=PATH``: local GGUF file.
    - ``config_only``: a local folder with config.json but no weights is accepted (load_format="dummy").
    """
    if m and w:
        raise ModelSourceError("give either --m (a hub repository or path) or --w (a local folder), not both")
    if m:
        if os.path.exists(m):
            if os.path.isdir(m):
                return _local_dir_source(m, f, config_only)
            return _local_gguf_source(m) if m.endswith(".gguf") else _local_file_source(m)
        if not hub.is_repo_id(m):
            raise ModelSourceNotFoundError(f"{m}: no such file or directory, and not a Hugging Face repository id")
        path = hub.download_model(m, revision=revision, gguf_file=f)
        kind = "gguf" if path.endswith(".gguf") else "safetensors"
        return ModelSource(kind, path, repo_id=m, revision=revision)
    if w:
        if not os.path.exists(w):
            raise ModelSourceNotFoundError(f"{w}: no such directory")
        if not os.path.isdir(w):
            return _local_gguf_source(w) if w.endswith(".gguf") else _local_file_source(w)
        return _local_dir_source(w, f, config_only)
    if f:
        return _local_gguf_source(f)
    raise ModelSourceError("no model given: pass --m ORG/NAME (Hugging Face hub), --w DIR (local folder) "
                           "or --f FILE.gguf (local GGUF)")


def _local_file_source(path: str) -> ModelSource:
    if path.endswith(".safetensors") or path.endswith(".json"):
        return ModelSource("safetensors", os.path.dirname(os.path.abspath(path)))
    with open(path, "rb") as fh:
        magic = fh.read(4)
    if magic == b"GGUF":
        return ModelSource("gguf", path)
    raise ModelSourceError(f"{path}: not a model (expected a folder, a .safetensors file or a .gguf file)")


def iter_weights(source: ModelSource, progress: bool | None = None, gguf=None):
    """The weights of `source` as (Hugging Face name, tallow Tensor) pairs, one at a time (the model's
    per-parameter loaders copy each into place: no second copy of the model exists). safetensors
    tensors are zero-copy views of the memory-mapped files; GGUF tensors too, except the few the GGUF
    convert changed (see gguf_weights), copied one at a time. `gguf`: a prepared GGUFWeights (the
    model's family), else the registry's for the file. `progress` shows a bar (default: for
    checkpoints over 2 GiB)."""
    if source.kind == "gguf":
        from tallow.loader.gguf_weights import GGUFWeights

        if gguf is None:
            gguf = GGUFWeights(source.gguf)
        if progress is None:
            progress = os.path.getsize(source.path) > PROGRESS_BYTES
        yield from gguf.iter_weights(progress=progress)
        return
    if source.kind != "safetensors":
        raise ModelSourceError(f"unknown model source kind {source.kind!r}")
    ckpt = source.checkpoint()
    names = list(ckpt)
    if progress is None:
        progress = ckpt.nbytes > PROGRESS_BYTES
    if progress:
        from huggingface_hub.utils import tqdm

        names = tqdm(names, desc=f"Loading {os.path.basename(os.path.normpath(source.path))}", unit="tensor")
    for name in names:
        yield name, ckpt[name]


def load_weights(source: ModelSource, progress: bool | None = None) -> dict[str, Any]:
    """All weights of `source` as {Hugging Face name: tallow Tensor} (see iter_weights; tests and tools)."""
    if source.kind not in ("gguf", "safetensors"):
        raise ModelSourceError(f"unknown model source kind {source.kind!r}")
    return dict(iter_weights(source, progress))
