"""The family registry: every supported model_type parses, and the engine's list is derived from it."""

from kvwall.spec.families import FAMILIES, engine_families, supported


def test_every_family_either_runs_in_the_engine_or_says_why_not():
    for name, fam in FAMILIES.items():
        assert fam.model_type == name
        assert fam.runs_in_engine or fam.why_not, name


def test_qwen2_moe_parses_but_the_engine_says_it_does_not_run_it():
    assert "qwen2_moe" in supported() and "qwen2_moe" not in engine_families()
    assert "shared expert" in FAMILIES["qwen2_moe"].why_not
