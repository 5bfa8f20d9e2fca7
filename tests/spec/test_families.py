"""The family registry: every supported model_type parses, and the engine's list is derived from it."""

from kvwall.spec.families import FAMILIES, engine_families, supported


def test_every_family_either_runs_in_the_engine_or_says_why_not():
    for name, fam in FAMILIES.items():
        assert fam.model_type == name
        assert fam.runs_in_engine or fam.why_not, name


def test_qwen2_moe_and_the_gated_deltanet_families_run_in_the_engine():
    """Their sigmoid-gated shared expert and Gated DeltaNet layers are built (tests/engine/test_gated_deltanet.py)."""
    for name in ("qwen2_moe", "qwen3_next", "qwen3_5_text", "qwen3_5_moe_text"):
        assert name in supported() and name in engine_families() and FAMILIES[name].layout == "llama"
