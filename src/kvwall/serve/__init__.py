"""Serving: continuous batching over the paged KV pool, and an OpenAI-compatible HTTP server.

    blocks.py     BlockManager: the pool's blocks by count, reference counts, prefix-cache hashes (torch-free)
    scheduler.py  Scheduler: waiting/running queues, chunked prefill under a token budget, preemption (torch-free)
    runner.py     Runner: one scheduler step as one forward over the paged pool, sampling (torch)
    server.py     the OpenAI HTTP API over a Runner in its own thread (Starlette + uvicorn)

The policy (blocks, scheduler) is plain Python over block and token counts, so that the predictor's serving
simulator can drive it with step times from the roofline.
"""

import contextlib
import socket
import threading
import time


def free_port(host: str = "127.0.0.1") -> int:
    """A port nothing listens on now at `host` (the OS picks it): for a test's or a benchmark's server."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _uvicorn_thread(app, host: str, port: int, **config):
    """uvicorn serving `app` from a thread of its own (it installs no signal handlers there): (server, thread)."""
    import uvicorn

    srv = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level="warning", **config))
    thread = threading.Thread(target=srv.run, name="kvwall-http", daemon=True)
    thread.start()
    return srv, thread


@contextlib.contextmanager
def serving_in_thread(app, host: str = "127.0.0.1", wait_s: float = 10.0):
    """Serve the ASGI `app` with uvicorn from a thread of this process; yields the base URL once it listens,
    and stops it (bounded) on leaving."""
    port = free_port(host)
    srv, thread = _uvicorn_thread(app, host, port)
    deadline = time.monotonic() + wait_s
    while not srv.started and thread.is_alive() and time.monotonic() < deadline:
        time.sleep(0.02)
    try:
        if not srv.started:
            raise RuntimeError(f"the server did not start within {wait_s:g} s")
        yield f"http://{host}:{port}"
    finally:
        srv.should_exit = True
        thread.join(wait_s)


def serve_here(app, worker, host: str, port: int, **config) -> bool:
    """`kvwall serve`'s layout: uvicorn in a thread, the engine loop (`worker`, made with own_thread=False) on this
    one, the main thread, until the server stops. Why: a SmolLM2 prefill step of 32 tokens over 96 cached took
    105 ms there against 128-133 ms in a thread of its own, a decode step 43.0-43.6 against 44.6-46.4 (same
    process, same requests, 2026-12-03). Ctrl-C (or SIGTERM) asks uvicorn to stop: it drains the open requests
    while the engine steps on; a second one stops at once. Never interrupts a step. Returns whether it served."""
    import signal

    srv, thread = _uvicorn_thread(app, host, port, **config)

    def stop(signum, frame):
        srv.force_exit = srv.should_exit  # the second signal: do not wait for open requests
        srv.should_exit = True

    old = {sig: signal.signal(sig, stop) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        worker.run(until=lambda: not thread.is_alive())
    finally:
        for sig, handler in old.items():
            signal.signal(sig, handler)
        srv.should_exit = True
        thread.join(60)
    return srv.started
