"""The engine loop in its own thread: requests and aborts come in on a queue, tokens go out to each request's
asyncio queue (the HTTP side never touches the runner while it steps).

Events pushed to a Handle: ("prompt", logprobs) once its prompt is scored (when it asked for that), ("token", id,
logprobs or None) per new token, then ("done", "stop" | "length"), or ("error", message).
An abort (a client that went away, a stop string found in the text) frees the request's blocks before
the next step.
"""

from __future__ import annotations

import asyncio
import queue
import threading
from dataclasses import dataclass, field

from kvwall.engine.generate import Sampling
from kvwall.errors import KvwallError
from kvwall.serve.logits import NONE, Rules
from kvwall.serve.runner import Runner
from kvwall.serve.scheduler import Request


@dataclass(eq=False)
class Handle:
    request: Request
    sampling: Sampling
    loop: asyncio.AbstractEventLoop
    rules: Rules = NONE  # penalties, biases, min_tokens, and the logprobs it wants back
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    finished: bool = False  # done, aborted or failed: nothing more will come

    def push(self, event: tuple) -> None:
        """From the engine thread: hand an event to the request's coroutine on its event loop."""
        self.loop.call_soon_threadsafe(self.events.put_nowait, event)


class Worker:
    def __init__(self, runner: Runner):
        self.runner = runner
        self.inbox: queue.Queue = queue.Queue()
        self.handles: dict[Request, Handle] = {}
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self._loop, name="kvwall-engine", daemon=True)

    def start(self) -> None:
        self.thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        self.stopping.set()
        self.inbox.put(None)
        self.thread.join(timeout)

    def submit(self, h: Handle) -> None:
        self.inbox.put(("add", h))

    def abort(self, h: Handle) -> None:
        h.finished = True
        self.inbox.put(("abort", h))

    def _loop(self) -> None:
        while not self.stopping.is_set():
            self._drain(wait=not self.runner.sched.has_work())
            if self.runner.sched.has_work():
                self._step()
        for h in list(self.handles.values()):  # shutting down: nobody is left waiting
            h.push(("error", "the server is shutting down"))

    def _drain(self, wait: bool) -> None:
        """Apply every queued add/abort; when idle, wait a little for the first one."""
        try:
            item = self.inbox.get(timeout=0.2) if wait else self.inbox.get_nowait()
            while True:
                self._apply(item)
                item = self.inbox.get_nowait()
        except queue.Empty:
            return

    def _apply(self, item) -> None:
        if item is None:
            return
        kind, h = item
        if kind == "add" and h.finished:  # a request aborted before it was added is just dropped; marked so that
            h.request.finish = "abort"    # no sibling waits for its prompt (Request.after)
        elif kind == "add":
            try:
                self.runner.add(h.request, h.sampling, h.rules)
                self.handles[h.request] = h
            except KvwallError as e:
                h.request.finish = "abort"
                h.push(("error", str(e)))
            except Exception as e:  # a bug must fail this request, not stop the engine thread
                h.request.finish = "abort"
                h.push(("error", f"the engine could not take the request: {e}"))
        elif kind == "abort" and self.handles.pop(h.request, None) is not None:
            self.runner.abort(h.request)

    def _step(self) -> None:
        try:
            step, done = self.runner.step()
        except Exception as e:  # an engine failure fails the requests in flight, not the server
            self._fail_all(f"the engine failed: {e}")
            return
        for r, message in step.failed.items():  # this request alone: the others of the step go on
            h = self.handles.pop(r, None)
            if h is not None:
                h.push(("error", message))
        for r, logprobs in self.runner.scored.items():
            h = self.handles.get(r)
            if h is not None:
                h.push(("prompt", logprobs))
        for r, token in step.sampled.items():
            h = self.handles.get(r)
            if h is not None:
                h.push(("token", token, self.runner.token_logprobs.get(r)))
        for r in done:
            h = self.handles.pop(r, None)
            if h is not None:
                h.push(("done", r.finish))

    def _fail_all(self, message: str) -> None:
        for r, h in list(self.handles.items()):
            self.runner.abort(r)
            h.push(("error", message))
        self.handles.clear()
