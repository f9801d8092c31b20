"""Models named by a Hugging Face Hub repo id (`Qwen/Qwen3-8B`) wherever a directory is expected.

`local_dir` turns a name into a directory: an existing local directory is used as it is; a bucket URI's
model files are copied into a local cache (dflash_jax/runtime/paths.py) and that copy is used; otherwise a name shaped `owner/name` is a Hub repo, fetched with `huggingface_hub.snapshot_download` into the
Hugging Face cache (HF_HOME / HF_HUB_CACHE) or found there, and its snapshot directory is returned. With
HF_HUB_OFFLINE=1 only the cache is looked at. Only what loading needs is downloaded: configs, tokenizer
files and safetensors weights (not PyTorch .bin or GGUF copies). Anything else is one CheckpointError line.
"""

from __future__ import annotations

import os
import re

from dflash_jax.runtime.errors import CheckpointError
from dflash_jax.runtime.paths import is_url, local_copy

REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")  # owner/name, as the Hub spells repo ids
MODEL_FILES = ["*.json", "*.safetensors", "*.jinja", "*.txt", "*.model", "*.tiktoken"]


def pretrained_dir(name: str | os.PathLike) -> str:
    """What a transformers `from_pretrained` (tokenizer, generation config) is given for `name`: a bucket
    URI's local copy (it reads local directories and Hub ids only), anything else as it is."""
    return local_dir(name) if is_url(name) else os.fspath(name)


def local_dir(name: str | os.PathLike, what: str = "model") -> str:
    """A directory holding the model `name` names (see the module docstring); `what` ("target", "drafter")
    goes into the error message."""
    name = os.fspath(name)
    if is_url(name):
        return local_copy(name, MODEL_FILES)
    if os.path.isdir(name) or not REPO_ID.match(name):
        return name  # a path: whoever reads it reports what is missing there
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import (GatedRepoError, HfHubHTTPError, LocalEntryNotFoundError,
                                        RepositoryNotFoundError)
    try:
        return snapshot_download(name, allow_patterns=MODEL_FILES)
    except GatedRepoError:
        raise CheckpointError(f"{what} {name!r}: a gated Hub repo; accept its terms on the Hub and log in "
                              f"(hf auth login)") from None
    except RepositoryNotFoundError:
        raise CheckpointError(f"{what} {name!r} is neither a local directory nor a model on the Hugging Face Hub "
                              f"(a private one needs hf auth login)") from None
    except LocalEntryNotFoundError:
        where = "HF_HUB_OFFLINE is set" if constants.HF_HUB_OFFLINE else "the Hub could not be reached"
        raise CheckpointError(f"{what} {name!r} is neither a local directory nor in the Hugging Face cache "
                              f"{constants.HF_HUB_CACHE}, and {where}") from None
    except (HfHubHTTPError, OSError) as error:
        raise CheckpointError(f"{what} {name!r}: downloading it from the Hugging Face Hub failed: "
                              f"{' '.join(str(error).split())}") from None
