"""ZB-V in the planner: the replayed step (colonnade.analysis.zbv), stage 0's memory (embedding
and head, activations held until W), the search space (vp = 2 only) and the reports."""

from __future__ import annotations

import dataclasses
import random
from pathlib import Path

import pytest

from colonnade.analysis.activations import layer_bytes
from colonnade.analysis.hardware import PRESETS
from colonnade.analysis.layout import Layout, Workload
from colonnade.analysis.memory import (
    activation_shape,
    in_flight,
    memory_per_device,
    stage_memory,
    stage_params,
)
from colonnade.analysis.moe import MoEShape
from colonnade.analysis.report import format_table
from colonnade.analysis.search import Constraints, layouts, plan
from colonnade.analysis.timing import (
    _pipeline,
    _Stage,
    _zbv_chunks,
    step_collectives_s,
    step_time,
)
from colonnade.analysis.zbv import _durations, _replay, zbv_makespan
from colonnade.cli import main
from colonnade.config.sections import Config, ModelConfig
from colonnade.config.validate import problems
from colonnade.models.counts import LayerShape, layer_params, total_params
from colonnade.pipeline.actions import Kind
from colonnade.pipeline.schedules import schedule_lists
from colonnade.pipeline.simulate import simulate
from colonnade.pipeline.zbv import zbv_orders

A100 = PRESETS["a100-80gb"]
REPO = Path(__file__).resolve().parents[2]


def _small(tied: bool = False, **model: int) -> Workload:
    cfg = ModelConfig(num_layers=8, hidden_size=64, num_heads=4, num_kv_heads=2,
                      vocab_size=512, tie_embeddings=tied, **model)
    return Workload(model=cfg, seq_len=32, global_batch=16)


def _bubble(name: str, pp: int, m: int, f: float, b: float, w: float) -> float:
    """Idle time of the real lists under pipeline.simulate: makespan - m (F + B + W) of a stage
    (chunk costs f, b, w: a stage's are 2f, 2b, 2w under zbv, f, b, w under one chunk)."""
    vp, chunks = (2, 2) if name == "zbv" else (1, 1)
    lists = schedule_lists(name, pp, vp, m)
    span = simulate(lists, f, b, w, placement="v" if name == "zbv" else "loop").makespan
    return span - m * chunks * (f + b + w)


def test_zbv_bubble_is_below_zb_h1_and_1f1b_at_equal_costs() -> None:
    """F = B = W = 1 per stage (1/2 per zbv chunk), the schedules' own lists replayed:
    pp 2, m 4: zbv 0.5 < zb_h1 1 < 1f1b 3; pp 4, m 8: 1.5 < 3 < 9 (idle time per step)."""
    for pp, m, want in ((2, 4, (0.5, 1.0, 3.0)), (4, 8, (1.5, 3.0, 9.0))):
        zbv = _bubble("zbv", pp, m, 0.5, 0.5, 0.5)
        zb_h1 = _bubble("zb_h1", pp, m, 1.0, 1.0, 1.0)
        one = _bubble("1f1b", pp, m, 1.0, 1.0, 1.0)
        assert (zbv, zb_h1, one) == pytest.approx(want, abs=1e-12)
        assert zbv < zb_h1 < one


def test_time_model_prices_the_executors_split_on_the_first_virtual_stage() -> None:
    """The planner replays the lists with the executor's durations: stage 0's chunk 0 (the
    tokens' chunk) has no input gradient, so its B is empty and its W the whole backward;
    ZB-V's order runs each W right after its B, so that costs nothing. Equal stages F = 1,
    B + W = 2, W = 1: pp 2, m 4: zbv 0.5 (zb_h1 1, 1f1b 3); pp 4, m 8 and 16: 1.5 (3, 9)."""
    st = _Stage(fwd=1.0, bwd=2.0, wgrad=1.0, comm=0.0)
    for pp, m, want in ((2, 4, 0.5), (4, 8, 1.5), (4, 16, 1.5)):
        steady, bubble, _ = _pipeline(Layout(pp=pp, vp=2, schedule="zbv"), m, [st] * pp)
        assert steady == m * 3.0
        assert bubble == pytest.approx(want, abs=1e-12)
        _, zb, _ = _pipeline(Layout(pp=pp, schedule="zb_h1"), m, [st] * pp)
        _, one, _ = _pipeline(Layout(pp=pp), m, [st] * pp)
        assert (zb, one) == (pp - 1.0, 3.0 * (pp - 1))
        assert bubble < zb < one


def test_zbv_makespan_is_the_replay_with_the_executors_split() -> None:
    """Unequal chunks (stage 0 with the head): zbv_makespan is the replay of the real lists
    with B = backward - W (B = 0, W = the whole backward on stage 0's chunk 0)."""
    rng = random.Random(3)
    for pp in (2, 3, 4):
        chunks = []
        for s in range(pp):
            pair = []
            for c in range(2):
                f, w = rng.uniform(0.8, 1.2), rng.uniform(0.4, 1.2)
                b = w + rng.uniform(0.8, 2.0)
                if s == 0 and c == 1:  # the head
                    f, b, w = f + 0.7, b + 1.5, w + 0.6
                pair.append((f, b, w))
            chunks.append((pair[0], pair[1]))
        durations = _durations(chunks)
        assert durations[0][0][1] == 0.0 and durations[0][0][2] == chunks[0][0][1]
        assert durations[1][1] == (chunks[1][1][0], chunks[1][1][1] - chunks[1][1][2],
                                   chunks[1][1][2])
        for m in (pp, 2 * pp + 1, 4 * pp):
            span = zbv_makespan(chunks, m)
            work = max(sum(f + b for f, b, _ in pair) for pair in chunks)  # slowest stage
            assert span == _replay(durations, m) and span >= m * work


def test_step_time_of_zbv() -> None:
    """The bubble is the replayed makespan minus m T of the slowest stage (stage 0: embedding
    and head); p2p fill 2 (p - 1) hops each way; with tied embeddings no all-reduce of the
    tied gradient (one copy on stage 0)."""
    w = _small(tied=True)
    lay = Layout(pp=2, vp=2, micro_batch=2, schedule="zbv")
    m = lay.microbatches(w.global_batch)
    chunks = _zbv_chunks(w, lay, A100)
    stage = [_Stage(*(x + y for x, y in zip(dataclasses.astuple(a), dataclasses.astuple(b),
                                            strict=True))) for a, b in chunks]
    slowest = max(st.fwd + st.bwd for st in stage)
    assert slowest == stage[0].fwd + stage[0].bwd > stage[1].fwd + stage[1].bwd
    span = zbv_makespan([tuple((c.fwd, c.bwd, c.wgrad) for c in p) for p in chunks], m)
    t = step_time(w, lay, A100)
    assert t.bubble == pytest.approx(span - m * slowest, rel=1e-12)
    one_f = step_time(w, dataclasses.replace(lay, vp=1, schedule="1f1b"), A100)
    tokens = 2 * 32 * 64 * 2
    hop = A100.p2p_s(tokens, False)
    assert t.p2p == pytest.approx(4 * hop, rel=1e-12)
    assert one_f.p2p == pytest.approx(2 * hop, rel=1e-12)
    tied_ar = A100.all_reduce_s(512 * 64 * 2, 2, 2)
    assert (step_collectives_s(w, dataclasses.replace(lay, vp=1, schedule="1f1b"), A100)
            - step_collectives_s(w, lay, A100)) == pytest.approx(tied_ar, rel=1e-12)


@pytest.mark.parametrize("tied", [False, True])
def test_stage_0_memory_holds_the_embedding_and_the_head(tied: bool) -> None:
    """ZB-V's fullest stage is 'ends': l/p layers + embedding + head (one copy when tied);
    its activations: min(m, 2p - 1) + 1 chunks of half a stage (counted until W) and one
    head's logits, fp32 softmax and captured logit gradient."""
    w, pp = _small(tied=tied), 4
    lay = Layout(pp=pp, vp=2, micro_batch=1, schedule="zbv")
    m = lay.microbatches(w.global_batch)
    shape = LayerShape.of(w.model)
    mem = memory_per_device(w, lay)
    assert mem.stage == "ends"
    ends = stage_params(shape, lay, "ends")
    assert ends == total_params(shape) - (pp - 1) * 2 * layer_params(shape)
    one_f = Layout(pp=pp, micro_batch=1)
    first, last = (stage_params(shape, one_f, n) for n in ("first", "last"))
    both = first + last - 2 * layer_params(shape) - (512 * 64 if tied else 0)
    assert ends == both  # the embedding of 'first' and the head of 'last', one copy if tied
    assert mem.params == ends * 2  # bf16 weights
    flight = (min(m, 2 * pp - 1) + 1) / 2  # chunks of half a stage held until W
    logits = (2 * 2 + 4) * 32 * 512  # (2E + 4) s b V of the one head held
    want = flight * 2 * layer_bytes(activation_shape(w, lay)) + logits
    assert mem.activations == pytest.approx(want, rel=1e-12)
    middle = stage_memory(w, lay, "middle")
    assert middle.activations < mem.activations and middle.params < mem.params


def test_zbv_in_flight_bound_matches_the_lists() -> None:
    """Stage 0's order holds at most min(m, 2p - 1) + 1 chunk-activations (F done, W not), one
    of them the head's: what the memory model charges (in_flight, head_bytes)."""
    for pp in (2, 3, 4):
        for m in (1, pp, 2 * pp, 3 * pp):
            held, peak, heads = [0, 0], 0, 0
            for a in zbv_orders(pp, m)[0]:
                held[a.chunk] += {Kind.F: 1, Kind.W: -1}.get(a.kind, 0)
                peak, heads = max(peak, sum(held)), max(heads, held[1])
            assert (peak, heads) == (min(m, 2 * pp - 1) + 1, 1)
            lay = Layout(pp=pp, vp=2, schedule="zbv")
            assert in_flight(lay, m) == peak / 2


def test_zb_h1_holds_activations_until_w_on_every_stage() -> None:
    """ZB-H1's last stage holds min(p, m) micro-batches until their W (p - s between F and B,
    s between B and W), with as many heads' (2E + 4) sbV/t."""
    for pp, m in ((2, 8), (4, 8), (4, 2)):  # the lists: F done, W not, on every stage
        peaks = []
        for actions in schedule_lists("zb_h1", pp, 1, m):
            held = peak = 0
            for a in actions:
                held += {Kind.F: 1, Kind.W: -1}.get(a.kind, 0)
                peak = max(peak, held)
            peaks.append(peak)
        assert peaks == [min(pp, m)] * pp
    w = _small()
    lay = Layout(pp=2, micro_batch=1, schedule="zb_h1")
    last = stage_memory(w, lay, "last")
    one = layer_bytes(activation_shape(w, lay))
    assert last.activations == pytest.approx(2 * 4 * one + 2 * (2 * 2 + 4) * 32 * 512, rel=1e-12)
    plain = stage_memory(w, dataclasses.replace(lay, schedule="1f1b"), "last")
    assert plain.activations == pytest.approx(4 * one + (2 + 4) * 32 * 512, rel=1e-12)


def test_moe_layers_of_the_v_placement() -> None:
    """8 layers, MoE from layer 3, pp 2: chunks [0,1] [2,3] [4,5] [6,7]; stage 0 holds the
    first and the last (MoE 6, 7), stage 1 the middle two (MoE 3, 4, 5)."""
    x = MoEShape.of(ModelConfig(num_layers=8, hidden_size=64, num_heads=4, num_experts=4,
                                moe_first_dense_layers=3))
    assert [x.chunk_moe_layers(2, 2, v) for v in range(4)] == [0, 1, 2, 2]
    assert x.stage_moe_layers(2, "ends") == 2
    assert x.max_stage_moe_layers(2, "v") == 3
    assert x.max_stage_moe_layers(2) == 4  # loop placement: layers 4-7 on stage 1


def test_planner_lists_zbv_with_vp_2_only() -> None:
    w = _small()
    seen = [lay for lay in layouts(w, 8, A100, Constraints()) if lay.schedule == "zbv"]
    assert seen and {lay.vp for lay in seen} == {2}
    assert {lay.pp for lay in seen} == {2, 4}  # pp 8 leaves one layer a stage: no V
    assert any(lay.microbatches(w.global_batch) % lay.pp for lay in seen)  # any m: replayed
    for lay in seen:
        assert problems(lay.to_config(Config(), w), 8) == [], lay
    assert not any(lay.schedule == "zbv"
                   for lay in layouts(w, 8, A100, Constraints(vp=1)))
    result = plan(w, A100, 8, Constraints(pp=2, schedules=("zbv",)))
    assert result.ranked and {(e.layout.schedule, e.layout.vp) for e in result.ranked} == {
        ("zbv", 2)}
    assert "zbv" in format_table(result, 3)
    assert "--parallel.vp=2" in result.best.layout.overrides()


def test_dry_run_names_the_zbv_stage(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                     capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.chdir(tmp_path)
    args = ["train", "--config", str(REPO / "configs" / "gpt2-124m.toml"), "--nproc", "2",
            "--parallel.pp=2", "--parallel.vp=2", "--parallel.schedule=zbv", "--dry-run"]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "memory per rank (planner's model, ends (embedding + head) stage" in out
