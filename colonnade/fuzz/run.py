"""One fuzz case's verdict: refused before launch, or trained and compared with its reference.

:func:`judge` takes a :class:`~colonnade.fuzz.space.Case`:

1. resolve it for its world and run the validator (:func:`problems_by_rule`) before any rank
   or group exists: problems -> verdict ``refused`` with the rules and messages;
2. else train ``training.steps`` steps through the Trainer on ``world`` pool ranks
   (:func:`rank_case`) and the same model on one rank with every degree 1
   (:func:`reference_config`: dp 1 with microbatches x dp micro-batches, ZeRO 0, no
   recompute, the same global batches):
   per step the loss, the global gradient norm and every gradient gathered to its full tensor;
   after the last step every parameter (each tensor's relative error over a floor of a share
   of all tensors' norm, :attr:`Tolerance.grad_share`, :data:`PARAM_FLOOR_SHARE`). Within
   :data:`TOLERANCES` of the case's precision: ``match``; else ``mismatch`` naming the worst
   quantity;
3. where the model has a transformers class and nothing outside it (no dropout, ...:
   :func:`~colonnade.fuzz.hf_twin.twin_gap`), the single-process run against its HF twin
   trained by ``torch.optim.AdamW`` (:func:`~colonnade.fuzz.hf_twin.hf_twin`, bounds
   :data:`HF_TOLERANCE`); a mismatch there is a ``mismatch`` too (``hf_*`` quantities);
4. any exception once the validator has accepted the case is ``late refusal`` (a traceback,
   a late error), a run past its timeout is ``hang``: both count as bugs.

Data: step ``k`` of a case trains on a global batch of ``microbatches x dp`` micro-batches
[micro, seq + 1] drawn from ``torch.Generator().manual_seed(1000 training.seed + k)``; dp rank r
takes micro-batches [r m, (r + 1) m) (its cp ranks the same ones, each its zigzag rows).
With document resets, a share of the tokens is the end-of-document id.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from colonnade.config.sections import Config, ModelConfig, ParallelConfig
from colonnade.config.validate import problems_by_rule, resolve
from colonnade.fuzz.compare import (
    HF_TOLERANCE,
    PARAM_FLOOR_SHARE,
    TOLERANCES,
    Tolerance,
    floor_of,
    worst,
)
from colonnade.fuzz.hf_twin import hf_twin, to_file_layout, twin_gap
from colonnade.fuzz.space import EOD_RATE, Case
from colonnade.parallel.pool import RankError, RankPools, RankTimeout
from colonnade.pipeline.plan import Batch

VERDICTS: tuple[str, ...] = ("match", "refused", "unreferenced", "mismatch", "late refusal",
                             "hang")
"""Every verdict; the last three are failures. 'unreferenced': accepted, but no
single-process run has the same objective (:func:`no_reference`), so nothing was run."""
FAILURES: frozenset[str] = frozenset(VERDICTS[3:])
"""Verdicts that count as bugs (the command exits non-zero)."""


@dataclass
class Verdict:
    """What one case came to."""

    case: str
    """``seed/index``."""
    summary: str
    """The layout summary (:attr:`Case.summary`)."""
    verdict: str
    """One of :data:`VERDICTS`."""
    seconds: float
    rules: list[tuple[str, str]] = field(default_factory=list)
    """(rule name, message) of each problem the validator found (``refused``)."""
    errors: dict[str, float] = field(default_factory=dict)
    """Largest relative error of each compared quantity (loss, grad_norm, grads, params)."""
    worst: str = ""
    """What mismatched most (``mismatch``), or the error's first line (late refusal, hang)."""
    detail: str = ""
    """The failing ranks' tracebacks (late refusal) or the ranks that did not answer (hang)."""
    hf: str = ""
    """Why the case was not also checked against its transformers twin ('' when it was)."""

    @property
    def max_err(self) -> float:
        """The largest relative error of any quantity (0 when nothing was compared)."""
        return max(self.errors.values(), default=0.0)


# ----------------------------------------------------------------------------- rank side


def global_batch(config: Config, step: int, eod: int | None) -> list[Batch]:
    """Every micro-batch of step ``step`` (tokens, labels [micro, seq]), the same in every
    layout of the case (see the module docstring)."""
    tr, m = config.training, config.model
    count = int(tr.microbatches or 1) * int(config.parallel.dp or 1)
    gen = torch.Generator().manual_seed(tr.seed * 1000 + step)
    ids = torch.randint(0, m.vocab, (count, tr.micro_batch_size, tr.seq_len + 1),
                        generator=gen)  # [count, b, s + 1]
    if eod is not None:
        ends = torch.rand(ids.shape, generator=gen) < EOD_RATE
        ids = ids.masked_fill(ends, eod)
    return [(d[:, :-1].contiguous(), d[:, 1:].contiguous()) for d in ids]


def rank_batches(data: Config, run: Config, step: int, eod: int | None,
                 dp_rank: int) -> list[Batch]:
    """The micro-batches of step ``step`` that dp rank ``dp_rank`` of the run ``run`` takes
    from the case's global batch (:func:`global_batch` of the case's config ``data``): its
    microbatches-long slice; or, for a reference that regroups (:func:`reference_config`:
    micro-batches of ``micro x dp`` sequences), micro-batch k the concatenation of every dp
    rank's k-th micro-batch (the case's micro-step k)."""
    batches = global_batch(data, step, eod)
    m = int(run.training.microbatches or 1)
    if run.training.micro_batch_size == data.training.micro_batch_size:
        return batches[dp_rank * m:(dp_rank + 1) * m]
    dp = int(data.parallel.dp or 1)
    return [tuple(torch.cat([batches[r * m + k][i] for r in range(dp)])  # [micro dp, s]
                  for i in range(2)) for k in range(m)]  # type: ignore[misc]


def full_grads(trainer: Any) -> dict[str, torch.Tensor]:
    """This step's reduced gradient of every parameter of this rank's stage as its full
    tensor (float64), keyed like :func:`colonnade.checkpoint.export.full_state`; called after
    the gradient sync, before the optimizer step (collective over the stage's ranks).

    The flat pieces this rank holds (:meth:`DataParallel.owned_ranges`, all of them without
    ZeRO) are written into zero-filled local tensors; with ZeRO each element is held by one
    rank of its bucket's shard group (expert-dp for expert weights; under hybrid sharding one
    shard group of it), so a sum over that group rebuilds the local (tp / ep / expert tp shard)
    tensor exactly; then the tp / ep / expert tp all-gather of ``gather_full``.
    """
    from colonnade.checkpoint.export import gather_full

    ddp, groups = trainer.ddp, trainer.groups
    buffers = ddp.buffers
    flat = {id(p): torch.zeros(p.numel(), dtype=torch.float64) for p in buffers.params}
    for (lo, hi), grad in zip(ddp.owned_ranges(), ddp.step_grads(), strict=True):
        for p, a, b in buffers.segments(lo, hi):
            start = buffers.slot(p).start
            flat[id(p)][a - start:b - start] = grad[a - lo:b - lo].double()
    out: dict[str, torch.Tensor] = {}
    for p in buffers.params:
        local = flat[id(p)]
        if ddp.sharded:  # the bucket's shard group: dp x cp or expert-dp (hybrid: a part)
            group = ddp.shard_groups.shard(ddp.buckets[buffers.slot(p).bucket])
            group.all_reduce(local, name="fuzz_gather_grad")
        key = p.sharding.key
        out[key] = gather_full(local.view(p.shape), p.sharding, groups.tp, groups.ep,
                               groups.expert_tp).clone()
    return out


def rank_case(config: Config, world: int, eod: int | None, data: Config) -> dict[str, Any]:
    """Rank side: ``training.steps`` Trainer steps of the resolved, validated ``config`` on
    this pool rank, on the global batches of the case's config ``data``. Returns per step the
    loss and grad norm; on the rank that speaks for its
    pipeline stage (dp x cp rank 0, tp rank 0) the full gradients of each step and the full
    parameters after the last; at world 1 also the initial parameters (the HF twin's)."""
    from colonnade.checkpoint.export import full_state
    from colonnade.models.blocks import DocReset
    from colonnade.training.loop import Trainer
    from colonnade.training.setup import Runtime, build_groups

    torch.set_num_threads(1)
    groups = build_groups(config, world)
    trainer = Trainer(Runtime(config, torch.device("cpu"), groups), None)
    if eod is not None:
        resets = config.data
        for chunk in trainer.chunks:
            chunk.doc_reset = DocReset(eod, positions=resets.reset_position_ids,
                                       attention=resets.reset_attention_mask)
    keep = groups.dp_cp.rank == 0 and groups.tp.rank == 0
    initial = full_state(trainer.chunks, groups, trainer.ddp) if world == 1 else {}
    grads: list[dict[str, torch.Tensor]] = []
    step_fn = trainer.optimizer.step

    def step_and_gather(riders: torch.Tensor | None = None) -> dict[str, float]:
        gathered = full_grads(trainer)
        grads.append(gathered if keep else {})
        return step_fn(riders)

    trainer.optimizer.step = step_and_gather
    losses, norms = [], []
    for step in range(config.training.steps):
        info = trainer.train_step(rank_batches(data, config, step, eod, groups.dp.rank))
        losses.append(info["loss"])
        norms.append(info["grad_norm"])
    trainer.ddp.finish_param_gather()
    params = full_state(trainer.chunks, groups, trainer.ddp)
    params = {k: v.double() for k, v in params.items()} if keep else {}
    return {"losses": losses, "norms": norms, "grads": grads, "params": params,
            "initial": {k: v.double().clone() for k, v in initial.items()}}


# ----------------------------------------------------------------------------- parent side


def global_token_losses(model: ModelConfig) -> bool:
    """Whether the model has a router loss over the 'global' token set (the 'global'
    balancing loss, the z-loss): each micro-step's loss counts the tokens of every dp x cp x
    tp(sp) rank's micro-batch of that micro-step (training/moe.py), so which sequences share a
    micro-step is part of the objective."""
    balance = model.moe_aux_loss_coeff > 0 and model.moe_aux_loss_type == "global"
    return model.moe and (balance or model.moe_z_loss_coeff > 0)


def no_reference(config: Config) -> str:
    """Why no single-process run trains the objective of ``config`` ('' when one does): with
    a router loss over the 'global' token set (:func:`global_token_losses`) at dp > 1 the
    reference must put the dp ranks' k-th micro-batches into one micro-batch, which moves
    their sequences to other (micro-batch, element) indices, and dropout masks are a hash of
    those indices (layout-independent only while a sequence keeps them)."""
    m = config.model
    dropout = m.hidden_dropout > 0 or m.attention_dropout > 0
    if global_token_losses(m) and dropout and int(config.parallel.dp or 1) > 1:
        return ("dropout with a 'global' router loss at dp > 1: no single-process run has "
                "both the micro-step grouping and the dropout masks")
    return ""


def reference_config(config: Config) -> Config:
    """``config`` (resolved) on one rank: every degree 1, ZeRO 0, no recompute, no pipeline
    layout, the same global batch: as microbatches x dp micro-batches; or, when the objective
    groups a micro-step's sequences (:func:`global_token_losses`), as microbatches
    micro-batches of micro x dp sequences, micro-step k the dp ranks' k-th micro-batches
    (:func:`rank_batches`)."""
    par, tr = config.parallel, config.training
    dp, m = int(par.dp or 1), int(tr.microbatches or 1)
    single = ParallelConfig(bucket_size=par.bucket_size, timeout_s=par.timeout_s)
    shape = ({"micro_batch_size": tr.micro_batch_size * dp, "microbatches": m}
             if global_token_losses(config.model) else {"microbatches": m * dp})
    training = dataclasses.replace(tr, recompute="none", **shape)
    return resolve(dataclasses.replace(config, parallel=single, training=training), 1)


def judge(case: Case, pools: RankPools, timeout_s: float = 300.0, hf: bool = True) -> Verdict:
    """The verdict of ``case`` (see the module docstring); ``hf``: also train the
    transformers twin where the case has one (:func:`colonnade.fuzz.hf_twin.twin_gap`)."""
    start = time.monotonic()
    config = resolve(case.config, case.world)
    found = problems_by_rule(config, case.world)

    def verdict(kind: str, **extra: Any) -> Verdict:
        return Verdict(case.name, case.summary, kind, time.monotonic() - start, **extra)

    if found:
        return verdict("refused", rules=found)
    single = reference_config(config)
    if problems_by_rule(single, 1):
        return verdict("late refusal", worst="its single-process reference is refused",
                       detail="\n".join(m for _, m in problems_by_rule(single, 1)))
    why = no_reference(config)
    if why:
        return verdict("unreferenced", worst=why)
    gap = twin_gap(single, case.eod) if hf else "not asked (--no-hf)"
    try:
        (want,) = pools.get(1).call(rank_case, (single, 1, case.eod, config),
                                    timeout_s=timeout_s)
        got = pools.get(case.world).call(rank_case, (config, case.world, case.eod, config),
                                         timeout_s=timeout_s)
        twin = None
        if not gap:
            batches = [rank_batches(config, single, k, case.eod, 0)
                       for k in range(single.training.steps)]
            (twin,) = pools.get(1).call(hf_twin, (single, want["initial"], batches),
                                        timeout_s=timeout_s)
            gap = twin.get("gap", "")
            twin = None if gap else twin
    except RankTimeout as err:
        return verdict("hang", worst=str(err).splitlines()[0], detail=str(err), hf=gap)
    except RankError as err:
        lines = str(err).splitlines()
        return verdict("late refusal", worst=lines[1].strip() if len(lines) > 1 else str(err),
                       detail=str(err), hf=gap)
    tol = TOLERANCES[config.training.precision]
    errors, where = compare(got, want, tol)
    over = [k for k, v in errors.items() if not v <= _bound(tol, k)]
    if twin is not None:
        hf_errors, hf_where = compare([twin], to_file_layout_run(single, want), HF_TOLERANCE)
        over += [f"hf_{k}" for k, v in hf_errors.items() if not v <= _bound(HF_TOLERANCE, k)]
        errors.update({f"hf_{k}": v for k, v in hf_errors.items()})
        where.update({f"hf_{k}": v for k, v in hf_where.items()})
    if over:
        return verdict("mismatch", errors=errors, hf=gap,
                       worst="; ".join(f"{k}: {where[k]}" for k in over))
    return verdict("match", errors=errors, hf=gap)


def _bound(tol: Tolerance, kind: str) -> float:
    """The bound of one compared quantity."""
    return {"loss": tol.loss, "params": tol.params}.get(kind, tol.grads)


def to_file_layout_run(config: Config, run: dict[str, Any]) -> dict[str, Any]:
    """A single-process run's gradients and parameters under HF's file-layout names."""
    cfg, like = config.model, run["params"]
    return {"losses": run["losses"], "params": to_file_layout(cfg, like, like),
            "grads": [to_file_layout(cfg, g, like) for g in run["grads"]]}


def compare(got: list[dict[str, Any]], want: dict[str, Any],
            tol: Tolerance) -> tuple[dict[str, float], dict[str, str]]:
    """Largest relative error of each quantity (loss, grad_norm where both have norms,
    grads, params) of the ranks' results ``got`` against the reference ``want``, and where
    it is (step and tensor)."""
    errors: dict[str, float] = {}
    where: dict[str, str] = {}

    def note(kind: str, err: float, at: str) -> None:
        if not err <= errors.get(kind, -1.0):  # NaN is kept
            errors[kind], where[kind] = err, at

    for res in got:
        for step, (a, b) in enumerate(zip(res["losses"], want["losses"], strict=True)):
            note("loss", abs(a - b) / abs(b) if b else abs(a - b), f"step {step}")
        if "norms" in res and "norms" in want:
            for step, (a, b) in enumerate(zip(res["norms"], want["norms"], strict=True)):
                note("grad_norm", abs(a - b) / abs(b) if b else abs(a - b), f"step {step}")
    for step, ref in enumerate(want["grads"]):
        merged = _merge(res["grads"][step] for res in got)
        err, name = worst(merged, ref, floor_of(ref, tol.grad_share, tol.floor))
        note("grads", err, f"step {step} {name}")
    floor = floor_of(want["params"], PARAM_FLOOR_SHARE, tol.floor)
    err, name = worst(_merge(res["params"] for res in got), want["params"], floor)
    note("params", err, f"after step {len(want['losses']) - 1} {name}")
    return errors, where


def _merge(parts: Any) -> dict[str, torch.Tensor]:
    """The union of the stages' tensors (a tied weight appears on two stages: equal)."""
    out: dict[str, torch.Tensor] = {}
    for part in parts:
        out.update(part)
    return out
