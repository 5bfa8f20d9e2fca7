"""Byte layouts of storage formats, by hand."""

import pytest

from kvwall.errors import KvwallError
from kvwall.spec.formats import get_format


@pytest.mark.parametrize("name, n, expected", [
    ("fp32", 128, 512),
    ("bf16", 128, 256),
    ("fp16", 128, 256),
    ("fp8", 128, 128),
    ("int8", 128, 128 + 1 * (2 + 2)),        # one group of 128: fp16 scale + fp16 zero
    ("int8:g64", 128, 128 + 2 * 4),
    ("int8:g64:sym", 128, 128 + 2 * 2),      # symmetric: no zero point
    ("int4", 128, 64 + 4 * (2 + 2)),         # KIVI-4: groups of 32
    ("int4:g128", 128, 64 + 1 * 4),          # GPTQ/AWQ-style weights
    ("int2", 128, 32 + 4 * 4),
    ("nvfp4", 128, 64 + 8 * 1),              # blocks of 16, one e4m3 scale each
    ("mxfp4", 128, 64 + 4 * 1),              # blocks of 32, one e8m0 scale each
    ("int4", 5, 3 + 1 * 4),                  # 5 nibbles pack into 3 bytes; one partial group
])
def test_vector_bytes(name, n, expected):
    assert get_format(name).vector_bytes(n) == expected


def test_bytes_per_element_of_nvfp4_is_4_5_bits():
    assert get_format("nvfp4").bytes_per_element() * 8 == pytest.approx(4.5)
    assert get_format("mxfp4").bytes_per_element() * 8 == pytest.approx(4.25)


@pytest.mark.parametrize("bad", ["fp7", "int4:x", "nvfp4:g32", "int8:g0", ""])
def test_bad_formats(bad):
    with pytest.raises(KvwallError):
        get_format(bad)


@pytest.mark.parametrize("name", ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K"])
def test_gguf_block_formats_match_ggml(name):
    """Bytes per block equal the gguf package's GGML_QUANT_SIZES (llama.cpp's block structs)."""
    gguf = pytest.importorskip("gguf")
    block, size = gguf.constants.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[name]]
    fmt = get_format(name.lower())
    assert fmt.group == block and fmt.vector_bytes(block) == size
    assert fmt.bytes(3, 4 * block) == 3 * 4 * size
    with pytest.raises(KvwallError, match="fixed layout"):
        get_format(name.lower() + ":g64")


def test_a_weight_format_names_its_head_after_a_slash():
    """q4_1/q8_0: projections in q4_1, the token table and LM head in q8_0; the label reads back the same."""
    from kvwall.spec.formats import head_format, keep_16bit

    fmt = get_format("Q4_1/Q8_0", head_ok=True)
    assert fmt.name == "q4_1" and fmt.head.name == "q8_0" and fmt.label == "q4_1/q8_0"
    assert head_format(fmt).name == "q8_0" and keep_16bit(fmt).name == "bf16"  # norms stay 16-bit
    assert get_format("int4:g128/int8:sym", head_ok=True).label == "int4:g128/int8:g128:sym"
    assert head_format(get_format("int4")).name == "bf16" and head_format(get_format("fp32")).name == "fp32"


@pytest.mark.parametrize("bad", ["int4/", "/int8", "int4/int8/int8", "int4/fp7"])
def test_bad_head_formats(bad):
    with pytest.raises(KvwallError):
        get_format(bad, head_ok=True)


def test_a_kv_format_takes_no_head():
    with pytest.raises(KvwallError, match="only a weight format"):
        get_format("int4/int8")
