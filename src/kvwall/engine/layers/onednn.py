"""Float projections held in oneDNN's own blocked layout on the CPU: reordered once at load and read directly by
oneDNN's matmul, the layout vLLM's CPU build uses. Side by side here (benchmarks/bench_packed_linear.py --rows 1,16
--runs 9 --threads 2, SmolLM2-135M's matrices): 1.3-3.8x faster than F.linear over the column-major weight at 16
rows, and as fast or faster at 1 row. Same values and the same bytes as the float matrix (the predictor's weight
figure at the model's dtype); only the order of each dot product's sum differs (within 1e-4 of F.linear).

The reorder is opaque (a ``torch._mkldnn`` tensor: no storage, not a parameter), so OneDnnLinear keeps
nn.Linear's outside where it is safe: its state_dict holds ``weight`` / ``bias`` like nn.Linear's, and
``dense_weight()`` reads the matrix back (a copy; there is no ``weight`` to write to by mistake).
Transformer.set_eager(True) swaps each back to nn.Linear; a model uses this layout only after
Transformer.prepack() (the loaders call it), never by default, so code that writes parameters in place
(random inits, tests) meets plain nn.Linear.
"""

from __future__ import annotations

import functools

import torch
from torch import nn


@functools.cache
def available(dtype: torch.dtype) -> bool:
    """oneDNN reorders and multiplies `dtype` weights on this CPU (fp32 everywhere it is built; bf16 needs
    AVX512-BF16 or AVX-NE-CONVERT, which torch checks and refuses with an error otherwise)."""
    if not torch.backends.mkldnn.is_available():
        return False
    try:
        w = torch.ops.mkldnn._reorder_linear_weight(torch.ones(8, 8, dtype=dtype))  # (8, 8) opaque
        y = torch.ops.mkldnn._linear_pointwise(torch.ones(2, 8, dtype=dtype), w, None, "none", [], "")  # (2, 8)
        return bool((y == 8).all())
    except (RuntimeError, AttributeError):
        return False


class OneDnnLinear(nn.Module):
    """nn.Linear's contract (y = x W^T + b) over W reordered into oneDNN's layout (see the module doc)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, shadow: bool = False):
        """shadow: a copy of a matrix the model holds elsewhere (a tied head's token table), kept out of the
        state dict, which holds that matrix once under its own name."""
        super().__init__()
        self.shadow = shadow
        self.out_features, self.in_features = weight.shape
        self.dtype = weight.dtype
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous())  # (N, K) opaque
        self.bias = None if bias is None else nn.Parameter(bias.detach(), requires_grad=False)

    @classmethod
    def from_linear(cls, lin: nn.Linear) -> OneDnnLinear:
        return cls(lin.weight, lin.bias)

    def dense_weight(self) -> torch.Tensor:
        """(N, K), a copy in the plain layout. Not a `weight` attribute on purpose: code that writes
        `lin.weight` in place would write to a copy and change nothing; it fails loudly instead."""
        return self.packed.to_dense()

    def linear(self) -> nn.Linear:
        """The same matrix as a plain nn.Linear (row-major weight): the eager path's layout."""
        lin = nn.Linear(self.in_features, self.out_features, bias=self.bias is not None, device="meta")
        lin.weight = nn.Parameter(self.dense_weight(), requires_grad=False)
        if self.bias is not None:
            lin.bias = self.bias
        return lin

    def weight_bytes(self) -> int:
        """The float matrix's bytes (N K at its dtype), the predictor's figure; oneDNN may pad its blocks."""
        return self.out_features * self.in_features * self.dtype.itemsize

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")  # (..., N): one op

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        if self.shadow:
            return
        destination[prefix + "weight"] = self.dense_weight()
        if self.bias is not None:
            destination[prefix + "bias"] = self.bias if keep_vars else self.bias.detach()

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs):
        if self.shadow:  # rebuilt from the table by its owner (Transformer.set_eager) after a load
            return
        for name in ("weight",) + (("bias",) if self.bias is not None else ()):
            if prefix + name not in state_dict:
                missing_keys.append(prefix + name)
        if prefix + "weight" in state_dict:
            self.packed = torch.ops.mkldnn._reorder_linear_weight(state_dict[prefix + "weight"].to(self.dtype))
        if self.bias is not None and prefix + "bias" in state_dict:
            self.bias.data.copy_(state_dict[prefix + "bias"])

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, layout=oneDNN"
