"""Pipeline-parallel schedules as pure functions `(pp, vp, m, stage) -> list[Action]`.

Every schedule is built in two steps: the order of compute actions (F, B, W) on the stage, then
`add_comm` wraps each compute with its communication (RECV_F before the F of a non-first virtual
stage, SEND_F after the F of a non-last one, RECV_B before the B of a non-last virtual stage,
SEND_B after the B of a non-first one). Receives are placed immediately before the compute that
needs them and sends immediately after the compute that produced them; since every stage of a
schedule processes the items that cross a link in the same order, the receive order on each
directed pair equals the send order (FIFO), and with asynchronous sends a stage only ever blocks
on data that its peer produces without waiting for this stage (`check_schedule` proves it).

Bubble (idle / ideal time, T_F = forward, T_B = backward of one micro-batch on one stage):
  gpipe, 1f1b:        (p - 1) / m
  interleaved_1f1b:   (p - 1) / (v m) for m >= p (each chunk costs T / v)
  zb_h1:              (p - 1)(T_F + T_B - T_W) / (m (T_F + T_B + T_W))   (Qi et al. 2024)
  zbv:                (p - 1) / (6 m) for p | m with T_F = T_B = T_W per stage (chunks of
                      half a stage: half ZB-H1's (p - 1) / (3 m)), below ZB-H1's for m >= p
Peak in-flight micro-batches (F done, B not done) on stage s: gpipe m; 1f1b and zb_h1
min(p - s, m); interleaved min(2(p - s - 1) + (v - 1) g + 1, v m) chunk-activations, g the
largest micro-batch group (g = p when m % p == 0, see `interleaved_groups`); zbv at most 2p
chunk-activations counted until their W (half a micro-batch's stage activations each).
"""

from __future__ import annotations

from collections.abc import Callable
from functools import lru_cache

from colonnade.config.choices import SCHEDULES as SCHEDULE_NAMES
from colonnade.pipeline.actions import Action, Kind, ScheduleError, comm, compute, virtual_stage
from colonnade.pipeline.zbv import zbv_orders

ScheduleFn = Callable[[int, int, int, int], list[Action]]
Item = tuple[int, int]  # (microbatch, chunk)


def _check_args(name: str, pp: int, vp: int, m: int, stage: int | None = None) -> None:
    """Reject bad degrees with a message naming the config field and the fix."""
    for field, value in (("parallel.pp", pp), ("parallel.vp", vp), ("training.microbatches", m)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ScheduleError(f"{name}: {field} must be an integer >= 1, got {value!r}")
    if name == "interleaved_1f1b":
        if vp < 2:
            raise ScheduleError(
                f"interleaved_1f1b needs parallel.vp >= 2 virtual chunks per stage, got vp={vp}; "
                "use the '1f1b' schedule for vp=1"
            )
        if pp < 2:
            raise ScheduleError(
                "interleaved_1f1b needs parallel.pp >= 2 (with one stage every chunk would send to "
                "itself); set parallel.vp=1 and use '1f1b'"
            )
    elif name == "zbv":
        if vp != 2:
            raise ScheduleError(
                f"zbv runs two chunks per stage (the V placement), so parallel.vp must be 2 "
                f"(got vp={vp}); set parallel.vp=2"
            )
    elif vp != 1:
        raise ScheduleError(
            f"schedule '{name}' runs one chunk per stage, so parallel.vp must be 1 (got vp={vp}); "
            "set parallel.vp=1 or use 'interleaved_1f1b'"
        )
    if stage is not None and not (isinstance(stage, int) and 0 <= stage < pp):
        raise ScheduleError(f"{name}: stage must be in [0, parallel.pp={pp}), got {stage!r}")


def add_comm(order: list[Action], stage: int, pp: int, vp: int,
             placement: str = "loop") -> list[Action]:
    """Wrap each compute action of `stage` with the receives and sends it needs.

    RECV_F before F and SEND_F after F unless the virtual stage is first / last; RECV_B before B
    and SEND_B after B unless the virtual stage is last / first. W never communicates. Peers
    follow ``placement`` (:mod:`colonnade.pipeline.actions`).
    """
    last = pp * vp - 1
    out: list[Action] = []
    for a in order:
        v = virtual_stage(stage, a.chunk, pp, placement)
        mb, c = a.microbatch, a.chunk
        if a.kind == Kind.F:
            if v > 0:
                out.append(comm(Kind.RECV_F, mb, c, stage, pp, placement))
            out.append(a)
            if v < last:
                out.append(comm(Kind.SEND_F, mb, c, stage, pp, placement))
        elif a.kind == Kind.B:
            if v < last:
                out.append(comm(Kind.RECV_B, mb, c, stage, pp, placement))
            out.append(a)
            if v > 0:
                out.append(comm(Kind.SEND_B, mb, c, stage, pp, placement))
        else:
            out.append(a)
    return out


def _one_f_one_b_order(fwd: list[Item], bwd: list[Item], warmup: int) -> list[Action]:
    """`warmup` forwards, then alternate F(warmup + i), B(i), then the remaining backwards."""
    order = [compute(Kind.F, mb, c) for mb, c in fwd[:warmup]]
    for i in range(len(fwd) - warmup):
        order.append(compute(Kind.F, *fwd[warmup + i]))
        order.append(compute(Kind.B, *bwd[i]))
    order.extend(compute(Kind.B, mb, c) for mb, c in bwd[len(fwd) - warmup :])
    return order


def gpipe(pp: int, vp: int, m: int, stage: int) -> list[Action]:
    """GPipe: all m forwards, then all m backwards (micro-batch order 0..m-1).

    Peak in-flight: m micro-batches on every stage. Bubble (p - 1) / m of the ideal time.
    """
    _check_args("gpipe", pp, vp, m, stage)
    order = [compute(Kind.F, i) for i in range(m)] + [compute(Kind.B, i) for i in range(m)]
    return add_comm(order, stage, pp, vp)


def one_f_one_b(pp: int, vp: int, m: int, stage: int) -> list[Action]:
    """1F1B (PipeDream-flush / Megatron non-interleaved).

    Stage s runs warmup = min(pp - s - 1, m) forwards, then one forward and one backward in
    turn, then the remaining backwards; at most min(pp - s, m) micro-batches are in flight.
    """
    _check_args("1f1b", pp, vp, m, stage)
    items = [(i, 0) for i in range(m)]
    order = _one_f_one_b_order(items, items, min(pp - stage - 1, m))
    return add_comm(order, stage, pp, vp)


def interleaved_groups(pp: int, m: int) -> list[range]:
    """Micro-batch groups of the interleaved order: max(1, m // pp) groups of near-equal size.

    With m % pp == 0 these are Megatron's groups of exactly pp micro-batches. Otherwise the
    remainder is spread over the groups (sizes differ by at most one, larger groups first), so
    every group holds at least pp micro-batches (unless m < pp): stage 0 then never waits for its
    own wrap-around activation, and no stage deadlocks on a short last group.
    """
    rounds = max(1, m // pp)
    base, extra = divmod(m, rounds)
    groups, start = [], 0
    for g in range(rounds):
        size = base + (1 if g < extra else 0)
        groups.append(range(start, start + size))
        start += size
    return groups


def interleaved_items(pp: int, vp: int, m: int, backward: bool) -> list[Item]:
    """Megatron's interleaved order of (microbatch, chunk) items, identical on every stage.

    For each micro-batch group (`interleaved_groups`): chunk 0 for all its micro-batches, then
    chunk 1, ... (backward: chunk vp - 1 first). The order is the same on every stage, which
    makes the receive order on each link equal to the send order (FIFO).
    """
    items: list[Item] = []
    for group in interleaved_groups(pp, m):
        for k in range(vp):
            chunk = vp - 1 - k if backward else k
            items.extend((mb, chunk) for mb in group)
    return items


def interleaved_1f1b(pp: int, vp: int, m: int, stage: int) -> list[Action]:
    """Megatron's interleaved 1F1B over vp chunks per stage (virtual stage v = c * pp + s).

    Warmup = min(2 (pp - s - 1) + (vp - 1) g, vp m) chunk-forwards, g the largest micro-batch
    group (pp when m % pp == 0), then 1F1B over the vp m chunk items in `interleaved_items`
    order. The vp - 1 groups of warmup make the B of a group's last chunk follow its F. m need
    not be a multiple of pp: groups then grow to g = ceil(m / (m // pp)) > pp, which costs
    (vp - 1)(g - pp) more in-flight chunk-activations. Bubble for m >= pp: (pp - 1) / (vp m) of
    the ideal time (m < pp also runs, but chunks then wait for their wrap-around activation).
    """
    _check_args("interleaved_1f1b", pp, vp, m, stage)
    fwd = interleaved_items(pp, vp, m, backward=False)
    bwd = interleaved_items(pp, vp, m, backward=True)
    group = max(len(g) for g in interleaved_groups(pp, m))
    warmup = min(2 * (pp - stage - 1) + (vp - 1) * group, len(fwd))
    return add_comm(_one_f_one_b_order(fwd, bwd, warmup), stage, pp, vp)


def zb_h1(pp: int, vp: int, m: int, stage: int) -> list[Action]:
    """Zero-bubble ZB-H1 (Qi et al. 2024): 1F1B with the backward split into B and W.

    F and B run in exactly the 1F1B order (so peak activation memory is 1F1B's, min(pp - s, m)),
    and B only computes the input gradient, so the gradient chain up the pipeline is shorter.
    The weight gradients are deferred: stage s runs W(i - s) right after B(i) and flushes the
    last s W's at the end, which fills the tail bubble; stage s holds at most s + 1 pending W's
    (their saved inputs and output grads). With T_F = T_B = T_W and m >= pp the idle time per
    stage is (pp - 1)(T_F + T_B - T_W), a third of 1F1B's (pp - 1)(T_F + T_B + T_W).
    """
    _check_args("zb_h1", pp, vp, m, stage)
    warmup, lag = min(pp - stage - 1, m), stage
    order = [compute(Kind.F, i) for i in range(warmup)]
    for i in range(m):
        if warmup + i < m:
            order.append(compute(Kind.F, warmup + i))
        order.append(compute(Kind.B, i))
        if i >= lag:
            order.append(compute(Kind.W, i - lag))
    order.extend(compute(Kind.W, i) for i in range(max(0, m - lag), m))
    return add_comm(order, stage, pp, vp)


def zbv(pp: int, vp: int, m: int, stage: int) -> list[Action]:
    """Zero-bubble ZB-V (Qi et al. 2024) over vp = 2 chunks per stage in the "v" placement:
    chunk 0 of stage s is virtual stage s, chunk 1 is 2 pp - 1 - s, so stage 0 holds both the
    embedding and the loss and the turn at stage pp - 1 is a local hand-over. The backward is
    split into B and W as in ZB-H1; the order is the paper's warm-up / steady / cool-down
    pattern of :func:`colonnade.pipeline.zbv.zbv_orders`, whose peak in-flight memory is at
    most 2 pp chunk-activations, 1F1B's on its first stage. With T_F = T_B = T_W = T per stage
    (T / 2 per chunk) the idle time per stage is (pp - 1) T / 2 when pp divides m >= 2 pp,
    half ZB-H1's (pp - 1) T, never above ZB-H1's and below it for every m > pp
    (``tests/pipeline/test_zbv.py``)."""
    _check_args("zbv", pp, vp, m, stage)
    return add_comm(list(zbv_orders(pp, m)[stage]), stage, pp, vp, "v")


SCHEDULES: dict[str, ScheduleFn] = {
    "gpipe": gpipe,
    "1f1b": one_f_one_b,
    "interleaved_1f1b": interleaved_1f1b,
    "zb_h1": zb_h1,
    "zbv": zbv,
}
if tuple(SCHEDULES) != SCHEDULE_NAMES:
    raise AssertionError("pipeline.schedules must build exactly config.choices.SCHEDULES")


Lists = tuple[tuple[Action, ...], ...]  # one immutable action list per stage


@lru_cache(maxsize=64)
def schedule_lists(name: str, pp: int, vp: int, m: int) -> Lists:
    """The action lists of all pp stages of schedule `name` (a key of `SCHEDULES`), as
    immutable tuples computed once per (name, pp, vp, m): the executor asks for them every
    step, and a schedule is pure data. Invalid arguments raise every time (not cached)."""
    if name not in SCHEDULES:
        known = ", ".join(sorted(SCHEDULES))
        raise ScheduleError(f"unknown pipeline schedule {name!r}; choose one of: {known}")
    _check_args(name, pp, vp, m)
    fn = SCHEDULES[name]
    return tuple(tuple(fn(pp, vp, m, s)) for s in range(pp))


def build_schedule(name: str, pp: int, vp: int, m: int) -> list[list[Action]]:
    """The action lists of all pp stages of schedule `name`, as fresh lists the caller may
    edit (a copy of the cached :func:`schedule_lists`)."""
    return [list(actions) for actions in schedule_lists(name, pp, vp, m)]
