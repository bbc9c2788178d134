"""The planner's mixture-of-experts terms (colonnade/analysis/moe.py) against hand values, the
built model and measurement: parameter counts (total, active) equal the meta-built model's;
Mixtral 8x7B's published 46.7B / 12.9B; experts per rank and their ZeRO-1/2/3 state bytes over
expert_dp; the dispatch's wire bytes measured on 2 ranks (both dispatchers) equal the formula
exactly; the bytes an MoE layer saves for backward as modelled; plan --ep and the dry run's
MoE block."""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Callable
from typing import Any

import pytest
import torch

from colonnade.analysis.activations import ActivationShape, layer_bytes
from colonnade.analysis.cli import add_plan_arguments, load_model_config
from colonnade.analysis.cli import build as build_plan
from colonnade.analysis.cli import main as plan_main
from colonnade.analysis.dry_run import dry_run
from colonnade.analysis.hardware import get_cluster
from colonnade.analysis.layout import Layout, Workload
from colonnade.analysis.measure import SavedTensorMeter, relative_error
from colonnade.analysis.memory import (
    memory_per_device,
    moe_layer_activation_delta,
    stage_state_bytes,
)
from colonnade.analysis.moe import (
    MoEShape,
    all_gather_bytes,
    all_to_all_bytes,
    dense_model,
    dispatch_bytes,
    expert_params_per_rank,
    expert_tp_bytes,
    moe_param_counts,
)
from colonnade.analysis.search import Constraints, layouts
from colonnade.config.sections import ModelConfig
from colonnade.config.validate import resolve, validate
from colonnade.models.build import build_chunks, build_reference
from colonnade.parallel.dims import ParallelDims
from colonnade.parallel.groups import ProcessGroups
from tests.moe.harness import moe_config

MIXTRAL = ModelConfig(arch="llama", num_layers=32, hidden_size=4096, num_heads=32,
                      num_kv_heads=8, vocab_size=32000, ffn_hidden_size=14336, num_experts=8,
                      moe_top_k=2, max_seq_len=4096, tie_embeddings=False)


def test_mixtral_counts_by_hand() -> None:
    """Mixtral 8x7B: 46.7B total, 12.9B active (Jiang et al. 2024), to the parameter."""
    h, f, v, kv, layers = 4096, 14336, 32000, 1024, 32
    attn = 2 * h * h + 2 * h * kv
    expert = 3 * h * f
    outside = 2 * v * h + h  # embedding, untied head, final norm
    total = layers * (attn + 2 * h + 8 * h + 8 * expert) + outside
    got = moe_param_counts(MIXTRAL)
    assert got["total"] == total == 46_702_792_704
    assert got["active"] == total - layers * 6 * expert == 12_879_925_248
    assert got["expert"] == expert and got["moe_layers"] == 32


@pytest.mark.parametrize("arch,changes", [
    ("llama", {}),
    ("llama", {"moe_router": "sigmoid", "moe_shared_expert_ffn_hidden_size": 48,
               "moe_shared_expert_gate": True, "moe_first_dense_layers": 1}),
    ("gpt2", {"moe_layer_freq": 2, "moe_shared_expert_ffn_hidden_size": 16}),
])
def test_counts_equal_the_built_model(arch: str, changes: dict[str, Any]) -> None:
    """moe_param_counts' total = the parameters of the model built on the meta device
    (llama / gpt2 with biases, shared expert + gate, sigmoid bias, dense first layers,
    every other layer MoE)."""
    config = moe_config(arch=arch, ep=1, layers=3)
    config = dataclasses.replace(config, model=dataclasses.replace(config.model, **changes))
    model = build_reference(config, device=torch.device("meta"))
    built = sum(p.numel() for p in model.parameters())
    got = moe_param_counts(config.model)
    assert got["total"] == built
    routed = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    assert got["routed"] == routed
    x = MoEShape.of(config.model)
    assert got["active"] == built - routed + routed * x.top_k // x.experts


def test_expert_states_per_rank_zero1_over_edp() -> None:
    """ep 4 on tp1 x dp8: each rank holds E/4 experts per MoE layer; at ZeRO-1 their optimizer
    states are sharded over edp = 2, the dense ones over dp = 8 (bf16: W 2, G 4, O 12)."""
    model = dataclasses.replace(MIXTRAL, num_layers=4)
    w = Workload(model=model, seq_len=256, global_batch=8)
    base = Layout(dp=8, zero=1)
    x = MoEShape.of(model)
    experts = expert_params_per_rank(x, 1, 4)
    assert experts == 4 * 2 * 3 * 4096 * 14336
    one, four = memory_per_device(w, base), memory_per_device(w, dataclasses.replace(base, ep=4))
    assert stage_state_bytes("bf16", 1, 2) == (2, 4, 6.0)
    moved = 4 * 6 * 3 * 4096 * 14336  # routed-expert parameters ep 4 takes off each rank
    assert one.params - four.params == pytest.approx(moved * 2)
    assert one.grads - four.grads == pytest.approx(moved * 4)
    # ep 1: all 8 experts' states / 8 ranks; ep 4: 2 experts' / edp 2
    assert one.optimizer - four.optimizer == pytest.approx(4 * 8 * x.expert_params * 12 / 8
                                                           - experts * 12 / 2)
    assert four.activations == one.activations


@pytest.mark.parametrize(("zero", "shard_size", "expert_shard"),
                         [(2, None, 2), (3, None, 2), (3, 4, 2), (2, 2, 2), (3, 1, 1)])
def test_expert_states_per_rank_zero23_over_edp(zero: int, shard_size: int | None,
                                               expert_shard: int) -> None:
    """ep 4 on dp8 (edp 2), bf16 (W 2, G 4, O 12): at ZeRO-2 the routed experts' gradients and
    optimizer states are divided by their shard group (edp 2, or min(zero_shard_size, 2) with
    hybrid sharding), at ZeRO-3 their weights too, the rest over dp 8 (or zero_shard_size);
    a ZeRO-3 gather holds at least one layer's E/ep stacked experts (one module)."""
    model = dataclasses.replace(MIXTRAL, num_layers=4)
    w = Workload(model=model, seq_len=256, global_batch=8)
    lay = Layout(dp=8, ep=4, zero=zero, zero_shard_size=shard_size)
    assert (lay.edp, lay.expert_shard) == (2, expert_shard)
    mem = memory_per_device(w, lay)
    experts = expert_params_per_rank(MoEShape.of(model), 1, 4)
    assert experts == 4 * 2 * 3 * 4096 * 14336
    dense = mem.optimizer * (shard_size or 8) / 12 - experts * (shard_size or 8) / expert_shard
    h, kv, v = 4096, 1024, 32000  # 4 x (attention, 2 norms, router [8, h]) + both ends
    assert dense == pytest.approx(4 * (2 * h * h + 2 * h * kv + 2 * h + 8 * h) + 2 * v * h + h,
                                  rel=1e-12)
    s, e = shard_size or 8, expert_shard
    assert mem.grads == pytest.approx(dense * 4 / s + experts * 4 / e)
    assert mem.params == pytest.approx(dense * 2 / (s if zero == 3 else 1)
                                       + experts * 2 / (e if zero == 3 else 1))
    if zero == 3:
        assert mem.gathered >= 2 * 3 * 4096 * 14336 * 2  # one layer's 2 local experts, bf16


def test_dispatch_formulas() -> None:
    """Hand values: all_to_all 4 R h e + 8 (ep-1) E_l, R = T k (ep-1)/ep; all_gather
    (ep-1)(4 T h e + 2 T k w + 8 T k + 8)."""
    x = MoEShape.of(moe_config(ep=1).model)  # h 32, E 4, k 2
    assert dispatch_bytes(x, 64, 2, 1, "all_to_all") == 0.0
    assert dispatch_bytes(x, 64, 2, 2, "all_to_all") == 4 * 64 * 32 * 2 + 8 * 2
    assert all_to_all_bytes(10, 32, 8, 4, 1) == 4 * 10 * 32 * 8 + 8 * 3
    assert dispatch_bytes(x, 64, 2, 4, "all_gather") == 3 * (4 * 64 * 32 * 2 + 2 * 64 * 2 * 4
                                                             + 8 * 64 * 2 + 8)
    with pytest.raises(ValueError, match="moe_dispatcher"):
        dispatch_bytes(x, 64, 2, 2, "ring")


def test_expert_tp_memory_and_bytes() -> None:
    """Expert tp 2 halves each rank's routed-expert weights (no biases) at the same ep; at
    ep2 x etp2 on dp8 the expert states are sharded over edp 2 instead of 4, so ZeRO-1's
    expert optimizer bytes per rank are unchanged while weights and gradients halve. Its
    exchange: 4 (n-1) T k h e + 8 (n-1) E_l per layer and micro-batch."""
    model = dataclasses.replace(MIXTRAL, num_layers=4)
    w = Workload(model=model, seq_len=256, global_batch=8)
    x = MoEShape.of(model)
    whole = expert_params_per_rank(x, 1, 2)
    assert expert_params_per_rank(x, 1, 2, etp=2) == whole / 2 == 4 * 4 * 3 * 4096 * 7168
    ep2 = Layout(dp=8, zero=1, ep=2)
    etp2 = dataclasses.replace(ep2, expert_tp=2)
    assert (ep2.edp, etp2.edp) == (4, 2)
    one, two = memory_per_device(w, ep2), memory_per_device(w, etp2)
    assert one.params - two.params == pytest.approx(whole / 2 * 2)  # bf16 weights
    assert one.grads - two.grads == pytest.approx(whole / 2 * 4)  # fp32 gradients
    assert one.optimizer == pytest.approx(two.optimizer)  # whole/4 vs (whole/2)/2 states
    assert "--parallel.expert_tp=2" in etp2.overrides() and "etp2" in etp2.short()
    tiny = MoEShape.of(moe_config(ep=1).model)  # h 32, E 4, k 2
    assert dispatch_bytes(tiny, 64, 2, 1, "all_to_all", etp=2) == 4 * 64 * 2 * 32 * 2 + 8 * 4
    assert dispatch_bytes(tiny, 64, 2, 2, "all_to_all", etp=2) == (
        4 * 64 * 32 * 2 + 8 * 2 + 4 * 64 * 2 * 32 * 2 + 8 * 2)


def measure_dispatch(kind: str) -> dict[str, Any]:
    """Rank body (ep 2 over dp 2): one micro-batch forward + backward of the float64 MoE
    model; the ep group's wire bytes against the formula at this rank's actual routing, and
    the routed-expert parameters this rank holds."""
    torch.set_num_threads(1)
    config = moe_config(ep=2, dispatcher=kind, capacity=1.0)
    par = config.parallel
    groups = ProcessGroups.build(ParallelDims.from_config(par, 2), experts=True)
    (chunk,) = build_chunks(config, groups, dtype=torch.float64)
    seen: list[tuple[int, int, int]] = []  # per layer: tokens, rows sent out, rows taken in
    for module in chunk.modules():
        dispatcher = getattr(module, "dispatcher", None)
        if dispatcher is None:
            continue
        plain = dispatcher.dispatch

        def recording(x: torch.Tensor, routing: Any, keep: Any, plain: Any = plain) -> Any:
            out = plain(x, routing, keep)
            handle, me = out[2], groups.ep.rank
            if kind == "all_to_all":
                seen.append((x.shape[0], sum(handle.send_splits) - handle.send_splits[me],
                             sum(handle.recv_splits) - handle.recv_splits[me]))
            else:
                seen.append((x.shape[0], 0, 0))
            return out
        dispatcher.dispatch = recording
    gen = torch.Generator().manual_seed(7 + groups.ep.rank)
    b, vocab, s = 2, config.model.vocab_size, config.training.seq_len
    tokens = torch.randint(0, vocab, (b, s), generator=gen)
    groups.stats.reset()
    chunk(tokens, torch.randint(0, vocab, (b, s), generator=gen), reduction="sum").backward()
    sent = groups.stats.total("ep/")
    x = MoEShape.of(config.model)
    if kind == "all_to_all":
        model = sum(all_to_all_bytes(out, x.hidden, 8, 2, x.experts // 2, received=into)
                    for _, out, into in seen)
    else:
        model = sum(all_gather_bytes(t, x.top_k, x.hidden, 8, 2) for t, _, _ in seen)
    experts = sum(p.numel() for n, p in chunk.named_parameters() if ".experts." in n)
    return {"keys": {k: v["wire_bytes"] for k, v in groups.stats.snapshot().items()},
            "seen": seen, "sent": sent, "model": model, "layers": len(seen), "experts": experts,
            "experts_model": expert_params_per_rank(x, 1, 2)}


@pytest.mark.parametrize("kind", ["all_to_all", "all_gather"])
def test_measured_dispatch_bytes(run_ranks: Callable[..., list[Any]], kind: str) -> None:
    for got in run_ranks(2, measure_dispatch, kind):
        assert got["layers"] == 2
        assert got["sent"] == got["model"] > 0, got
        assert got["experts"] == got["experts_model"] > 0, got


def measure_expert_tp() -> dict[str, Any]:
    """Rank body (expert tp 2 over dp 2, ep 1): one micro-batch forward + backward of the
    float64 MoE model; the expert tp group's wire bytes against :func:`expert_tp_bytes` at
    each layer's actual padded rows, and the routed-expert parameters this rank holds."""
    import colonnade.moe.experts as experts_module

    torch.set_num_threads(1)
    config = moe_config(ep=1, etp=2)
    groups = ProcessGroups.build(ParallelDims.from_config(config.parallel, 2), experts=True)
    (chunk,) = build_chunks(config, groups, dtype=torch.float64)
    padded: list[int] = []  # per layer pass: T, the rows each rank contributes
    plain = experts_module.gather_rows

    def recording(*args: Any) -> Any:
        out = plain(*args)
        padded.append(out[2].padded)
        return out

    experts_module.gather_rows = recording
    try:
        gen = torch.Generator().manual_seed(7 + groups.world.rank)
        b, vocab, s = 2, config.model.vocab_size, config.training.seq_len
        tokens = torch.randint(0, vocab, (b, s), generator=gen)
        groups.stats.reset()
        chunk(tokens, torch.randint(0, vocab, (b, s), generator=gen), reduction="sum"
              ).backward()
    finally:
        experts_module.gather_rows = plain
    x = MoEShape.of(config.model)
    return {"sent": groups.stats.total("expert_tp/"), "layers": len(padded),
            "model": sum(expert_tp_bytes(t, x.hidden, 8, 2, x.experts) for t in padded),
            "experts": sum(p.numel() for n, p in chunk.named_parameters() if ".experts." in n),
            "experts_model": expert_params_per_rank(x, 1, 1, etp=2)}


def test_measured_expert_tp_bytes(run_ranks: Callable[..., list[Any]]) -> None:
    """Expert tp 2: the counts' all-gather and the rows' all-gather and reduce-scatter, forward
    and backward, measured by CommGroup equal 4 (n-1) T h e + 8 (n-1) E_l per layer exactly;
    each rank holds half of every expert."""
    for got in run_ranks(2, measure_expert_tp):
        assert got["layers"] == 2
        assert got["sent"] == got["model"] > 0, got
        assert got["experts"] == got["experts_model"] > 0, got


def test_plan_searches_ep(capsys: pytest.CaptureFixture[str]) -> None:
    """--ep 1,2,4 --expert-tp 1,2: MoE layouts at each ep dividing E and ep x expert_tp
    dividing tp cp dp, sp under tp, ZeRO 0-3, each one a valid config; a dense model only at
    ep 1."""
    args = ["--model", "tiny-llama", "--set", "model.num_experts=4", "--cluster", "h100",
            "--gpus", "4", "--ep", "1,2,4", "--expert-tp", "1,2", "--global-batch", "8",
            "--seq-len", "64"]
    parser = argparse.ArgumentParser()
    add_plan_arguments(parser)
    w, cons = build_plan(parser.parse_args(args))
    assert (cons.ep, cons.expert_tp) == ((1, 2, 4), (1, 2))
    found = list(layouts(w, 4, get_cluster("h100"), cons))
    assert {(lay.ep, lay.expert_tp) for lay in found} == {(1, 1), (2, 1), (4, 1), (1, 2),
                                                          (2, 2)}
    assert all(lay.sp or lay.tp == 1 for lay in found)
    assert {lay.zero for lay in found} == {0, 1, 2, 3}  # ZeRO-2/3 shard experts over edp
    assert all((lay.tp * lay.cp * lay.dp) % (lay.ep * lay.expert_tp) == 0 for lay in found)
    base = load_model_config(parser.parse_args(args))
    for lay in found:  # every planned MoE layout is a config the validator accepts
        validate(resolve(lay.to_config(base, w), 4), 4)
    dense = dataclasses.replace(w, model=dataclasses.replace(w.model, num_experts=0))
    assert {lay.ep for lay in layouts(dense, 4, get_cluster("h100"), Constraints(ep=(1, 2)))
            } == {1}
    assert plan_main([*args, "--top", "3"]) == 0
    assert "best: --parallel.tp=" in capsys.readouterr().out


def test_dry_run_moe_block() -> None:
    """The dry run's MoE block: total / active parameters, experts per rank (at ZeRO-3 all their
    states sharded over expert_dp), dispatch MB."""
    config = moe_config(ep=2, dp=2)
    text = dry_run(config, 2)
    counts = moe_param_counts(config.model)
    assert f"{counts['total']:,} parameters total, {counts['active']:,} active" in text
    assert "experts per rank: 2 per MoE layer x 2 layer(s) (ep 2, expert_dp 1)" in text
    assert "dispatch (all_to_all):" in text
    zero3 = dry_run(moe_config(ep=2, dp=4, zero_stage=3), 4)
    assert "(ep 2, expert_dp 2)" in zero3
    assert "(weights, gradients and optimizer sharded over 2 expert_dp ranks)" in zero3


@pytest.mark.parametrize("arch,shared", [("llama", 0), ("llama", 48), ("gpt2", 0)])
def test_moe_layer_activations_measured(arch: str, shared: int) -> None:
    """Bytes the last MoE layer saves for backward (saved-tensor hooks, float64, ep 1,
    aux + z-loss on) = the dense layer's model with the MoE MLP's terms in place of the
    dense MLP's (memory.moe_layer_activation_delta), within 2%."""
    config = moe_config(arch=arch, ep=1, shared=shared)
    (chunk,) = build_chunks(config, ProcessGroups.build(ParallelDims()), dtype=torch.float64)
    chunk.train()
    b, s, vocab = 2, config.training.seq_len, config.model.vocab_size
    gen = torch.Generator().manual_seed(3)
    tokens, labels = (torch.randint(0, vocab, (b, s), generator=gen) for _ in range(2))
    with SavedTensorMeter([chunk]) as meter:
        loss = chunk(tokens, labels, reduction="sum")
    loss.backward()
    measured = list(meter.per_layer().values())[-1]
    shape = ActivationShape.from_model(dense_model(config.model), s, b, dtype=torch.float64)
    predicted = layer_bytes(shape) + moe_layer_activation_delta(
        Workload.from_config(config), Layout(micro_batch=b))
    assert relative_error(measured, predicted) <= 0.02, (measured, predicted)


def test_time_model_moe_terms() -> None:
    """The time model's MoE terms on h100: ep_comm = layers x micro-batches x (dispatch bytes
    / link + 4 latencies) at ep 2, 0 at ep 1; the estimate's model FLOPs = the MoE-aware
    counter's flops_per_token x tokens (active experts only)."""
    from colonnade.analysis.estimate import estimate
    from colonnade.analysis.timing import step_time
    from colonnade.models.counts import flops_per_token

    model = dataclasses.replace(MIXTRAL, num_layers=4)
    w = Workload(model=model, seq_len=1024, global_batch=16)
    c = get_cluster("h100")
    lay = Layout(dp=8, ep=2, micro_batch=1)
    m = lay.microbatches(w.global_batch)
    tokens = float(w.seq_len)
    sent = dispatch_bytes(MoEShape.of(model), tokens, 2, 2, "all_to_all")
    bw, lat = c.link(2, 2)
    assert step_time(w, lay, c).ep_comm == pytest.approx(4 * m * (sent / bw + 4 * lat))
    assert step_time(w, dataclasses.replace(lay, ep=1), c).ep_comm == 0.0
    est = estimate(w, lay, c)
    assert est.model_flops == pytest.approx(flops_per_token(model, w.seq_len) * 16 * 1024,
                                            rel=1e-12)
