"""Where an engine's model config comes from: the ``config.json`` kvpool plans a pool from, in
the model directory, else in the local Hugging Face cache (as the engines load it;
``HF_HUB_OFFLINE`` is honoured). Engine-neutral: imports neither engine."""

from __future__ import annotations

from pathlib import Path

from kvpool.contract.errors import FailedPrecondition


def hf_config_path(model: str, revision: str | None = None, *, field: str,
                   missing_ok: bool = False) -> Path | None:
    """The ``config.json`` of ``model`` (a directory or a Hugging Face repo id).

    Args:
        field: the engine's name of the model knob, for errors (``model_path``, ``model``).
        missing_ok: None instead of an error when the Hugging Face cache has no config for
            a repo id (the engine found the model some other way).

    Raises:
        FailedPrecondition: a local directory without config.json; without ``missing_ok``, a
            repo whose config.json could not be found (naming it and why).
    """
    local = Path(model).expanduser()
    if local.is_dir():
        config = local / "config.json"
        if not config.is_file():
            raise FailedPrecondition(
                f"the model directory {local} has no config.json; kvpool plans the pool from "
                "the model's Hugging Face config", field=field)
        return config
    try:
        from huggingface_hub import hf_hub_download

        return Path(hf_hub_download(model, "config.json", revision=revision))
    except Exception as exc:
        if missing_ok:
            return None
        raise FailedPrecondition(
            f"could not find config.json of model {model!r} (revision {revision}): "
            f"{exc}", field=field) from exc
