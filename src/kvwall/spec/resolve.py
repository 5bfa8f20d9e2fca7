"""Turn a model argument into a ModelSpec.

A model argument is, in this order: a catalog name (``llama-3-8b``) or the hub
id of a catalog entry (``meta-llama/Meta-Llama-3-8B``); a path to a
``config.json`` or to a checkpoint directory holding one; or, when
``huggingface_hub`` is installed and the hub is reachable, any hub id (only its
config.json is downloaded).
"""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

from kvwall import catalog
from kvwall.errors import KvwallError
from kvwall.spec.hf import spec_from_config
from kvwall.spec.model import ModelSpec

MAX_CONFIG_BYTES = 16 << 20  # a config.json is a few KB; anything this big is not one


def read_config_file(path: Path) -> dict:
    """The JSON in a config file; every way it can be unreadable or not JSON is one line naming the file."""
    _check_regular(path)
    if path.stat().st_size > MAX_CONFIG_BYTES:
        raise KvwallError(f"{path} is {path.stat().st_size / 2**20:,.0f} MiB; a config.json is a few KB: "
                          "pass the model's config.json")
    try:
        text = path.read_bytes().decode("utf-8")
    except OSError as exc:
        raise KvwallError(f"cannot read {path}: {exc.strerror}") from None
    except UnicodeDecodeError as exc:
        raise KvwallError(f"{path} is not UTF-8 text (byte {exc.start}); pass the model's config.json") from None
    return _decode(text, path)


def _decode(text: str, path: Path) -> dict:
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise KvwallError(f"{path} is not valid JSON (line {exc.lineno}, column {exc.colno}: {exc.msg})") from None
    except RecursionError:
        raise KvwallError(f"{path} nests too deeply to be a config.json; pass the model's config.json") from None
    except ValueError as exc:  # e.g. an integer of more digits than Python converts
        raise KvwallError(f"{path} holds a value that cannot be read ({exc}); fix the file") from None


def _check_regular(path: Path) -> None:
    """A path that exists but is no regular file or folder (a FIFO, a device, a symlink loop) gets its own
    line, rather than being taken for a hub id or read forever."""
    try:
        mode = path.stat().st_mode
    except OSError as exc:
        raise KvwallError(f"cannot read {path}: {exc.strerror}") from None
    if stat.S_ISDIR(mode):
        raise KvwallError(f"{path} is a directory, not a config file; pass its config.json or the checkpoint folder")
    if not stat.S_ISREG(mode):
        raise KvwallError(f"{path} is not a regular file (a pipe, socket or device); pass a config.json")


def load_spec(arg: str) -> ModelSpec:
    if not str(arg).strip():
        raise KvwallError("the model name is empty: give a catalog name (`kvwall models`), a config.json, a "
                          "checkpoint folder or a .gguf")
    name = catalog.find_model(arg)
    if name is not None:
        return spec_from_config(catalog.load_model_config(name), name=name, where=f"catalog/{name}.json")
    from kvwall.spec.gguf_meta import PACKAGED, gguf_file, spec_from_gguf

    gguf = gguf_file(arg)
    if gguf is not None:  # a .gguf (or a packaged model's short name): its metadata is the config
        return spec_from_gguf(gguf, name=arg if arg in PACKAGED else None)
    path = _expand(arg)
    if os.path.lexists(path) and not path.is_dir():
        return spec_from_config(read_config_file(path), name=path.stem if path.stem != "config" else path.parent.name,
                                where=str(path))
    if path.is_dir():
        cfg = path / "config.json"
        if not os.path.lexists(cfg):
            raise KvwallError(f"{path} is a directory without config.json; point at a checkpoint directory or a config")
        return spec_from_config(read_config_file(cfg), name=path.name, where=str(cfg))
    if "/" in arg and not arg.startswith((".", "/")) and arg.count("/") == 1:
        return spec_from_config(_hub_config(arg), name=arg.split("/")[1], where=f"{arg}/config.json")
    raise KvwallError(f"unknown model {arg!r}: not a catalog name (see `kvwall models`), a config.json or a "
                      "checkpoint directory")


def _expand(arg: str) -> Path:
    try:
        return Path(arg).expanduser()
    except RuntimeError:  # ~user of a user that does not exist
        raise KvwallError(f"{arg}: no such user's home folder; write the path out in full") from None


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
