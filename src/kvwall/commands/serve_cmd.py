"""`kvwall serve MODEL`: the OpenAI HTTP API over continuous batching on a paged KV pool (kvwall.serve)."""

from __future__ import annotations

import argparse
import socket
import sys
from pathlib import Path

from kvwall.commands import common
from kvwall.commands.engine_cmds import CHECKPOINT_HELP
from kvwall.errors import KvwallError
from kvwall.spec.formats import get_format
from kvwall.units import fmt_bytes, parse_bytes, whole

POOL_DTYPES = ("fp32", "bf16", "fp16", "fp8")  # serve.runner.POOL_FORMATS (torch-free here); plus int8 / int4


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("serve", help="serve a model over the OpenAI HTTP API (continuous batching, paged KV pool)")
    p.add_argument("checkpoint", help=CHECKPOINT_HELP)
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=whole(1, 65535), default=8000, help="default 8000")
    p.add_argument("--kv-memory", default="512MiB", metavar="SIZE",
                   help="KV pool size, e.g. 512MiB (default); at most this machine's memory")
    p.add_argument("--cache", default=None, metavar="FORMAT",
                   help=f"what the pool stores K/V as: {', '.join(POOL_DTYPES)}, or int8 / int4 quantized per token "
                   "(:gN group, :sym; e.g. int4:g32) (default: the model's dtype)")
    p.add_argument("--block-size", type=whole(1, 1 << 16), default=16, help="tokens per KV block (default 16)")
    p.add_argument("--max-batch", type=whole(1, 1 << 16), default=64, help="most requests running at once (default 64)")
    p.add_argument("--chunk", type=whole(1, 1 << 24), default=512, metavar="TOKENS",
                   help="token budget of one step: prefill chunks + decode tokens (default 512)")
    common.add_threads(p)
    p.add_argument("--dtype", default="float32", help="model weights: float32, bfloat16 or float16 (default float32)")
    common.add_weights(p)
    p.add_argument("--name", help="the model name clients send (default: the checkpoint's name)")
    p.add_argument("--api-key", metavar="KEY", help="require Authorization: Bearer KEY on every /v1/ route "
                   "(/health and /metrics stay open)")
    p.set_defaults(func=cmd_serve)


def cmd_serve(args) -> int:
    from kvwall.commands.common import need_torch
    from kvwall.commands.engine_cmds import _checkpoint

    _check_given(args)
    kv_memory = parse_bytes(args.kv_memory, "--kv-memory")
    _check_fits_memory(args.kv_memory, kv_memory)
    if args.cache is not None:
        _check_pool_format(args.cache)
    path = _checkpoint(args.checkpoint)
    need_torch("serving needs torch")
    _need_server_stack()
    _check_port(args.host, args.port)
    return _run(args, path, kv_memory)


def _check_given(args) -> None:
    """An empty --api-key (an unset $KEY in --api-key "$KEY") would serve with no key at all, an empty --name
    the default: one-line errors instead."""
    if args.api_key is not None and not args.api_key.strip():
        raise KvwallError("--api-key is empty (an unset variable in --api-key \"$KEY\"?): give the key clients "
                          "must send, or leave --api-key out to serve without one")
    if args.name is not None and not args.name.strip():
        raise KvwallError("--name is empty: give the model name clients send, or leave --name out for the "
                          "checkpoint's name")


def _check_fits_memory(text: str, kv_memory: int) -> None:
    """The pool is allocated up front in this machine's memory: a one-line error, before the model loads, for one
    that cannot fit (--kv-memory 1000TB built a free list of 1.2e11 blocks until it ran out)."""
    from kvwall.measure.machine import memory_bytes

    ram = memory_bytes()
    if kv_memory > ram:
        raise KvwallError(f"--kv-memory {text} ({fmt_bytes(kv_memory)}) is more than this machine's memory "
                          f"({fmt_bytes(ram)}); give a smaller --kv-memory")


def _check_pool_format(text: str) -> None:
    """A one-line error, before the model loads, for a --cache the pool cannot store."""
    if text in POOL_DTYPES:
        return
    fmt = get_format(text)
    if fmt.is_float() or fmt.fixed or fmt.group is None:
        raise KvwallError(f"--cache {text!r}: the paged pool stores {', '.join(POOL_DTYPES)}, int8 or int4 (:gN, :sym)")


def _need_server_stack() -> None:
    try:
        import starlette  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError:
        raise KvwallError("serving needs starlette and uvicorn: pip install 'kvwall[serve]'") from None


def _check_port(host: str, port: int) -> None:
    """A one-line error before the model loads when the address is taken or not this machine's."""
    try:
        with socket.create_server((host, port)):
            pass
    except OSError as e:
        raise KvwallError(f"cannot listen on {host}:{port} ({e.strerror}); pick another --port or --host") from None


def _run(args, path: Path, kv_memory: int) -> int:
    import uvicorn

    from kvwall.engine.load import load_model
    from kvwall.engine.tokenizer import load_tokenizer
    from kvwall.serve.runner import Runner
    from kvwall.serve.server import Api
    from kvwall.serve.worker import Worker

    model = load_model(path, args.dtype, weights=args.weights)
    kv_dtype = args.cache  # a name: serve.runner.make_pool makes the pool for it
    auto = common.use_threads(args)
    runner = Runner(model, kv_memory=kv_memory, block_size=args.block_size, chunk=args.chunk,
                    max_batch=args.max_batch, kv_dtype=kv_dtype, adapt_threads=auto)
    runner.warm_up()  # before the server says it is up
    name = args.name or Path(args.checkpoint).name
    pool = runner.sched.pool
    print(f"kvwall serve: {name} at http://{args.host}:{args.port}/v1; KV pool {pool.n_blocks} blocks of "
          f"{pool.block_size} tokens ({fmt_bytes(pool.n_blocks * runner.block_bytes)}); Ctrl-C stops",
          file=sys.stderr)
    api = Api(Worker(runner), load_tokenizer(path), name, args.api_key)
    uvicorn.run(api.app(), host=args.host, port=args.port, log_level="warning", timeout_graceful_shutdown=30)
    return 0
