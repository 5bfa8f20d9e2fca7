"""A continuous-batching step (prefill chunks and decode tokens in one forward): per-token ops once over all
the tokens, per-sequence ops summed over the groups, weights read once."""

import pytest

from kvwall.predict.devices import get_device
from kvwall.predict.memory import Formats
from kvwall.predict.ops import mixed_ops, step_ops
from kvwall.predict.roofline import Roof, run_mix, run_step
from kvwall.predict.step import Step
from kvwall.spec.resolve import load_spec


@pytest.mark.parametrize("model", ["llama-2-7b", "mixtral-8x7b", "deepseek-v3", "jamba-v0.1", "mamba2-2.7b"])
@pytest.mark.parametrize("step", [Step(4, 99, 1), Step(1, 0, 64), Step(2, 32, 16)])
def test_one_group_is_the_plain_step(model, step):
    spec = load_spec(model)
    fm = Formats.for_spec(spec)
    mine, plain = mixed_ops(spec, [step], fm), step_ops(spec, step, fm)
    assert [o.as_dict() for o in mine] == [o.as_dict() for o in plain]


def test_llama2_mixed_step_by_hand():
    """Llama-2-7B (hidden 4096, 32 heads of 128, vocab 32000), bf16: 2 sequences decoding at context 100
    and one 16-token prefill chunk, 18 tokens in all."""
    spec = load_spec("llama-2-7b")
    ops = mixed_ops(spec, [Step(2, 99, 1), Step(1, 0, 16)], Formats.for_spec(spec))
    decode, chunk = [o for o in ops if o.name == "attention" and o.layer == 0]  # one op per kernel
    assert (decode.kernel, chunk.kernel) == ("attention", "attention:prefill")
    token_bytes = 32 * (128 + 128) * 2  # K and V of every head, 2 bytes each
    assert (decode.cache_read, chunk.cache_read) == (2 * 100 * token_bytes, 16 * token_bytes)
    assert (decode.cache_write, chunk.cache_write) == (2 * token_bytes, 16 * token_bytes)
    # each decode query sees 100 keys; the chunk is causal
    assert (decode.flops, chunk.flops) == (2 * 32 * (128 + 128) * 2 * 100, 2 * 32 * (128 + 128) * 16 * 17 // 2)
    qkv = next(o for o in ops if o.name == "qkv_proj" and o.layer == 0)
    assert qkv.flops == 2 * 18 * 4096 * 3 * 4096 and qkv.weight_bytes == 4096 * 3 * 4096 * 2
    head = ops[-1]
    assert head.name == "lm_head" and head.flops == 2 * 3 * 4096 * 32000


def test_mixed_step_time_shares_the_weights():
    spec = load_spec("llama-3-8b")
    fm, roof = Formats.for_spec(spec), Roof(get_device("h100"))
    decode, chunk = Step(8, 1023, 1), Step(1, 0, 256)
    both = run_mix(spec, [decode, chunk], fm, roof).time_s
    apart = run_step(spec, decode, fm, roof).time_s + run_step(spec, chunk, fm, roof).time_s
    assert max(run_step(spec, decode, fm, roof).time_s, run_step(spec, chunk, fm, roof).time_s) < both < apart


def test_bad_groups():
    spec = load_spec("llama-2-7b")
    with pytest.raises(ValueError):
        mixed_ops(spec, [], Formats.for_spec(spec))
    with pytest.raises(ValueError):
        mixed_ops(spec, [Step(1, 0, 0)], Formats.for_spec(spec))


def test_pipeline_micro_batches_by_hand():
    """Llama-2-7B (32 layers) on 4 stages of 8 layers, decode batch 8 at context 1k: with m micro-batches the step
    takes (m + 3) x the slowest stage per micro-batch, and the bubble is 3 / (m + 3)."""
    from kvwall.predict.memory import Parallel
    from kvwall.predict.ops import step_ops
    from kvwall.predict.roofline import pipelined

    spec = load_spec("llama-2-7b")
    fm, roof, par = Formats.for_spec(spec), Roof(get_device("h100")), Parallel(1, 4)
    for m in (1, 2, 8):
        got = pipelined(spec, Step(8, 1023, 1), fm, roof, par, m)
        ops = step_ops(spec, Step(8 // m, 1023, 1), fm)
        last = sum(roof.op_time(o) for o in ops if o.layer is not None and o.layer >= 24) + roof.op_time(ops[-1])
        send = 5e-6 + (8 // m) * 4096 * 2 / roof.device.interconnect_bw  # latency + activations over the link
        assert got["stage_s"][3] == pytest.approx(last)  # the last stage (8 layers + the LM head) is the slowest
        assert got["time_s"] == pytest.approx((m + 3) * (last + send))
        assert got["bubble"] == pytest.approx(3 / (m + 3))
        assert got["steady_tpot_s"] == pytest.approx(max(m, 4) * (last + send))  # a micro-batch back every max(m, pp)
        assert got["steady_idle"] == pytest.approx(1 - m / max(m, 4))
    with pytest.raises(Exception, match="micro-batches"):
        pipelined(spec, Step(8, 1023, 1), fm, roof, par, 3)
