"""Absorbed MLA decode attention over the latent cache in one C++ pass (kernels/mla_decode.cpp, built on first use).

For one new token per row, the absorbed path attends H query heads (each q_lat (r) and q_rot (d_r))
over S cached tokens (each a latent c (r) and a rope key pe (d_r)), all heads sharing one key and
value row per token:

    score[h, s] = (q_lat[h] . c[s] + q_rot[h] . pe[s]) * scale       o_lat[h] = Σ_s softmax(score[h])_s c[s]

In torch these are two matmuls of a 12-row matrix against the whole cache; at that shape the BLAS
reaches ~10 GB/s here, far below what streaming the cache allows. This kernel reads each token's
row once per chunk of tokens for all heads: S is cut into chunks processed in parallel, each chunk
keeps its own softmax statistics (max, sum, weighted latent), and the chunks are merged at the
end (the split softmax of flash decoding). Masking follows attention.visible: slot s is seen when
0 <= k_pos[s] <= p, and a padding query (p < 0) sees every slot.
"""

from __future__ import annotations

import functools

from kvwall.engine.native import compiled


@functools.lru_cache(maxsize=1)
def mla_decode():
    """The compiled ``mla_decode`` of kernels/mla_decode.cpp (its arguments are documented there), or None if it
    cannot be built."""
    return compiled("mla_decode", "mla_decode", "the torch absorbed path")


@functools.lru_cache(maxsize=1)
def mla_decode_picked():
    """The compiled ``mla_decode_picked`` of kernels/mla_decode.cpp (DeepSeek Sparse Attention's decode: the same
    attention over the top-k slots each row picked, read where they lie in the cache), or None if it cannot be built."""
    return compiled("mla_decode", "mla_decode_picked", "the torch gather and absorbed path")
