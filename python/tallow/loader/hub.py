"""Download a model from the Hugging Face hub (or find it in the local cache) with huggingface_hub.

Only what running the model needs is fetched: config and generation config, tokenizer files,
chat templates and the weights (the safetensors shards the index names; for a GGUF repository
only the one chosen .gguf). huggingface_hub supplies the rest: HF_TOKEN or the token file written
by ``huggingface-cli login`` / ``hf auth login``, HF_ENDPOINT, HF_HOME / HF_HUB_CACHE, HF_HUB_OFFLINE,
and progress bars (HF_HUB_DISABLE_PROGRESS_BARS=1 turns them off).
"""
from __future__ import annotations

import json
import os
import re

# Small files a model may need besides its weights (fetched when present).
META_FILES = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "tokenizer.model",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
    "chat_template.jinja",
    "chat_template.json",
)
META_DIRS = ("additional_chat_templates/",)
SAFETENSORS_INDEX = "model.safetensors.index.json"
LOGIN_HINT = "set HF_TOKEN or run `huggingface-cli login` (`hf auth login`)"


class HubError(ValueError):
    """A model that cannot be fetched from the hub; the message names the repo and the problem."""


class RepoNotFoundError(HubError):
    pass


class GatedRepoAccessError(HubError):
    pass


class NotCachedError(HubError, FileNotFoundError):
    """Offline (or the hub unreachable) and the files are not in the local cache."""


class NoWeightsError(HubError):
    pass


class GGUFChoiceError(HubError):
    """A GGUF repository with several .gguf files and no (or an unknown) --f choice."""


_REPO_ID = re.compile(r"^[\w.\-]+(/[\w.\-]+)?$")
_SPLIT_GGUF = re.compile(r"-\d{5}-of-\d{5}\.gguf$")


def is_repo_id(s: str) -> bool:
    """Looks like "org/name" (or "name") rather than a local path."""
    return bool(_REPO_ID.match(s)) and not s.startswith((".", "/")) and ".." not in s


def _endpoint() -> str:
    from huggingface_hub import constants

    return constants.ENDPOINT


def _has_token(token: str | None) -> bool:
    if token:
        return True
    from huggingface_hub import get_token

    try:
        return bool(get_token())
    except Exception:  # noqa: BLE001 - a broken token store just means "no token"
        return False


def _literal(name: str) -> str:
    """An fnmatch pattern that matches exactly `name`."""
    return re.sub(r"([*?\[])", r"[\1]", name)


def _translate(e: Exception, repo_id: str, token: str | None) -> HubError:
    from huggingface_hub import errors

    if isinstance(e, errors.GatedRepoError):
        why = ("your token has no access to it (accept its terms on the model page, then retry)"
               if _has_token(token) else f"no Hugging Face token was found: accept its terms on the model page, "
               f"then {LOGIN_HINT}")
        return GatedRepoAccessError(f"{repo_id}: gated repository on {_endpoint()}; {why}. "
                                    f"Model page: {_endpoint()}/{repo_id}")
    if isinstance(e, errors.RepositoryNotFoundError):
        hint = "" if _has_token(token) else f"; if it is private, {LOGIN_HINT}"
        return RepoNotFoundError(f"{repo_id}: repository not found on {_endpoint()} (check the name{hint})")
    if isinstance(e, errors.RevisionNotFoundError):
        return HubError(f"{repo_id}: revision not found on {_endpoint()}")
    if isinstance(e, errors.HfHubHTTPError) and e.response is not None and e.response.status_code == 401:
        return GatedRepoAccessError(f"{repo_id}: access denied by {_endpoint()} (401): {LOGIN_HINT}")
    if isinstance(e, errors.LocalEntryNotFoundError):
        return _not_cached(repo_id)
    return HubError(f"{repo_id}: download from {_endpoint()} failed: {e}")


def _not_cached(repo_id: str, what: str = "") -> NotCachedError:
    from huggingface_hub import constants

    why = ("downloads are disabled (HF_HUB_OFFLINE=1)" if constants.is_offline_mode()
           else f"{_endpoint()} cannot be reached")
    what = f" {what}" if what else ""
    return NotCachedError(f"{repo_id}{what}: not in the local Hugging Face cache ({constants.HF_HUB_CACHE}) and "
                          f"{why}")


def choose_files(repo_id: str, files: list[str], gguf_file: str | None = None,
                 read_index=None) -> tuple[str, list[str]]:
    """Pick what to fetch from a repository listing: ("safetensors", [meta..., index, shards]) or
    ("gguf", [the .gguf]). `read_index()` returns the index's weight_map when the listing has one."""
    top = [f for f in files if "/" not in f]
    ggufs = sorted(f for f in files if f.endswith(".gguf"))
    if gguf_file is not None:
        if gguf_file not in files:
            listing = ", ".join(ggufs) if ggufs else "none"
            raise GGUFChoiceError(f"{repo_id}: no file {gguf_file!r} in the repository (GGUF files: {listing})")
        _check_not_split(repo_id, gguf_file)
        return "gguf", [gguf_file]
    meta = [f for f in files if f in META_FILES or f.startswith(META_DIRS)]
    safetensors = sorted(f for f in top if f.endswith(".safetensors"))
    if SAFETENSORS_INDEX in top:
        weight_map = read_index() if read_index is not None else {}
        shards = sorted(set(weight_map.values())) or safetensors
        return "safetensors", meta + [SAFETENSORS_INDEX] + shards
    if safetensors:
        preferred = [f for f in safetensors if f.startswith("model")]
        return "safetensors", meta + (preferred or safetensors)
    models = [f for f in ggufs if "mmproj" not in os.path.basename(f).lower()]
    if len(models) == 1:
        _check_not_split(repo_id, models[0])
        return "gguf", models
    if len(models) > 1:
        raise GGUFChoiceError(f"{repo_id} has {len(models)} GGUF files; choose one with --f FILE: "
                              + ", ".join(models))
    bins = [f for f in top if f.endswith((".bin", ".pt", ".pth"))]
    extra = (f" (it has PyTorch pickle weights {', '.join(bins[:3])}, which tallow does not load; "
             "use a safetensors or GGUF repository)") if bins else ""
    raise NoWeightsError(f"{repo_id}: no weights to load: no *.safetensors or *.gguf files in the repository{extra}")


def _check_not_split(repo_id: str, name: str) -> None:
    if _SPLIT_GGUF.search(name):
        raise HubError(f"{repo_id}: {name} is one part of a split GGUF; split GGUFs are not supported yet "
                       "(merge the parts with llama.cpp's llama-gguf-split --merge)")


def _local_listing(root: str) -> list[str]:
    out = []
    for dirpath, _, names in os.walk(root):
        for n in names:
            out.append(os.path.relpath(os.path.join(dirpath, n), root).replace(os.sep, "/"))
    return out


def download_model(repo_id: str, revision: str | None = None, gguf_file: str | None = None,
                   token: str | None = None) -> str:
    """Fetch (or find in the cache) what running `repo_id` needs and return its local path: the
    snapshot directory for a safetensors model, the .gguf file's path for a GGUF model.
    `gguf_file` picks one .gguf of a GGUF repository. `token` overrides HF_TOKEN / the token file."""
    from huggingface_hub import HfApi, errors, snapshot_download

    if not is_repo_id(repo_id):
        raise HubError(f"{repo_id!r} is neither a local path nor a Hugging Face repository id (org/name)")

    api = HfApi(token=token)
    files: list[str] | None = None
    try:
        info = api.model_info(repo_id, revision=revision)
        files = [s.rfilename for s in (info.siblings or [])]
    except (errors.OfflineModeIsEnabled, ConnectionError, TimeoutError):  # use the cache
        files = None
    except errors.HfHubHTTPError as e:
        raise _translate(e, repo_id, token) from None
    except Exception as e:  # the HTTP client's connection/timeout errors: use the cache
        if not type(e).__module__.startswith(("httpx", "requests", "urllib3")):
            raise
        files = None

    if files is None:  # offline or unreachable: what does the cache hold?
        root = _cached_snapshot(repo_id, revision)
        if root is None:
            raise _not_cached(repo_id)
        listing = _local_listing(root)

        def read_local_index():
            try:
                with open(os.path.join(root, SAFETENSORS_INDEX), encoding="utf-8") as f:
                    return json.load(f).get("weight_map", {})
            except (OSError, ValueError, AttributeError):
                return {}

        kind, wanted = choose_files(repo_id, listing, gguf_file, read_local_index)
        missing = [f for f in wanted if f not in listing]
        if missing:
            raise _not_cached(repo_id, f"file(s) {', '.join(missing)}")
        return os.path.join(root, wanted[0]) if kind == "gguf" else root

    def read_remote_index():
        from huggingface_hub import hf_hub_download

        path = hf_hub_download(repo_id, SAFETENSORS_INDEX, revision=revision, token=token)
        try:
            with open(path, encoding="utf-8") as f:
                return json.load(f).get("weight_map", {})
        except (OSError, ValueError, AttributeError) as e:
            raise HubError(f"{repo_id}: {SAFETENSORS_INDEX} is not a valid index ({e})") from None

    try:
        kind, wanted = choose_files(repo_id, files, gguf_file, read_remote_index)
        absent = [f for f in wanted if f not in files]
        if absent:
            raise HubError(f"{repo_id}: {SAFETENSORS_INDEX} names files the repository does not have: "
                           + ", ".join(absent))
        root = snapshot_download(repo_id, revision=revision, token=token,
                                 allow_patterns=[_literal(f) for f in wanted])
    except HubError:
        raise
    except (errors.HfHubHTTPError, errors.LocalEntryNotFoundError) as e:
        raise _translate(e, repo_id, token) from None
    return os.path.join(root, wanted[0]) if kind == "gguf" else root


def _cached_snapshot(repo_id: str, revision: str | None) -> str | None:
    """The cached snapshot folder of repo_id at revision (a branch, tag or commit), or None."""
    from huggingface_hub import constants
    from huggingface_hub.file_download import repo_folder_name

    storage = os.path.join(constants.HF_HUB_CACHE, repo_folder_name(repo_id=repo_id, repo_type="model"))
    revision = revision or constants.DEFAULT_REVISION
    commit = revision
    ref = os.path.join(storage, "refs", revision)
    if os.path.isfile(ref):
        with open(ref, encoding="utf-8") as f:
            commit = f.read().strip()
    folder = os.path.join(storage, "snapshots", commit)
    return folder if os.path.isdir(folder) else None
