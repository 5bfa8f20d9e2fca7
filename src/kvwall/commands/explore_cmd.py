"""`kvwall explore`: a local web page for sizing a deployment (kvwall.explore), on 127.0.0.1 only."""

from __future__ import annotations

import argparse
import socket
import sys

from kvwall.errors import KvwallError
from kvwall.explore import DEFAULT_PORT
from kvwall.units import whole

HOST = "127.0.0.1"  # this machine only: the page is a local tool, with no login


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("explore", help="an interactive page: pick a model, device, formats and workload; see bytes, "
                       "fit, speed, the roofline and serving (the predictor in a browser, on 127.0.0.1)")
    p.add_argument("--port", type=whole(0, 65535), default=DEFAULT_PORT,
                   help=f"default {DEFAULT_PORT}; 0 picks a free port")
    p.add_argument("--open", action="store_true", help="open the page in this machine's web browser")
    p.set_defaults(func=cmd_explore)


def cmd_explore(args) -> int:
    app = make()
    sock = listen(args.port)
    url = f"http://{HOST}:{sock.getsockname()[1]}/"
    print(f"kvwall explore: {url} (Ctrl-C stops)", file=sys.stderr, flush=True)
    if args.open:
        import webbrowser

        webbrowser.open(url)
    server(app).run(sockets=[sock])
    return 0


def make():
    """The app, or a one-line error naming what to install."""
    try:
        import starlette  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError:
        raise KvwallError("kvwall explore needs starlette and uvicorn: pip install 'kvwall[explore]'") from None
    from kvwall.explore.app import make_app

    return make_app()


def listen(port: int) -> socket.socket:
    """A socket listening on 127.0.0.1:port (0: a free one), or a one-line error when the port is taken."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((HOST, port))
    except OSError as e:
        sock.close()
        raise KvwallError(f"cannot listen on {HOST}:{port} ({e.strerror}); pick another --port (0: any free one)") \
            from None
    sock.listen(128)
    return sock


def server(app):
    """A uvicorn server for the app (run it with .run(sockets=[listen(port)]))."""
    import uvicorn

    return uvicorn.Server(uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=5))
