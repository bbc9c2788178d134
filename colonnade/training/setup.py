"""Start-up of a run: distributed initialisation, device, process groups, datasets."""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from colonnade.config.choices import DATA_FORMATS, tied_across_stages
from colonnade.config.data_paths import blend_entries
from colonnade.config.sections import Config
from colonnade.config.validate import resolve, validate
from colonnade.data import (
    BatchSampler,
    BlendedDataset,
    DataError,
    IndexedDataset,
    WindowDataset,
    prepare,
)
from colonnade.data.prepare import REUSE_LINE
from colonnade.device import apply_tf32, backend_for, fp8_gemm_supported, pick_device
from colonnade.parallel.dims import ParallelDims
from colonnade.parallel.groups import ProcessGroups
from colonnade.training.preflight import (
    DataPlan,
    check_prepare_target,
    check_vocab,
    data_plan,
    prepare_vocab,
)

PREPARE_POLL_S = 0.5
"""How often a rank waiting for rank 0's data preparation looks for its word (seconds)."""


@dataclass
class Runtime:
    """Where this process sits: its config (resolved, validated), device and groups."""

    config: Config
    device: torch.device
    groups: ProcessGroups

    @property
    def is_logger(self) -> bool:
        """Rank 0 prints and writes metrics."""
        return self.groups.rank == 0


def init_runtime(config: Config) -> Runtime:
    """Validate against the world size, then init torch.distributed and build every group.

    Under torchrun (RANK / WORLD_SIZE / LOCAL_RANK set by the launcher) the process joins the
    job; otherwise it is a world of one. The config is checked *before* any group is made.
    ``checkpoint.init_from``'s model is already in ``config`` (applied where it was read).
    """
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    config = validate(resolve(config, world), world)
    device = pick_device(config.training.device, local_rank)
    apply_tf32(device, config.training.tf32)  # fp32 matmuls on TF32 tensor cores (CUDA)
    check_fp8_device(config, device)
    if world > 1 and not dist.is_initialized():
        backend = backend_for(device, config.parallel.backend)
        dist.init_process_group(backend, rank=rank, world_size=world,
                                timeout=timedelta(seconds=config.parallel.timeout_s),
                                device_id=device if device.type == "cuda" else None)
    set_cpu_threads(config.training.cpu_threads, int(os.environ.get("LOCAL_WORLD_SIZE", world)),
                    say=local_rank == 0)
    return Runtime(config, device, build_groups(config, world))


def check_fp8_device(config: Config, device: torch.device) -> None:
    """Refuse ``training.fp8`` on a GPU without float8 tensor cores (below sm89), before any
    group is made: the emulation would run there, slower than the model's own dtype, without
    a word. CPUs (the emulation is the point) and fp64 runs (exactness tests) pass."""
    fp8 = config.training.fp8
    if (fp8 != "off" and device.type == "cuda" and config.training.precision != "fp64"
            and not fp8_gemm_supported(device)):
        raise RuntimeError(f"training.fp8='{fp8}' needs float8 tensor cores (CUDA compute "
                           f"capability >= 8.9: Ada, Hopper, Blackwell); {device} has none, "
                           "and emulating float8 there is slower than bf16. Set "
                           "training.fp8='off'.")


def build_groups(config: Config, world: int) -> ProcessGroups:
    """Every process group of ``config``'s layout on ``world`` ranks (a validated config;
    torch.distributed initialised when world > 1): the dense and expert views, the tied
    embedding's group, hybrid sharding's shard / replicate groups."""
    dims = ParallelDims.from_config(config.parallel, world)
    return ProcessGroups.build(dims, config.parallel.timeout_s,
                               tied_embeddings=tied_across_stages(
                                   config.model.tie_embeddings, config.parallel.schedule),
                               experts=config.model.moe,
                               zero_shard_size=config.parallel.zero_shard_size,
                               cp_a2a_size=config.parallel.cp_a2a_size)


def cpu_threads(configured: int | None, omp: str | None, cores: int, local_ranks: int,
                load: float) -> int:
    """Intra-op CPU threads of one rank: ``training.cpu_threads`` when set; else
    ``OMP_NUM_THREADS`` (``omp``) when set (torchrun sets 1 for several ranks a node); else this
    rank's share of the cores that the machine's load leaves free,
    ``round((cores - load) / local_ranks)`` clipped to [1, ``cores // local_ranks``], ``load``
    the 1-minute load average. An idle machine gets every core; a busy one fewer threads:
    an OpenMP thread whose core another process holds stalls its team at every parallel
    region, and on a 2-core machine at load ~15 one rank with 2 threads ran at 21 tokens/s
    where 1 thread gave 3,966."""
    if configured is not None:
        return configured
    first = (omp or "").split(",")[0].strip()
    if first.isdigit() and int(first) >= 1:
        return int(first)
    ranks = max(1, local_ranks)
    share = int((cores - load) / ranks + 0.5)
    return max(1, min(cores // ranks, share))


def set_cpu_threads(configured: int | None, local_ranks: int, say: bool) -> int:
    """Set this rank's intra-op threads (:func:`cpu_threads` of this machine's cores and load)
    and, when ``say``, warn if this node's ranks x threads exceed its cores. Returns the
    thread count."""
    cores = _cores()
    threads = cpu_threads(configured, os.environ.get("OMP_NUM_THREADS"), cores, local_ranks,
                          _load())
    torch.set_num_threads(threads)
    if say and local_ranks * threads > cores:
        print(oversubscribed(local_ranks, threads, cores), file=sys.stderr, flush=True)
    return threads


def oversubscribed(local_ranks: int, threads: int, cores: int) -> str:
    """The warning of a node whose ranks x threads exceed its cores."""
    fix = (f"--nproc <= {cores}" if local_ranks > cores else
           f"--training.cpu_threads={max(1, cores // local_ranks)}")
    return (f"colonnade: warning: {local_ranks} rank(s) x {threads} CPU thread(s) = "
            f"{local_ranks * threads} threads on {cores} cores: they take turns on the cores, "
            f"so every step is slower than it would be with fewer; use {fix} unless the "
            "layout itself is what you are testing.")


def _cores() -> int:
    """CPU cores this process may run on (its affinity mask where the OS has one)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def _load() -> float:
    """The machine's 1-minute load average (runnable processes; 0 where the OS has none)."""
    return os.getloadavg()[0] if hasattr(os, "getloadavg") else 0.0


@dataclass
class Data:
    """Train and valid sample sets (valid None with data.valid_fraction=0: no evaluation), the
    dp-aware sampler and the tokenizer path."""

    train: WindowDataset | BlendedDataset
    valid: WindowDataset | None
    sampler: BatchSampler
    tokenizer: Path
    vocab_size: int


def prepare_data(config: Config, log: bool = True, say_reuse: bool = True) -> Path:
    """Tokenize the input (or the built-in corpus) once; returns the prepared directory.
    ``log``: print what is done (and a progress bar); ``say_reuse`` False leaves out the line
    of a build found and reused (one the launcher has just announced)."""
    cfg = config.data
    out = Path(cfg.prepared_dir)
    say: Callable[[str], None] = print if log else (lambda _m: None)
    if not say_reuse:
        say = _without_reuse(say)
    replaced = check_prepare_target(config)  # never over another dataset unless data.overwrite
    if replaced and log:
        print(f"prepare: data.overwrite=true: rebuilding {out}, which holds a dataset prepared "
              f"{'; and '.join(replaced)}")
    vocab = prepare_vocab(config)
    if cfg.format == "sft":  # prompt/response records + a loss mask (data/sft.py)
        from colonnade.data.sft import prepare_sft

        prepare_sft(cfg.input or "", out, vocab, Path(cfg.tokenizer) if cfg.tokenizer else None,
                    prompt_key=cfg.prompt_key, response_key=cfg.response_key,
                    errors=cfg.errors,  # type: ignore[arg-type]
                    progress=log, log=say)
        return out
    if cfg.format != "text":
        raise DataError(f"data.format='{cfg.format}' is unknown; use one of "
                        f"{', '.join(DATA_FORMATS)}")
    prepare(cfg.input or None, out, vocab, Path(cfg.tokenizer) if cfg.tokenizer else None,
            text_key=cfg.text_key, errors=cfg.errors,  # type: ignore[arg-type]
            max_bytes=cfg.max_corpus_bytes, num_workers=cfg.num_workers,
            progress=log, log=say)
    return out


def _without_reuse(say: Callable[[str], None]) -> Callable[[str], None]:
    """``say`` without the line `prepare` logs when it reuses a build (:data:`REUSE_LINE`)."""
    return lambda line: None if line.startswith(REUSE_LINE) else say(line)


def build_data(config: Config, groups: ProcessGroups, replacing: bool = False) -> Data:
    """Datasets and sampler. Data is prepared only when :func:`data_plan` says so
    (:func:`prepare_once`); otherwise the prepared dir is used as it is. ``replacing``: this
    rank replaces a dead one in a running job (in-process restart), whose data is prepared:
    it reuses the build without waiting for rank 0 (which is training, not preparing)."""
    plan = data_plan(config)
    if plan.action == "prepare" and replacing:
        prepare_data(config, log=False)
    elif plan.action == "prepare":
        prepare_once(config, groups)
    out = plan.prepared_dir
    seq, frac = config.training.seq_len, config.data.valid_fraction
    indexed = IndexedDataset(out / "data")
    valid = WindowDataset(indexed, seq, "valid", frac) if frac > 0 else None
    train: WindowDataset | BlendedDataset = WindowDataset(indexed, seq, "train", frac)
    if config.data.blend:
        entries = blend_entries(config.data.blend)
        parts = [WindowDataset(IndexedDataset(prefix), seq, "train", frac)
                 for _, prefix in entries]
        size = config.training.steps * int(config.training.global_batch_size or 1)
        train = BlendedDataset(parts, [w for w, _ in entries], size, config.training.seed)
    tr = config.training
    # by dp index, not dp x cp: the cp ranks of one dp index read the same samples (each
    # model chunk takes its own zigzag rows of them)
    sampler = BatchSampler(len(train), int(tr.global_batch_size or 1), tr.micro_batch_size,
                           groups.dp.rank, groups.dp.size, tr.seed)
    check_vocab(config, DataPlan("use", out, out / "tokenizer.json"))  # as prepared
    vocab = _tokenizer_vocab(out / "tokenizer.json")
    return Data(train, valid, sampler, out / "tokenizer.json", vocab)


def prepare_once(config: Config, groups: ProcessGroups, poll_s: float = PREPARE_POLL_S) -> None:
    """Rank 0 prepares the data; every other rank waits for its word, then reuses its output.

    The wait is not a collective: preparing a large corpus takes longer than
    ``parallel.timeout_s``, which bounds collectives only. The others poll a key that rank 0
    sets on the job's store (the default group's: every rank of every node reaches it) to
    'ok', or to its error, which they re-raise as a :class:`DataError` naming rank 0. Under
    ``colonnade train --nproc N`` the launcher has already prepared before the ranks started
    and said so, and rank 0 only finds the build and reuses it, silently (a build it has to
    make is logged). A rank that then finds no build (a node without a shared file system)
    prepares its own copy, as before.
    """
    if groups.world.size == 1:
        prepare_data(config)
        return
    store = groups.world.pg.get_group_store()
    # the n-th preparation of this rank waits for rank 0's n-th (no shared counter to race on)
    n = store.add(f"colonnade/prepare/calls/rank{groups.rank}", 1)
    key = f"colonnade/prepare/{n}"
    if groups.rank == 0:
        try:
            prepare_data(config, say_reuse=False)
        except BaseException as err:
            store.set(key, f"{type(err).__name__}: {' '.join(str(err).split())}")
            raise
        store.set(key, "ok")
        return
    while not store.check([key]):
        time.sleep(poll_s)
    word = store.get(key).decode()
    if word != "ok":
        raise DataError(f"rank 0 failed to prepare data.input into data.prepared_dir="
                        f"'{config.data.prepared_dir}' ({word}); see rank 0's error")
    prepare_data(config, log=False)


def _tokenizer_vocab(path: Path) -> int:
    from colonnade.data import load_tokenizer

    return load_tokenizer(path).get_vocab_size()
