"""kvwall: what remembering the context costs a language model at decode time.

The predictor's Python API lives in :mod:`kvwall.api`; its functions and result types are also here, imported on
first use so that ``import kvwall`` stays light: ``kvwall.memory("llama-3-8b", context="128k")``. One exception:
``kvwall.simulate`` is the simulator's module, so the simulate function is ``kvwall.api.simulate``.
"""

__version__ = "0.1.0"

_API = ("memory", "fit", "compare", "roofline", "speed", "validate", "MemoryResult", "FitResult", "CompareResult",
        "CompareRow", "RooflineResult", "RooflinePoint", "SpeedResult", "SpeedRow", "SpeedPoint", "SimulateResult",
        "SimulatePoint", "ValidateResult")


def __getattr__(name: str):
    if name in _API:
        from kvwall import api

        return getattr(api, name)
    raise AttributeError(f"module 'kvwall' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_API))
