"""`kvwall bench`'s gated_deltanet architecture: Qwen3.5-style, matched in size to the others, its fixed state by
hand equal to the predictor's."""

from __future__ import annotations

from kvwall.measure.archs import ARCHS
from kvwall.predict.memory import Formats, memory
from kvwall.spec.formats import get_format
from kvwall.spec.hf import spec_from_config
from kvwall.spec.model import Attention, GatedDeltaNet


def test_three_gated_deltanet_layers_to_one_gated_attention_at_the_bench_size():
    spec = spec_from_config(ARCHS["gated_deltanet"].config, name="gated_deltanet")
    kinds = [type(layer.mixer) for layer in spec.layers]
    assert kinds == [GatedDeltaNet, GatedDeltaNet, GatedDeltaNet, Attention] * 3
    assert 121.1e6 <= spec.params() <= 144.5e6  # the module's matched range
    fp32 = get_format("fp32")
    report = memory(spec, batch=1, context=1024, formats=Formats(fp32, fp32, fp32))
    # 9 Gated DeltaNet layers: conv (2 x 6 x 64 + 12 x 64 = 1,536 channels) x 4 taps + 12 heads x 64 x 64, fp32
    assert report.fixed_bytes == 9 * (1536 * 4 + 12 * 64 * 64) * 4 == 1_990_656
    # 3 attention layers: K and V of 4 heads x 64 per token
    assert report.cache_bytes - report.fixed_bytes == 3 * 2 * 4 * 64 * 4 * 1024
