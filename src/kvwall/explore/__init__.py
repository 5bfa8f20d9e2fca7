"""`kvwall explore`: a local web page for sizing a deployment, drawn from kvwall.api (see app.py)."""

DEFAULT_PORT = 8765  # `kvwall explore`'s address is http://127.0.0.1:8765/ unless --port (the report links to it)
