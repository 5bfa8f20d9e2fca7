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


@contextlib.contextmanager
def serving_in_thread(app, host: str = "127.0.0.1", wait_s: float = 10.0):
    """Serve the ASGI `app` with uvicorn from a thread of this process, as `kvwall serve` runs it; yields the
    base URL once it listens, and stops it (bounded) on leaving."""
    import uvicorn

    port = free_port(host)
    srv = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level="warning"))
    thread = threading.Thread(target=srv.run, daemon=True)
    thread.start()
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
