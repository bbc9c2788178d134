"""The training loop: steps, periodic evaluation, logging, progress bar, checkpoints."""

from __future__ import annotations

import dataclasses
import os
import time
from pathlib import Path
from typing import Any

from colonnade.checkpoint.finetune import check_tokenizers, init_weights
from colonnade.checkpoint.memory import MemorySnapshots, memory_cost, own_bytes_all
from colonnade.checkpoint.recovery import recover
from colonnade.checkpoint.training_state import (
    PendingSave,
    reserve_async_save,
    save_training,
    start_from,
)
from colonnade.config.choices import tied_across_stages
from colonnade.config.load import config_to_toml
from colonnade.config.sections import Config
from colonnade.data import collate
from colonnade.data_parallel import build_data_parallel
from colonnade.data_parallel.finalize import reduce_sp_and_tied
from colonnade.device import (
    begin_graph_step,
    keep_host_pages,
    memory_stats,
    peak_tflops,
    synchronize,
    to_device,
)
from colonnade.models.build import build_chunks, param_dtype
from colonnade.models.compile import compile_seconds, wants_compile
from colonnade.models.counts import flops_per_token
from colonnade.models.gpt import ModelChunk
from colonnade.optim.distributed import DistributedOptimizer
from colonnade.optim.qk_clip import qk_clip_of
from colonnade.parallel.dims import layout_text
from colonnade.pipeline.plan import Batch, ExecOptions, StepPlan
from colonnade.reliability.interrupt import StopRequest
from colonnade.reliability.monitor import RankInfo, RankMonitor
from colonnade.reliability.nan import check_step
from colonnade.reliability.rejoin import PEER_FAILURES, Membership
from colonnade.reliability.straggler import StepTimer, StragglerWatch
from colonnade.tensor_parallel.float8 import kernel_for
from colonnade.training.inprocess import after_step, rejoin, restore
from colonnade.training.lifecycle import begin_run, end_run, write_run_config
from colonnade.training.metrics import (
    MetricsWriter,
    RunClock,
    format_duration,
    format_line,
    perplexity,
)
from colonnade.training.moe import begin_moe_step, end_moe_step, install_moe_state
from colonnade.training.progress import progress_bar
from colonnade.training.setup import Data, Runtime, build_data, init_runtime
from colonnade.training.step import (
    forward_only,
    install_doc_reset,
    mean_loss,
    set_train_mode,
    start_mean_loss,
    step_losses,
)
from colonnade.training.vocab import with_data_vocab


class Trainer:
    """Owns the model chunks, optimizer and data of one rank and runs steps."""

    def __init__(self, rt: Runtime, data: Data | None = None) -> None:
        self.rt, self.config, self.groups = rt, rt.config, rt.groups
        cfg = self.config
        if rt.device.type == "cpu":
            keep_host_pages()  # no page faults re-mapping each step's activations
        self.data = data
        self.chunks: list[ModelChunk] = build_chunks(cfg, self.groups, rt.device)
        install_moe_state(self.chunks, self.groups)  # MoE: aux-loss scale and stats sink
        if data is not None:  # data.reset_position_ids / reset_attention_mask need the EOD id
            install_doc_reset(self.chunks, cfg.data, data.tokenizer)
        self.ddp = build_data_parallel(self.chunks, cfg, self.groups)
        self.optimizer = DistributedOptimizer(self.ddp, cfg.optim, self.groups, cfg.training.steps,
                                              cfg.training.precision,
                                              qk_clip_of(self.chunks, cfg.optim, self.groups))
        self.step = 0
        self.clock: RunClock | None = None
        """The loop's clock while :func:`train` runs (None before)."""
        self.resumed_elapsed_s = 0.0
        """Seconds of training the resumed checkpoint recorded (0 for a fresh start)."""
        self.timer: StepTimer | None = None
        """Marks the parts of each step for straggler detection (None: off)."""
        self.snapshots: MemorySnapshots | None = None
        """The run's memory snapshots while :func:`train` runs (checkpoint.memory_interval)."""

    @property
    def elapsed_s(self) -> float:
        """Seconds of training of the whole run, across resumes (what a checkpoint records):
        the loop's clock while it runs, else what the resumed checkpoint recorded."""
        return self.clock.elapsed() if self.clock is not None else self.resumed_elapsed_s

    @elapsed_s.setter
    def elapsed_s(self, seconds: float) -> None:  # a resume (load_training) restores it
        self.resumed_elapsed_s = seconds

    def train_step(self, batches: list[Batch], signum: int = 0) -> dict[str, float]:
        """Forward/backward every micro-batch, reduce gradients, update. Returns metrics;
        ``stop_signal`` among them is the largest stop signal any rank passed as ``signum``
        (0: none), agreed on by the loss all-reduce (:func:`start_mean_loss`)."""
        set_train_mode(self.chunks, True)
        if self.config.training.cuda_graphs:
            begin_graph_step(self.rt.device)
        self.optimizer.zero_grad()
        begin_moe_step(self.chunks, self.groups, self.optimizer.loss_scale, len(batches))
        plan = StepPlan(self.groups, self.step, self.config.parallel.schedule,
                        loss_scale=self.optimizer.loss_scale,
                        grad_sync=self.ddp.grad_sync_hook(len(batches)),
                        options=self.executor_options())
        losses = step_losses(self.chunks, batches, plan)  # [m] on the device
        loss = start_mean_loss(losses, self.groups, self.rt.device, batches, signum)  # in flight
        self.ddp.finish_grad_sync()
        reduce_sp_and_tied(self.chunks, self.groups, tied_across_stages(
                               self.config.model.tie_embeddings, self.config.parallel.schedule),
                           self.ddp)
        if self.timer is not None:
            self.timer.phase("optimizer")
        info = self.optimizer.step(riders=loss.ready())  # the step's one host read
        mean, stop = loss.result(self.optimizer.rider_values)
        if self.timer is not None:
            self.timer.end()
        moe = end_moe_step(self.chunks, self.config, self.groups, self.rt.device)
        self.step += 1
        if self.step >= self.config.training.steps:
            self.ddp.finish_param_gather()  # final weights complete for export / checkpoint
        return {"loss": mean, **info, **moe, "stop_signal": float(stop)}

    def executor_options(self) -> ExecOptions:
        """Pipeline executor switches taken from the config."""
        par = self.config.parallel
        return ExecOptions(overlap=par.overlap_p2p, in_order=par.p2p_in_order)

    def next_batches(self) -> list[Batch]:
        """This rank's micro-batches of the next step."""
        assert self.data is not None
        device = self.rt.device
        if self.timer is not None:
            self.timer.start()
        out = []
        for indices in self.data.sampler.next_step():
            tokens, labels = collate(self.data.train, indices)
            out.append((to_device(tokens, device), to_device(labels, device)))
        if self.timer is not None:
            self.timer.phase("compute")
        return out

    def evaluate(self) -> float:
        """Mean loss over the valid tokens of ``eval_batches`` micro-batches of the valid split
        (same on all ranks)."""
        assert self.data is not None
        set_train_mode(self.chunks, False)
        tr, valid = self.config.training, self.data.valid
        b = tr.micro_batch_size
        count = min(tr.eval_batches, max(1, len(valid) // b))
        batches = []
        for k in range(count):
            idx = [(k * b + i) % len(valid) for i in range(b)]
            tokens, labels = collate(valid, idx)
            batches.append((tokens.to(self.rt.device), labels.to(self.rt.device)))
        plan = StepPlan(self.groups, self.step, self.config.parallel.schedule,
                        options=self.executor_options())
        losses = forward_only(self.chunks, batches, plan)
        set_train_mode(self.chunks, True)
        return mean_loss(losses, self.groups, self.rt.device, batches)  # token-weighted


def train(config: Config, monitor: RankMonitor | None = None,
          membership: Membership | None = None) -> dict[str, Any]:
    """Run a whole training job on this rank; returns a summary (losses, throughput).

    ``monitor`` (the launcher's per-rank heartbeat / hang watchdog) is told about every step.
    ``membership`` (checkpoint.restart='in-process'): a step failing because a peer died is
    followed by a rejoin and a restore in this process (:mod:`colonnade.training.inprocess`);
    a replacement rank (generation > 0) restores instead of loading.
    """
    rt = init_runtime(config)
    replacing = membership is not None and membership.generation > 0
    data = build_data(rt.config, rt.groups, replacing)
    rt = dataclasses.replace(rt, config=with_data_vocab(  # vocab_size unset: the tokenizer's
        rt.config, rt.groups.world.size, data.vocab_size, rt.is_logger))
    cfg = rt.config
    trainer = Trainer(rt, data)
    tr, log_cfg, ck = cfg.training, cfg.logging, cfg.checkpoint
    watch = _straggler_watch(rt)
    trainer.timer = watch.timer if watch is not None else None
    check_tokenizers(cfg, data.tokenizer)  # the data's against blend's and the checkpoint's
    info = monitor.info if monitor is not None else RankInfo.from_env()
    snapshots = trainer.snapshots = open_snapshots(trainer, info, replacing)
    restored = False
    if replacing:  # this process replaces a dead rank: the same restore as the survivors'
        assert membership is not None
        note, restored = restore(trainer, membership), True
        if rt.is_logger:
            print(f"colonnade: in-process restart: {note}")
    elif snapshots is not None and info.attempt > 0:  # a restart: the recovery ladder
        recovery = recover(trainer, snapshots, Path(ck.load) if ck.load else None)
        restored = "none" not in recovery.sources
        if rt.is_logger:
            print(f"colonnade: restart {info.attempt}: {recovery.describe()}", flush=True)
    if not restored and (ck.load or ck.init_from):
        note = start_from(trainer, ck.load) if ck.load else init_weights(trainer, ck.init_from)
        if rt.is_logger:
            print(f"colonnade: {note}")
    if not begin_run(cfg, trainer.step, rt.groups):  # a re-run of a finished run
        return {"history": [], "valid": [], "rank": rt.groups.rank, "finished": True}
    pending: PendingSave | None = None
    if ck.save and ck.interval and ck.async_save:
        reserve_async_save(trainer)  # host buffers allocated off the training thread
    writer = _open_run_log(cfg, rt, trainer)
    tokens_per_step = int(tr.global_batch_size or 1) * tr.seq_len
    peak = peak_tflops(rt.device, param_dtype(tr.precision), log_cfg.peak_tflops)
    if peak is None and rt.is_logger:
        print(f"colonnade: MFU n/a: the peak TFLOP/s of {rt.device} is unknown (set "
              "--logging.peak_tflops=PEAK to report MFU)")
    throughput = _Throughput(tokens_per_step, flops_per_token(cfg.model, tr.seq_len),
                             rt.groups.world.size, peak)
    history: list[dict[str, Any]] = []
    valid_losses = _earlier_valid(writer)  # the whole run's: the earlier segments' first
    window_start, window_steps = time.perf_counter(), 0
    compiling, compiled_logged = wants_compile(tr), 0.0
    compile_base = compile_seconds()  # this run's compilations only, not earlier ones in-process
    clock = RunClock(trainer.step, tr.steps, tokens_per_step, trainer.elapsed_s)
    trainer.clock = clock  # what a save records as the run's elapsed time
    stopper, stop = StopRequest(monitor is None).install(), 0  # Ctrl-C / SIGTERM: save, stop
    if monitor is not None:
        monitor.graceful_stop = True
    with progress_bar(tr.steps, log_cfg.progress and rt.is_logger) as bar:  # prints: whole lines
        if tr.eval_interval:
            valid_losses.append(_first_eval(trainer, writer, clock))
        while trainer.step < tr.steps:
            if monitor is not None:
                monitor.beat(trainer.step + 1, rt.groups.stats)  # step in progress, as logged
            failure = ""
            try:
                metrics = trainer.train_step(trainer.next_batches(), stopper.signum)
            except PEER_FAILURES as err:  # a peer died: rejoin and restore, or end the rank
                if membership is None:
                    raise
                failure = str(err) or type(err).__name__
            if failure:  # outside the except: its traceback (the step's handles) is gone
                assert membership is not None
                note = rejoin(trainer, membership, failure, monitor)
                history = [r for r in history if r["step"] <= trainer.step]
                if rt.is_logger:
                    print(f"colonnade: {note}", flush=True)
                window_start, window_steps = time.perf_counter(), 0
                continue
            after_step(membership, trainer.step, rt.is_logger)
            stop = int(metrics.pop("stop_signal"))  # every rank stops after this step
            window_steps += 1
            check_step(trainer, metrics)  # training.on_nan: raise or skip, before any save
            if snapshots is not None and trainer.step < tr.steps and not stop:
                snapshots.snapshot(trainer)  # staged now, written and sent during the next step
            if bar is not None:
                bar.update(1)
                bar.set_postfix(loss=f"{metrics['loss']:.3f}")
            step = trainer.step
            if (ck.save and ck.interval and step % ck.interval == 0 and step < tr.steps
                    and not stop):
                # async: it may start while the previous one is still being written
                pending = save_training(trainer, ck.save, keep_last=ck.keep_last,
                                        async_save=ck.async_save, tokenizer=data.tokenizer)
            found = (watch.check() if watch is not None and step % log_cfg.straggler_interval == 0
                     else [])  # a log step (validated): the loop synchronises there anyway
            evaluate = not stop and tr.eval_interval and (step % tr.eval_interval == 0
                                                          or step == tr.steps)
            if evaluate:
                valid_losses.append((step, trainer.evaluate()))
            compiled = compile_seconds() - compile_base if compiling else 0.0  # host: no sync
            if (step % log_cfg.log_interval == 0 or step == tr.steps or evaluate or stop
                    or compiled > compiled_logged):  # a (re)compilation is logged at once
                synchronize(rt.device)
                dt = (time.perf_counter() - window_start) / max(1, window_steps)
                rec = {"step": step, **metrics, **throughput.fields(dt),
                       **memory_stats(rt.device), **clock.fields(step)}
                if compiled > compiled_logged:  # seconds compiling so far, in this process
                    rec["compile_s"] = compiled_logged = compiled
                if evaluate:
                    rec["valid_loss"] = valid_losses[-1][1]
                    rec["valid_ppl"] = perplexity(rec["valid_loss"])
                if found:
                    rec["stragglers"] = [dataclasses.asdict(s) for s in found]
                history.append(rec)
                if writer is not None:
                    writer.write(rec)
                    print(format_line(rec), flush=True)
                    for s in found:
                        print(f"colonnade: {s.describe()}", flush=True)
                window_start, window_steps = time.perf_counter(), 0
            if stop:
                break
    if snapshots is not None:
        snapshots.close()
    end_run(trainer, pending, stop, data.tokenizer, monitor)  # a signal now: noted, ignored
    if snapshots is not None:
        snapshots.clear()  # the disk holds the final state: free the node's memory
    stopper.restore()
    if writer is not None:
        writer.close()
    return {"history": history, "valid": valid_losses, "rank": rt.groups.rank,
            "interrupted": stop}


def ranks_per_node(world: int) -> int:
    """Ranks on each node: the launcher's LOCAL_WORLD_SIZE (torchrun and ``--nproc`` set it),
    else the whole world (one node)."""
    return int(os.environ.get("LOCAL_WORLD_SIZE", str(world)))


def open_snapshots(trainer: Trainer, info: RankInfo, replacing: bool = False
                   ) -> MemorySnapshots | None:
    """The run's memory snapshots (checkpoint.memory_interval > 0; collective), else None.
    A first start removes the snapshot files an earlier job left in memory_dir (they are a
    cache of another job's memory, never a checkpoint); every start logs the memory cost.
    ``replacing`` (a rank replacing a dead one in process, :mod:`colonnade.training.inprocess`):
    only the snapshot group is made, as the survivors remake theirs; the files its
    predecessor left are its memory rung, kept."""
    cfg, groups = trainer.config, trainer.groups
    if cfg.checkpoint.memory_interval <= 0:
        return None
    per_node = ranks_per_node(groups.world.size)
    snaps = MemorySnapshots.create(trainer, info.run_id, per_node)
    if replacing:
        return snaps
    cleared = snaps.clear() if info.attempt == 0 else 0
    own = own_bytes_all(snaps, trainer)
    held = memory_cost(own, per_node)
    if groups.rank == 0:
        mib = 2**20
        print(f"colonnade: memory snapshots every {snaps.interval} step(s) in {snaps.dir}: "
              f"{max(held) / mib:.2f} MiB per rank at most (own {own[0] / mib:.2f} MiB + a "
              f"partner's copy; rank 0 sends {own[0] / snaps.interval / mib:.2f} MiB per step)"
              + (f"; removed {cleared} snapshot file(s) of an earlier job" if cleared else ""),
              flush=True)
    return snaps
def _straggler_watch(rt: Runtime) -> StragglerWatch | None:
    """The straggler detector (logging.straggler_interval > 0, more than one rank); peers are
    the ranks of one pipeline stage."""
    log_cfg = rt.config.logging
    if not log_cfg.straggler_interval or rt.groups.world.size < 2:
        return None
    stages = rt.groups.dims.group_ranks(("dp", "cp", "tp"))
    return StragglerWatch(rt.groups.world, stages, log_cfg.straggler_threshold,
                          log_cfg.straggler_windows, rt.device)


def _first_eval(trainer: Trainer, writer: MetricsWriter | None, clock: RunClock
                ) -> tuple[int, float]:
    """The validation loss before the first step (logged; written unless resuming, whose
    step already has its record): (step, loss)."""
    loss = trainer.evaluate()
    if writer is not None:
        rec = {"step": trainer.step, "valid_loss": loss, "valid_ppl": perplexity(loss),
               **clock.fields(trainer.step)}
        if trainer.step == 0:
            writer.write(rec)
        print(format_line(rec), flush=True)
    return trainer.step, loss


def _earlier_valid(writer: MetricsWriter | None) -> list[tuple[int, float]]:
    """(step, validation loss) of the records a resumed run continues (its earlier segments,
    kept in metrics.jsonl; logging rank only, the one that prints the summary)."""
    if writer is None:
        return []
    return [(int(r["step"]), float(r["valid_loss"])) for r in writer.kept if "valid_loss" in r]


def _open_run_log(cfg: Config, rt: Runtime, trainer: Trainer) -> MetricsWriter | None:
    """On the logging rank: the metrics writer (records past the resumed step moved aside,
    said), the run's config.toml, and the start-up line naming the layout; None elsewhere."""
    if not rt.is_logger:
        return None
    log_cfg, tr = cfg.logging, cfg.training
    writer = MetricsWriter(log_cfg.dir, log_cfg.tensorboard, start_step=trainer.step,
                           wandb_project=log_cfg.wandb_project,
                           wandb_run_name=log_cfg.wandb_run_name,
                           run_config=dataclasses.asdict(cfg))
    if writer.dropped:
        whose = (f"past step {trainer.step} (not this run's)" if trainer.step
                 else "of an earlier run in this logging.dir")
        print(f"colonnade: moved {writer.dropped} metrics.jsonl record(s) {whose} to "
              "metrics.dropped.jsonl")
    kept = write_run_config(log_cfg.dir, config_to_toml(cfg))
    if kept:
        print(f"colonnade: {kept}")
    layout = layout_text(cfg.parallel, rt.groups.dims.describe(), cfg.model.num_layers)
    print(f"colonnade: {layout} on {rt.device}, "
          f"{sum(p.numel() for c in trainer.chunks for p in c.parameters()):,} params on "
          f"rank 0, global batch {tr.global_batch_size} x {tr.seq_len} tokens")
    print(f"colonnade: optimizer {trainer.optimizer.describe()}")
    if tr.fp8 != "off":
        kernel = kernel_for(rt.device, param_dtype(tr.precision))
        how = ("torch._scaled_mm" if kernel == "scaled_mm"
               else "emulated: quantise, dequantise, matmul")
        print(f"colonnade: float8 {tr.fp8} GEMMs in the linear layers ({how}); the output "
              "head, masters and checkpoints stay in their dtypes")
    return writer


@dataclasses.dataclass(frozen=True)
class _Throughput:
    """What a logged step's speed fields are computed from."""

    tokens_per_step: int
    flops_per_token: float
    world: int
    peak: float | None
    """Peak TFLOP/s of one device; None (a CPU): no MFU rather than a guessed one."""

    def fields(self, step_time_s: float) -> dict[str, float]:
        """step_time_s, tokens_per_s, tflops_per_device (model FLOPs over every rank) and,
        with a known peak, mfu."""
        tps = self.tokens_per_step / step_time_s
        out = {"step_time_s": step_time_s, "tokens_per_s": tps,
               "tflops_per_device": tps * self.flops_per_token / 1e12 / self.world}
        if self.peak:
            out["mfu"] = out["tflops_per_device"] / self.peak
        return out


def final_summary(result: dict[str, Any]) -> str:
    """A closing line over the whole run (a resumed run's earlier segments included): first
    and last validation loss, the relative drop, the steps they span and the training time."""
    valid = sorted(dict(result["valid"]).items())  # a resume re-evaluates its step: once
    if len(valid) < 2:
        return "no evaluation was run"
    (start, first), (end, last) = valid[0], valid[-1]
    history = result.get("history") or [{}]
    took = (f", {format_duration(history[-1]['elapsed_s'])} of training"
            if "elapsed_s" in history[-1] else "")
    return (f"validation loss {first:.4f} -> {last:.4f} "
            f"({100 * (first - last) / first:.1f}% lower) over steps {start}-{end}{took}")

