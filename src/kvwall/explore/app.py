"""`kvwall explore`'s web app: one page (static/) and a JSON endpoint over kvwall.api.

Every figure the page shows is a field of an api result's ``to_dict()`` (what ``kvwall <command> --json`` prints),
so the page and the command line never disagree. The page's state is a query string whose keys are the command
line's option names (``?model=llama-3-70b&device=h100-sxm&tp=4&kv-format=fp8&batch=8&context=128k``); the same
query, sent to ``POST /api/explore``, gives the same answer, and :func:`commands` spells it as kvwall commands.

Only catalog models or a pasted config.json are accepted: a page must not make kvwall read local paths or fetch
from the hub.
"""

from __future__ import annotations

import json
import shlex
from collections.abc import Mapping
from importlib import resources
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs

from kvwall import api, catalog
from kvwall.errors import KvwallError
from kvwall.predict import devices as dev
from kvwall.spec.model import ModelSpec
from kvwall.units import parse_tokens, whole

STATIC = Path(__file__).with_name("static")
PAGE_FILES = {"explore.js": "text/javascript", "explore.css": "text/css"}
MAX_MODELS = 6  # the issue: "two to six models to compare"
MAX_REQUESTS = 2000  # simulated per update: 5,000 of Llama-3-70B on 4 x H100 took 27 s here (2 busy cores)
PASTED = "config.json"  # a pasted config's name in the commands shown: the user saves it there
# query key (the CLI's option name) -> kvwall.api keyword; `model` (repeated to compare) is apart
KNOBS = {"weight-format": "weight_format", "kv-format": "kv_format", "state-format": "state_format",
         "kv-heads": "kv_heads", "window": "window"}
SIZES = ("tp", "pp", "ep")
DEFAULTS = {"device": api.DEFAULT_DEVICE, "tp": "1", "batch": "1", "context": "4k", "prompt": "2k",
            "output-tokens": "128", "requests": "200"}
ALWAYS = ("device", "tp", "batch", "context", "prompt")  # in every command shown (speed's tp default differs)
OPTIONS = ("model", "device", *SIZES, *KNOBS, "batch", "context", "prompt", "output-tokens", "rate", "requests")
CURVE_FIRST = 1 << 10  # the charts' contexts: powers of two from 1k ...
CURVE_LAST = 1 << 22  # ... to 4x the context asked for (at least 128k), at most 4M, plus the context itself


def plotly_js() -> Path:
    """plotly.min.js as the plotly wheel ships it (the page's charts; served by kvwall, never a CDN)."""
    try:
        path = Path(str(resources.files("plotly") / "package_data" / "plotly.min.js"))
    except ModuleNotFoundError:
        raise KvwallError("kvwall explore draws its charts with plotly.js: pip install 'kvwall[explore]'") from None
    if not path.is_file():
        raise KvwallError(f"the plotly package has no {path.name}: pip install --force-reinstall 'kvwall[explore]'")
    return path


def page_options() -> dict:
    """What the page's pickers offer: catalog models, devices (with `local` once calibrated), formats, defaults."""
    from kvwall.spec.formats import FORMAT_NAMES

    devices = dev.device_names()
    try:
        dev.local_device()
        devices.append("local")
    except KvwallError:
        pass
    return {"models": catalog.model_names(), "lineup": list(catalog.LINEUP), "devices": devices,
            "formats": FORMAT_NAMES, "defaults": DEFAULTS, "options": list(OPTIONS), "max_models": MAX_MODELS}


def parse_query(query: str | Mapping[str, Any]) -> dict[str, Any]:
    """The page's query (a string or a parsed mapping) as {option: value}, `model` a list; unknown keys refused."""
    raw = parse_qs(query.lstrip("?"), keep_blank_values=True) if isinstance(query, str) else dict(query)
    out: dict[str, Any] = {}
    for key, values in raw.items():
        values = [values] if isinstance(values, str) else list(values)
        if key not in OPTIONS:
            raise KvwallError(f"unknown option {key!r} in the page's query; the options are {', '.join(OPTIONS)}")
        values = [v.strip() for v in values if v.strip()]
        if key == "model":
            out["model"] = [m for v in values for m in v.split(",") if m.strip()]
        elif len(values) > 1:
            raise KvwallError(f"{key} is given {len(values)} times in the page's query; give it once")
        elif values:
            out[key] = values[0]
    return out


def _models(opts: dict, config: str | None) -> list[tuple[str, ModelSpec]]:
    """(name in the commands, spec) per model: catalog names, or one pasted config.json."""
    from kvwall.spec.hf import spec_from_config
    from kvwall.spec.resolve import load_spec

    if config is not None and config.strip():
        try:
            data = json.loads(config)
        except json.JSONDecodeError as e:
            raise KvwallError(f"the pasted config.json is not valid JSON (line {e.lineno}, column {e.colno}: "
                              f"{e.msg}); paste the whole file") from None
        name = str(data.get("_name_or_path") or "pasted").rstrip("/").split("/")[-1] if isinstance(data, dict) \
            else "pasted"
        return [(PASTED, spec_from_config(data, name=name or "pasted", where="the pasted config.json"))]
    names = opts.get("model") or []
    if not names:
        raise KvwallError("no model: pick one from the catalog (`kvwall models`) or paste a config.json")
    if len(names) > MAX_MODELS:
        raise KvwallError(f"{len(names)} models: compare at most {MAX_MODELS}")
    out = []
    for n in names:
        found = catalog.find_model(n)
        if found is None:
            raise KvwallError(f"unknown model {n!r}: pick a catalog name (see `kvwall models`) or paste its "
                              "config.json")
        out.append((found, load_spec(found)))
    return out


def _grid(context: int) -> list[int]:
    top = min(max(4 * context, 1 << 17), CURVE_LAST)
    return sorted({1 << k for k in range(CURVE_FIRST.bit_length() - 1, top.bit_length()) if 1 << k <= top}
                  | {context})


def explore(query: str | Mapping[str, Any], config: str | None = None) -> dict:
    """Everything the page shows for a query: the api results' ``to_dict()``, the curves, the commands."""
    opts = parse_query(query)
    models = _models(opts, config)
    o = DEFAULTS | {k: v for k, v in opts.items() if k != "model"}
    knobs = {api_key: o[key] for key, api_key in KNOBS.items() if key in o}
    sizes = {k: o[k] for k in SIZES if k in o}
    device, batch = o["device"], o["batch"]
    ctx, prompt = parse_tokens(o["context"], "context"), parse_tokens(o["prompt"], "prompt")
    specs = [s for _, s in models]
    per_model = []
    for name, spec in models:
        mem = api.memory(spec, context=o["context"], batch=batch, device=device, **knobs, **sizes)
        fit = api.fit(spec, device=device, batch=batch, **knobs, **sizes)
        curve = [{"context": c, "per_gpu_bytes": api.memory(spec, context=c, batch=batch, **knobs, **sizes)
                  .per_gpu_bytes} for c in _grid(ctx)]
        per_model.append({"name": name, "memory": mem.to_dict(), "fit": fit.to_dict(), "curve": curve})
    timing = dict(batch=batch, device=device, **knobs, **sizes)
    speed = {mode: api.speed(specs, context=o["context"], prompt_tokens=o["prompt"], ideal=mode == "ideal",
                             **timing).to_dict() for mode in ("expected", "ideal")}
    curves = {mode: [api.speed(specs, context=c, prompt_tokens=c, ideal=mode == "ideal", **timing).to_dict()
                     for c in _grid(ctx)] for mode in ("expected", "ideal")}
    roof = api.roofline(specs[0], batch=batch, context=o["context"], prompt_tokens=o["prompt"], **knobs, **sizes,
                        device=device)
    sim = None
    if "rate" in o:
        n = api._check(o["requests"], whole(1), "requests")
        if n > MAX_REQUESTS:
            raise KvwallError(f"requests {n:,}: the page simulates at most {MAX_REQUESTS:,} per update; run the "
                              "simulate command it shows for more")
        sim = api.simulate(specs[0], rate=o["rate"], requests=o["requests"], prompt_tokens=prompt,
                           output_tokens=o["output-tokens"], device=device, **knobs, **sizes).to_dict()
    return {"query": canonical(opts, [n for n, _ in models]), "context": ctx, "prompt": prompt, "models": per_model,
            "speed": speed["expected"], "speed_ideal": speed["ideal"],
            "speed_curve": {m: [_curve_point(s) for s in curves[m]] for m in curves},
            "roofline": roof.to_dict(), "roof": {"peak_flops": roof.roof.peak, "bandwidth": roof.roof.bandwidth},
            "simulate": sim, "commands": commands(opts, [n for n, _ in models])}


def _curve_point(s: dict) -> dict:
    """One context of the speed curves: per model, TTFT for a prompt of that length and decode at it."""
    return {m["model"]: {"context": m["decode"][0]["context"], "ttft_s": m["ttft_s"],
                         "tpot_s": m["decode"][0]["tpot_s"], "tokens_per_s": m["decode"][0]["tokens_per_s"],
                         "fits": m["decode"][0]["fits"] and m["ttft_fits"]} for m in s["models"]}


def canonical(opts: dict, names: list[str]) -> str:
    """The query that restores this view (the page's URL); a pasted config is not in it."""
    from urllib.parse import urlencode

    pairs = [("model", n) for n in names if n != PASTED]
    pairs += [(k, opts[k]) for k in OPTIONS if k != "model" and k in opts]
    return urlencode(pairs)


def commands(opts: dict, names: list[str]) -> list[str]:
    """The kvwall commands that print what the page shows (a pasted config: saved as config.json)."""
    o = DEFAULTS | {k: v for k, v in opts.items() if k != "model"}

    def flags(*keys: str) -> list[str]:
        out = []
        for k in keys:
            if k in opts or k in ALWAYS:  # the options whose default differs between commands are always spelled
                out += [f"--{k}", str(o[k])]
        return out

    shared = ("device", *SIZES, *KNOBS)
    out = [["memory", n, *flags(*shared, "batch", "context")] for n in names]
    out += [["fit", n, *flags(*shared, "batch")] for n in names]
    out.append(["speed", *names, *flags(*shared, "batch", "context", "prompt")])
    out.append(["roofline", names[0], *flags(*shared, "batch", "context", "prompt")])
    if "rate" in o:
        out.append(["simulate", names[0], *flags(*shared), "--rate", o["rate"], "--requests", o["requests"],
                    "--prompt-tokens", str(parse_tokens(o["prompt"], "prompt")), "--output-tokens", o["output-tokens"]])
    return ["kvwall " + " ".join(shlex.quote(a) for a in c) for c in out]


def gguf_config(data: bytes) -> dict:
    """The config.json fields of an uploaded .gguf's metadata (the page pastes them as a config)."""
    import tempfile

    from kvwall.spec.gguf_meta import config_from_meta, read_meta

    if not data.startswith(b"GGUF"):
        raise KvwallError("the uploaded file is not a GGUF file (it does not start with 'GGUF'); upload a .gguf "
                          "or a config.json")
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "upload.gguf"
        path.write_bytes(data)
        try:
            return config_from_meta(read_meta(path))
        except KvwallError as e:  # its message names the file: here a temporary copy, not one the user knows
            raise KvwallError(str(e).replace(str(path), "the uploaded .gguf")) from None
        except Exception as e:  # the gguf reader's own errors on a cut or damaged file
            raise KvwallError(f"the uploaded .gguf could not be read ({type(e).__name__}: {e}); upload the whole "
                              "file") from None


def make_app():
    """The Starlette app: the page, its script and style, plotly.min.js, and the JSON endpoints."""
    from starlette.applications import Starlette
    from starlette.concurrency import run_in_threadpool
    from starlette.requests import Request
    from starlette.responses import FileResponse, HTMLResponse, JSONResponse, Response
    from starlette.routing import Route

    plotly = plotly_js()

    async def index(request: Request) -> Response:
        return HTMLResponse((STATIC / "index.html").read_text(encoding="utf-8"))

    async def static(request: Request) -> Response:
        name = request.path_params["name"]
        if name == "plotly.min.js":
            return FileResponse(plotly, media_type="text/javascript")
        if name not in PAGE_FILES:
            return JSONResponse({"error": f"no file {name!r}"}, status_code=404)
        return FileResponse(STATIC / name, media_type=PAGE_FILES[name])

    async def options(request: Request) -> Response:
        return JSONResponse(await run_in_threadpool(page_options))

    async def explore_route(request: Request) -> Response:
        try:
            body = json.loads(await request.body() or b"{}")
            if not isinstance(body, dict):
                raise KvwallError('the request body must be a JSON object: {"query": "...", "config": "..."}')
            result = await run_in_threadpool(explore, str(body.get("query") or ""), body.get("config"))
        except KvwallError as e:
            return JSONResponse({"error": str(e)}, status_code=400)
        except json.JSONDecodeError as e:
            return JSONResponse({"error": f"the request body is not JSON ({e.msg})"}, status_code=400)
        return JSONResponse(result)

    async def gguf_route(request: Request) -> Response:
        try:
            config = await run_in_threadpool(gguf_config, await request.body())
        except KvwallError as e:
            return JSONResponse({"error": str(e)}, status_code=400)
        return JSONResponse({"config": config})

    return Starlette(routes=[
        Route("/", index), Route("/static/{name}", static), Route("/api/options", options),
        Route("/api/explore", explore_route, methods=["POST"]), Route("/api/gguf", gguf_route, methods=["POST"]),
    ])
