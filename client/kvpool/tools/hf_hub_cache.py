"""A model config named the way SGLang's ``--model-path`` names it: a local path, or a Hugging
Face Hub id found in this machine's Hub cache (the CLI never downloads anything)."""

from __future__ import annotations

import os
import re
from pathlib import Path

from kvpool.contract.errors import InvalidArgument

# owner/name, as the Hub spells a model id (a bare name is a path here: too ambiguous).
HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def hub_cache_dir() -> Path:
    """Where huggingface_hub keeps downloads: ``$HF_HUB_CACHE``, else ``$HF_HOME/hub``, else
    ``$XDG_CACHE_HOME/huggingface/hub``, else ``~/.cache/huggingface/hub``."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"])
    if os.environ.get("HF_HOME"):
        return Path(os.environ["HF_HOME"]) / "hub"
    cache = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(cache) / "huggingface" / "hub"


def cached_config(model_id: str, cache: Path) -> Path | None:
    """``config.json`` of ``model_id`` in the Hub cache ``cache``: the snapshot ``refs/main``
    points at, else the newest snapshot that has one; None when the cache has none."""
    repo = cache / ("models--" + model_id.replace("/", "--"))
    main = repo / "refs" / "main"
    if main.is_file():
        config = repo / "snapshots" / main.read_text().strip() / "config.json"
        if config.is_file():
            return config
    snapshots = sorted((repo / "snapshots").glob("*/config.json"),
                       key=lambda p: p.stat().st_mtime, reverse=True)
    return snapshots[0] if snapshots else None


def local_model_config(path: Path, field: str) -> Path:
    """``path`` when it exists; a Hub id (``meta-llama/Llama-3.1-8B``) as its cached
    ``config.json``; else a refusal that says what the flag reads.

    Args:
        path: what the user gave (``--hf-config``, ``--model-config``).
        field: the argument's destination (the error names its flag).

    Returns:
        A path that exists.

    Raises:
        InvalidArgument: neither a local file or directory nor a Hub id in the local cache.
    """
    if path.exists() or not HUB_ID.match(str(path)):
        return path
    cache = hub_cache_dir()
    config = cached_config(str(path), cache)
    if config is not None:
        return config
    raise InvalidArgument(
        f"no file or directory {str(path)!r}; it reads a local config.json (or a model "
        f"directory), and a Hugging Face Hub id only from the local Hub cache ({cache}), which "
        f"has no config of {path}: `hf download {path} config.json` fetches it (and prints its "
        "path)", field=field)
