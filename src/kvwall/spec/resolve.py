"""Turn a model argument into a ModelSpec.

A model argument is, in this order: a catalog name (``llama-3-8b``) or the hub
id of a catalog entry (``meta-llama/Meta-Llama-3-8B``); a path to a
``config.json`` or to a checkpoint directory holding one; or, when
``huggingface_hub`` is installed and the hub is reachable, any hub id (only its
config.json is downloaded).
"""

from __future__ import annotations

import json
from pathlib import Path

from kvwall import catalog
from kvwall.errors import KvwallError
from kvwall.spec.hf import spec_from_config
from kvwall.spec.model import ModelSpec


def read_config_file(path: Path) -> dict:
    try:
        text = path.read_text()
    except OSError as exc:
        raise KvwallError(f"cannot read {path}: {exc.strerror}") from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise KvwallError(f"{path} is not valid JSON (line {exc.lineno}, column {exc.colno}: {exc.msg})") from None


def load_spec(arg: str) -> ModelSpec:
    name = catalog.find_model(arg)
    if name is not None:
        return spec_from_config(catalog.load_model_config(name), name=name, where=f"catalog/{name}.json")
    from kvwall.spec.gguf_meta import PACKAGED, gguf_file, spec_from_gguf

    gguf = gguf_file(arg)
    if gguf is not None:  # a .gguf (or a packaged model's short name): its metadata is the config
        return spec_from_gguf(gguf, name=arg if arg in PACKAGED else None)
    path = Path(arg).expanduser()
    if path.is_dir():
        cfg = path / "config.json"
        if not cfg.is_file():
            raise KvwallError(f"{path} is a directory without config.json; point at a checkpoint directory or a config")
        return spec_from_config(read_config_file(cfg), name=path.name, where=str(cfg))
    if path.is_file():
        return spec_from_config(read_config_file(path), name=path.stem if path.stem != "config" else path.parent.name,
                                where=str(path))
    if "/" in arg and not arg.startswith((".", "/")) and arg.count("/") == 1:
        return spec_from_config(_hub_config(arg), name=arg.split("/")[1], where=f"{arg}/config.json")
    raise KvwallError(f"unknown model {arg!r}: not a catalog name (see `kvwall models`), a config.json or a "
                      "checkpoint directory")


def _hub_config(repo_id: str) -> dict:
    try:
        from huggingface_hub import hf_hub_download
    except ImportError:
        raise KvwallError(f"{repo_id!r} is not in the catalog; install huggingface_hub to fetch its config.json, "
                          "or pass a path to the file") from None
    import logging

    _check_reachable(repo_id)
    hub_log = logging.getLogger("huggingface_hub")
    level = hub_log.level
    hub_log.setLevel(logging.CRITICAL)  # its retry warnings would break the one-line error
    try:
        path = hf_hub_download(repo_id, "config.json")
    except Exception as exc:  # network, auth, missing repo: all one message for the user
        raise KvwallError(f"{repo_id!r} is not in the catalog and its config.json could not be fetched from the hub "
                          f"({type(exc).__name__}); download it and pass its path") from None
    finally:
        hub_log.setLevel(level)
    return read_config_file(Path(path))


def _check_reachable(repo_id: str) -> None:
    """Fail in a moment, not after the hub client's retries, when the hub's host does not resolve."""
    import os
    import socket
    from urllib.parse import urlparse

    host = urlparse(os.environ.get("HF_ENDPOINT", "https://huggingface.co")).hostname or "huggingface.co"
    try:
        socket.getaddrinfo(host, 443)
    except OSError:
        raise KvwallError(f"{repo_id!r} is not in the catalog and the hub ({host}) cannot be reached; "
                          "download its config.json and pass its path") from None
