"""The report's 2025-26 lineup section: numbers checked by hand from the public configs in the catalog."""

from kvwall import catalog
from kvwall.predict.memory import Formats
from kvwall.report import lineup
from kvwall.spec.resolve import load_spec


def test_gpt_oss_windows_halve_the_cache_at_1m():
    """gpt-oss-120b: 36 layers alternating 128-token windows and full attention, 8 KV heads of 64: one token of a
    full layer is 2 x 8 x 64 x 2 B = 2 KiB. At 2^20 tokens the 18 full layers hold 18 x 2 KiB x 2^20 = 36 GiB (the
    18 windowed ones 18 x 128 x 2 KiB = 4.5 MiB more); every layer full would be 72 GiB."""
    spec = load_spec("gpt-oss-120b")
    fm = Formats.for_spec(spec)
    assert lineup.mechanism(spec) in ("18 sliding + 18 attention", "18 attention + 18 sliding")
    assert lineup.all_full_bytes(spec, fm, 1 << 20) == 36 * 2 * 1024 * 2**20
    assert "at 1M tokens one sequence holds 36 GiB, 2.0x less than the 72 GiB" in lineup.buys(spec, fm)


def test_dsa_reads_the_indexer_keys_and_top_k_latents():
    """DeepSeek-V3.2 at 128k, batch 1: every one of the 61 layers reads the indexer key of each cached token
    (128 fp8 values + one fp32 scale = 132 B) and the 2,048 chosen latents of (512 + 64) x 2 B = 1,152 B; it holds
    128k x (1,152 + 132) B per layer."""
    spec = load_spec("deepseek-v3.2")
    fm = Formats.for_spec(spec)
    context = 131072
    reads, held = lineup.decode_reads(spec, fm, context)
    assert held == 61 * context * (1152 + 132)
    assert reads == 61 * (context * 132 + 2048 * 1152)


def test_the_section_has_one_row_and_one_sentence_per_model(tmp_path):
    section = lineup.section(tmp_path)
    assert [r[0] for r in section.tables[0].rows] == [load_spec(n).name for n in catalog.LINEUP_2025]
    assert len(section.paragraphs) == 1 + len(catalog.LINEUP_2025)
    assert (tmp_path / "cache-vs-context-2025.png").stat().st_size > 1000
    deepseek = next(r for r in section.tables[0].rows if r[0] == "deepseek-v3.2")
    h200 = dict(zip(section.tables[0].columns, deepseek, strict=True))["h200 @128k"]
    assert deepseek[2].endswith("fp8") and h200 == "tp 8"  # fits eight H200s at 128k in its own FP8
