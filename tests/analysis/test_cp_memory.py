"""Context parallelism in the one memory model and the one time model (issue 16): activations
per rank x 1/cp, the ring's and the all-to-all's bytes by formula, their overlap, attention
FLOPs per rank / cp."""

from __future__ import annotations

import dataclasses

import pytest

from colonnade.analysis.activations import ActivationShape, cp_buffer_bytes, layer_bytes
from colonnade.analysis.cp_comm import all_to_all_comm, cp_comm, ring_comm, step_cp_bytes
from colonnade.analysis.efficiency import layer_gemms
from colonnade.analysis.hardware import get_cluster
from colonnade.analysis.layout import Layout, Workload
from colonnade.analysis.memory import memory_per_device
from colonnade.analysis.timing import step_time
from colonnade.config.sections import ModelConfig
from colonnade.models.counts import ArchFacts

H100 = get_cluster("h100")
LLAMA = ModelConfig(arch="llama", num_layers=8, hidden_size=1024, num_heads=16,
                    num_kv_heads=4, vocab_size=32000, max_seq_len=32768)


def _w(seq: int = 16384, **kw: object) -> Workload:
    return Workload(model=LLAMA, seq_len=seq, global_batch=8, **kw)  # type: ignore[arg-type]


def test_layer_activations_at_cp_are_1_over_cp_plus_the_cp_attention_output() -> None:
    """A cp rank's layer = the cp 1 layer / cp + the cp attention's own output E s_l b h (its
    out-proj input is a copy) + RoPE's gathered cos / sin E s_l b d; full recompute keeps the
    layer input only (exactly 1/cp); selective checkpoints all_to_all's core, not the ring."""
    base = dict(seq=8192, batch=2, hidden=1024, heads=16, kv_heads=4, ffn=2816, elem=2)
    d = 1024 // 16
    one = {rc: layer_bytes(ActivationShape(**base), rc)  # type: ignore[arg-type]
           for rc in ("none", "selective", "full")}
    for cp in (2, 4, 8):
        s_l = 8192 // cp
        extra = 2 * s_l * 2 * (1024 + d)
        ring = ActivationShape(**base, cp=cp)  # type: ignore[arg-type]
        a2a = dataclasses.replace(ring, cp_attention="all_to_all")
        assert layer_bytes(ring) == pytest.approx(one["none"] / cp + extra, rel=1e-15)
        assert layer_bytes(ring, "full") == pytest.approx(one["full"] / cp, rel=1e-15)
        assert layer_bytes(ring, "selective") == layer_bytes(ring)
        assert layer_bytes(a2a, "full") == pytest.approx(one["full"] / cp, rel=1e-15)
        rope = 2 * s_l * 2 * d
        assert layer_bytes(a2a, "selective") == pytest.approx(one["selective"] / cp + rope,
                                                              rel=1e-15)
        if cp <= 4:  # kv heads 4 % cp == 0: all_to_all keeps the ring's bytes
            assert layer_bytes(a2a) == pytest.approx(layer_bytes(ring), rel=1e-15)
    # cp 8 > 4 kv heads: every rank attends with one replicated kv head over the full s:
    # k, v 2 E s b d x 1 instead of the ring's 2 E (s/8) b d x 4 (twice as much)
    ring8 = ActivationShape(**base, cp=8)  # type: ignore[arg-type]
    a2a8 = dataclasses.replace(ring8, cp_attention="all_to_all")
    assert layer_bytes(a2a8) - layer_bytes(ring8) == pytest.approx(2 * 2 * 8192 * 2 * d * 1
                                                                   - 2 * 2 * 1024 * 2 * d * 4)


def test_without_rope_only_the_output_is_added() -> None:
    """gpt2 (learned positions): + E s_l b h, the ring's fresh [b, a, s_l, d] output."""
    gpt2 = ArchFacts(mlp_matrices=2, norm_has_bias=True, positions="learned")
    x = ActivationShape(seq=4096, batch=1, hidden=768, heads=12, kv_heads=12, ffn=3072,
                        elem=2, facts=gpt2)
    cp2 = dataclasses.replace(x, cp=2)
    assert layer_bytes(cp2) == pytest.approx(layer_bytes(x) / 2 + 2 * 2048 * 768, rel=1e-15)


def test_memory_per_rank_activations_about_halve_with_cp2_and_cp_buffers_are_added() -> None:
    w = _w()
    for lay in (Layout(), Layout(tp=2, sp=True), Layout(pp=2, micro_batch=2),
                Layout(recompute="full"), Layout(recompute="selective")):
        one = memory_per_device(w, lay)
        two = memory_per_device(w, dataclasses.replace(lay, cp=2))
        assert 0.5 <= two.activations / one.activations < 0.53, lay
        assert two.buffers == pytest.approx(one.buffers / 2, rel=1e-12), lay
        assert one.cp_buffers == 0 and two.cp_buffers > 0
    # without pp: 8 layers x (output + cos/sin) of s_l = 8192 rows on top of half
    one, two = memory_per_device(w, Layout()), memory_per_device(w, Layout(cp=2))
    assert two.activations == one.activations / 2 + 8 * 2 * 8192 * (1024 + 64)
    # the ring's backward peak, by hand: 2 kv blocks (bf16) + 2 dK/dV accumulators + the
    # block's contribution (fp32) + the fp32 dq accumulator + one chunk pair's kernel
    # temporaries (s_l / 2 rows); s_l = 8192, b = 1, h_kv = 256
    n_kv = 2 * 8192 * 256
    assert memory_per_device(w, Layout(cp=2)).cp_buffers == 2 * 2 * n_kv + 3 * 4 * n_kv \
        + 4 * 8192 * 1024 + 5 * 2 * 4096 * 1024  # + the block kernel's dq dk dv, k v (GQA)
    x = ActivationShape.of(w.shape, 16384, 1, cp=2, cp_attention="all_to_all")
    assert cp_buffer_bytes(x) == 2 * 16384 * (2 * 1024 / 2 + 2 * 64 * 2)  # dq dout, dk dv
    assert Layout(cp=2, dp=4, zero=1).shard == 8  # ZeRO shards over dp x cp


def test_ring_bytes_follow_the_formula() -> None:
    """Forward (cp-1) K, backward (cp-1) K + cp G: K = 2 b s/cp g_l d E, G = K A / E."""
    w = _w()
    for cp, tp in ((2, 1), (4, 1), (4, 2), (8, 1)):
        lay = Layout(cp=cp, tp=tp)
        k = 2 * 1 * 16384 / cp * (4 // tp) * 64 * 2
        r = ring_comm(w, lay, H100)
        assert r.fwd_bytes == (cp - 1) * k
        assert r.bwd_bytes == (cp - 1) * k + cp * 2 * k  # accumulators in fp32: G = 2K
        full = dataclasses.replace(lay, recompute="full")
        assert ring_comm(w, full, H100).bwd_bytes == r.bwd_bytes + r.fwd_bytes
    w64 = _w(precision="fp64")
    k64 = 2 * 16384 / 2 * 4 * 64 * 8
    assert ring_comm(w64, Layout(cp=2), H100).bwd_bytes == k64 + 2 * k64  # G = K in fp64
    lay = Layout(cp=4)
    per_step = 8 // 1 * (ring_comm(w, lay, H100).fwd_bytes + ring_comm(w, lay, H100).bwd_bytes)
    assert step_cp_bytes(w, lay, H100) == per_step * 8  # 8 layers x 8 micro-batches


def test_ring_overlap_exposes_only_what_the_block_attention_cannot_hide() -> None:
    w, lay = _w(), Layout(cp=4)
    on = ring_comm(w, lay, H100)
    off = ring_comm(dataclasses.replace(w, cp_overlap=False), lay, H100)
    assert off.exposed_s == pytest.approx(off.full_s) and on.full_s == pytest.approx(off.full_s)
    # at 16k tokens a block's attention (~ms) hides every ring step but the last hop home
    blk = 2 * 16384 / 4 * 4 * 64 * 2
    assert on.exposed_s == pytest.approx(H100.p2p_s(2 * blk, cross_node=False), rel=1e-12)
    assert step_time(w, lay, H100).cp_comm < step_time(
        dataclasses.replace(w, cp_overlap=False), lay, H100).cp_comm
    # a short sequence: the transfers' latency outlives the tiny block attention
    short = ring_comm(_w(seq=256), lay, H100)
    assert short.exposed_s > H100.p2p_s(2 * 2 * 64 * 4 * 64 * 2, cross_node=False)


def test_all_to_all_bytes_and_no_overlap() -> None:
    """4 all-to-alls forward (q, k, v, out), 4 backward, each (cp-1)/cp of the rank's tensor."""
    w, lay = _w(), Layout(cp=4, cp_attention="all_to_all")
    tokens = 16384 / 4
    tensors = 2 * tokens * 1024 * 2 + 2 * tokens * 64 * 4 * 2
    a = all_to_all_comm(w, lay, H100)
    assert a.fwd_bytes == pytest.approx(3 / 4 * tensors) and a.bwd_bytes == a.fwd_bytes
    assert a.exposed_s == a.full_s > 0
    assert cp_comm(w, Layout(), H100).full_s == 0.0


def test_attention_flops_per_rank_fall_as_1_over_cp() -> None:
    w = _w()
    mats1, (core1, _) = layer_gemms(w, Layout())
    mats2, (core2, _) = layer_gemms(w, Layout(cp=2))
    assert core2 == pytest.approx(core1 / 2)
    assert [f for f, _ in mats2] == pytest.approx([f / 2 for f, _ in mats1])
    t1, t2 = step_time(w, Layout(), H100), step_time(w, Layout(cp=2), H100)
    assert t2.compute == pytest.approx(t1.compute / 2, rel=0.05)  # the same work on 2 ranks
