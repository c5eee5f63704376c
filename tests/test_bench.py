"""``moeq bench`` end to end on a tiny checkpoint: every system measured, prefill paired with bf16, the table built."""
import pytest

from moeq import bench


def test_bench_runs_side_by_side(tiny_ckpt):
    ckpt = tiny_ckpt("qwen3_moe")
    systems = ["transformers bf16", "moeq rtn-int4", "moeq nf4"]
    res = bench.run(ckpt, systems, batches=(1, 2), prefills=(24,), new_tokens=4, group_size=32)
    rows = {r["system"]: r for r in res["systems"]}
    assert list(rows) == systems
    for r in rows.values():
        for key in ("decode_tps_b1", "decode_tps_b2", "prefill_tps_24", "prefill_all_logits_tps_24",
                    "roofline_tps", "memory_bandwidth_gbps", "peak_rss_bytes"):
            assert r[key] > 0, (r["system"], key)
        assert r["prefill_vs_bf16_24"] > 0 and r["decode_b1_vs_bf16"] > 0
    assert rows["transformers bf16"]["prefill_vs_bf16_24"] == 1.0
    assert rows["moeq rtn-int4"]["layer_bytes"] < 0.5 * rows["transformers bf16"]["layer_bytes"]
    assert rows["moeq rtn-int4"]["bytes_per_token"] < rows["transformers bf16"]["bytes_per_token"]
    text = bench.table(res)
    assert text.count("\n| moeq ") == 2 and "prefill 24 × bf16" in text


def test_bench_names_unknown_systems(tiny_ckpt):
    with pytest.raises(ValueError, match="'moeq int3'.*valid: transformers bf16"):
        bench.run(tiny_ckpt("qwen3_moe"), ["moeq int3"], batches=(1,), prefills=())
