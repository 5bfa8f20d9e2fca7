"""Decode attention read straight from the quantized cache's packed bytes (C++, built on first use).

The source is kernels/quantized_decode.cpp.

Why: the torch path dequantizes every held token to fp32 each step (unpack, scale, add zero, copy
next to the residual) and then runs attention over the copy: several fp32 passes over the whole
cache per token, so an int8 cache decoded many times slower than an fp32 one although it holds a
quarter of the bytes. This kernel reads each packed byte once and folds the scales into the small
side of each product instead:

    keys, per channel (chunk c of G tokens):  k[t, d] = z[c, d] + s[c, d] q_k[t, d]
        score[t] = Σ_d (q[d] s[c, d]) q_k[t, d] + Σ_d q[d] z[c, d]           (scaled query, one bias per chunk)
    values, per token (groups of gv channels):  v[t, j] = z[t, g] + s[t, g] q_v[t, j]
        out[j]   = Σ_t (p[t] s[t, g]) q_v[t, j] + Σ_t p[t] z[t, g]           (scaled probability, one sum per group)

Symmetric formats are the same with z = -2^(bits-1) s. The full-precision residual (the newest
tokens) is attended in the same call, so one layer's decode attention is one call.
"""

from __future__ import annotations

import functools

from kvwall.engine.native import compiled


@functools.lru_cache(maxsize=1)
def quantized_decode():
    """The compiled ``quantized_decode`` of kernels/quantized_decode.cpp (arguments documented there),
    or None if it cannot be built."""
    return compiled("quantized_decode", "quantized_decode", "attention over dequantized copies (torch)")
