"""Serving: continuous batching over the paged KV pool, and an OpenAI-compatible HTTP server.

    blocks.py     BlockManager: the pool's blocks by count, reference counts, prefix-cache hashes (torch-free)
    scheduler.py  Scheduler: waiting/running queues, chunked prefill under a token budget, preemption (torch-free)
    runner.py     Runner: one scheduler step as one forward over the paged pool, sampling (torch)
    server.py     the OpenAI HTTP API over a Runner in its own thread (Starlette + uvicorn)

The policy (blocks, scheduler) is plain Python over block and token counts, so that the predictor's serving
simulator can drive it with step times from the roofline.
"""

import socket


def free_port(host: str = "127.0.0.1") -> int:
    """A port nothing listens on now at `host` (the OS picks it): for a test's or a benchmark's server."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]
