"""The one module that talks to accelerators (``torch.cuda``). Everything else asks here."""

from __future__ import annotations

import ctypes
import ctypes.util
import functools

import torch

PEAK_TFLOPS: dict[str, tuple[float, float, float]] = {
    "H200": (989.0, 494.7, 67.0), "H100 PCIe": (756.0, 378.0, 51.2),
    "H100": (989.0, 494.7, 67.0), "A100": (312.0, 156.0, 19.5),
    "L40S": (362.1, 183.0, 91.6), "A10": (125.0, 62.5, 31.2), "V100": (125.0, 15.7, 15.7),
}
"""Dense peak TFLOP/s (16-bit tensor core, TF32 tensor core, IEEE fp32) of common
accelerators from the vendors' data sheets (sparsity excluded), by substring of the device
name, first match wins (so "H100 PCIe" before "H100", "A100" before "A10"). V100 has no TF32:
its fp32 matmuls run at the fp32 peak either way."""


def pick_device(choice: str = "auto", local_rank: int = 0) -> torch.device:
    """'auto' -> cuda:local_rank when a GPU exists, else cpu."""
    if choice == "cpu" or (choice == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise RuntimeError("training.device='cuda' but no GPU is visible; use 'cpu' or 'auto'")
    torch.cuda.set_device(local_rank % torch.cuda.device_count())
    return torch.device("cuda", local_rank % torch.cuda.device_count())


def backend_for(device: torch.device, choice: str = "auto") -> str:
    """torch.distributed backend: nccl for GPUs, gloo for CPUs, unless chosen explicitly."""
    if choice != "auto":
        return choice
    return "nccl" if device.type == "cuda" else "gloo"


def synchronize(device: torch.device) -> None:
    """Wait for queued kernels (a no-op on CPU) so wall-clock timings are honest."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def begin_graph_step(device: torch.device) -> None:
    """``training.cuda_graphs``: tell torch.compile's CUDA graph trees that a new training step
    begins, so the static outputs of the last step's replays may be overwritten (a no-op off
    CUDA, where nothing is captured)."""
    if device.type == "cuda":
        torch.compiler.cudagraph_mark_step_begin()


class DeviceEvent:
    """A timing event recorded on the current CUDA stream when made: it completes when the GPU
    has run everything queued on that stream before it. :mod:`colonnade.parallel.comm` times
    NCCL operations with these (there ``wait()`` only orders streams)."""

    def __init__(self) -> None:
        self._event = torch.cuda.Event(enable_timing=True)
        self._event.record()

    def done(self) -> bool:
        """Whether the GPU has reached the event (never blocks)."""
        return bool(self._event.query())

    def wait(self) -> None:
        """Block the host until the GPU has reached the event."""
        self._event.synchronize()

    def seconds_since(self, earlier: DeviceEvent) -> float:
        """GPU seconds from ``earlier`` to this event (both reached)."""
        return float(earlier._event.elapsed_time(self._event)) / 1e3


def has_gpu() -> bool:
    """True when a CUDA device is visible."""
    return torch.cuda.is_available()


FP8_MIN_CAPABILITY = (8, 9)
"""CUDA compute capability with float8 tensor cores (Ada sm89, Hopper sm90, Blackwell)."""


@functools.cache
def _capability(index: int) -> tuple[int, int]:
    """Compute capability of CUDA device ``index`` (asked once per device)."""
    major, minor = torch.cuda.get_device_capability(index)
    return int(major), int(minor)


def fp8_gemm_supported(device: torch.device) -> bool:
    """Whether ``device`` runs float8 GEMMs (``torch._scaled_mm``) on tensor cores: a CUDA
    device of compute capability >= 8.9. False on older GPUs and on CPU, where ``_scaled_mm``
    runs but was slower than the emulation's fp32 matmul (1024^3, one thread: 0.15 s vs
    0.11 s)."""
    if device.type != "cuda":
        return False
    index = device.index if device.index is not None else torch.cuda.current_device()
    return _capability(index) >= FP8_MIN_CAPABILITY


def memory_stats(device: torch.device) -> dict[str, float]:
    """Allocated / peak memory in GiB (GPU) or the process's max RSS in GiB (CPU)."""
    if device.type == "cuda":
        return {
            "mem_alloc_gib": torch.cuda.memory_allocated(device) / 2**30,
            "mem_peak_gib": torch.cuda.max_memory_allocated(device) / 2**30,
        }
    import resource

    rss_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return {"mem_peak_gib": rss_kib / 2**20}


def get_rng_state(device: torch.device) -> torch.Tensor:
    """The default generator state of ``device``."""
    if device.type == "cuda":
        return torch.cuda.get_rng_state(device)
    return torch.get_rng_state()


def set_rng_state(state: torch.Tensor, device: torch.device) -> None:
    """Restore the default generator state of ``device``."""
    if device.type == "cuda":
        torch.cuda.set_rng_state(state, device)
    else:
        torch.set_rng_state(state)


def apply_tf32(device: torch.device, enabled: bool) -> None:
    """``training.tf32``: on a CUDA device let fp32 matmuls (cuBLAS) and convolutions (cuDNN)
    use TF32 tensor cores (``fp32_precision = "tf32"``) or keep IEEE fp32 (``"ieee"``).
    Process-wide PyTorch settings; nothing is changed for a CPU device."""
    if device.type != "cuda":
        return
    precision = "tf32" if enabled else "ieee"
    torch.backends.cuda.matmul.fp32_precision = precision
    torch.backends.cudnn.conv.fp32_precision = precision


def tf32_enabled() -> bool:
    """Whether fp32 matmuls on CUDA run on TF32 now (the matmul setting, or the global
    ``torch.backends.fp32_precision`` it inherits when it is ``"none"``)."""
    precision = torch.backends.cuda.matmul.fp32_precision
    if precision == "none":
        precision = torch.backends.fp32_precision
    return precision == "tf32"


def peak_tflops(device: torch.device, dtype: torch.dtype, configured: float | None,
                tf32: bool | None = None) -> float | None:
    """Peak TFLOP/s for MFU: the configured value or the GPU table; None where it is unknown.

    From the table (:data:`PEAK_TFLOPS`): bf16/fp16 the tensor-core peak; fp32 the TF32 peak
    when TF32 is on (``tf32``; None reads the current setting, :func:`tf32_enabled`, which
    :func:`apply_tf32` set from ``training.tf32``), else the IEEE fp32 peak; fp64 unknown.
    A CPU has no peak worth dividing by: a matmul measured at start-up on cores shared by
    several ranks (and other jobs) once reported MFU above 100%, so MFU is then n/a unless
    ``logging.peak_tflops`` gives the peak.
    """
    if configured:
        return configured
    if device.type != "cuda" or dtype not in (torch.bfloat16, torch.float16, torch.float32):
        return None
    name = torch.cuda.get_device_name(device)
    for key, (half, tf32_peak, fp32_peak) in PEAK_TFLOPS.items():
        if key in name:
            if dtype != torch.float32:
                return half
            return tf32_peak if (tf32_enabled() if tf32 is None else tf32) else fp32_peak
    return None


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on ``device`` without blocking the host: on CUDA it is page-locked first
    and copied non-blocking (a pageable ``.to(device)`` synchronises the stream: a host stall
    per batch tensor); PyTorch's pinned-memory cache keeps the page-locked copy until the
    transfer that reads it has completed. Elsewhere a plain ``.to``."""
    if device.type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


def pinned_empty(shape: tuple[int, ...], dtype: torch.dtype,
                 device: torch.device | None = None) -> torch.Tensor:
    """An uninitialised page-locked host tensor (the target of asynchronous device-to-host
    copies); ordinary host memory where no GPU is visible. ``device``: the GPU whose context
    pins it, set for the calling thread (a background thread has no current device; left
    unset, CUDA would make a context on GPU 0, as the DataLoader's pinning thread avoids)."""
    if device is not None and device.type == "cuda":
        torch.cuda.set_device(device)  # per host thread
    return torch.empty(shape, dtype=dtype, pin_memory=torch.cuda.is_available())


def current_stream(device: torch.device) -> torch.cuda.Stream:
    """The stream the training thread queues its kernels on."""
    return torch.cuda.current_stream(device)


def new_stream(device: torch.device) -> torch.cuda.Stream:
    """A side stream on ``device`` (device-to-host copies that overlap the training stream)."""
    return torch.cuda.Stream(device)


def stream_wait_stream(waiter: torch.cuda.Stream, waited: torch.cuda.Stream) -> None:
    """Device-side order: work queued on ``waiter`` from now on starts after the work queued
    on ``waited`` so far. The host does not wait."""
    waiter.wait_stream(waited)


def copy_on_stream(dst: torch.Tensor, src: torch.Tensor, stream: torch.cuda.Stream) -> None:
    """Queue ``dst.copy_(src)`` (host ``dst``, pinned: truly asynchronous) on ``stream``; the
    caching allocator is told that ``src`` is in use there, so freeing it cannot hand its
    memory to another tensor before the copy has read it."""
    with torch.cuda.stream(stream):
        dst.copy_(src, non_blocking=True)
    src.record_stream(stream)


def record_event(stream: torch.cuda.Stream) -> torch.cuda.Event:
    """An event completing when the GPU has run the work queued on ``stream`` so far."""
    event = torch.cuda.Event()
    event.record(stream)
    return event


def stream_wait_event(stream: torch.cuda.Stream, event: torch.cuda.Event) -> None:
    """Device-side order: work queued on ``stream`` from now on waits for ``event``."""
    stream.wait_event(event)


def wait_event(event: torch.cuda.Event | None) -> None:
    """Block the calling thread until ``event`` completes (None: nothing to wait for)."""
    if event is not None:
        event.synchronize()


HOST_MMAP_THRESHOLD = 256 << 20
"""glibc M_MMAP_THRESHOLD set by :func:`keep_host_pages`: host allocations up to 256 MiB come
from the heap, not from a fresh mmap whose every page faults on first touch."""
HOST_TRIM_THRESHOLD = 1 << 30
"""glibc M_TRIM_THRESHOLD set by :func:`keep_host_pages`: up to 1 GiB of free memory at the
heap's top stays mapped for the next step instead of being returned to the OS."""
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameter numbers


@functools.cache
def keep_host_pages() -> bool:
    """Keep freed host memory mapped across training steps (glibc's malloc); returns whether
    the setting was applied (False off glibc, e.g. macOS or musl: nothing changes).

    A CPU step allocates and frees the same activation sizes every step. glibc returns a freed
    heap top larger than its trim threshold to the OS (and serves blocks above its mmap
    threshold by fresh mmaps), so the next step faults the same pages in again, zeroed by the
    kernel: measured on issue 19's gpt2-tiny (1 thread), ~6,000 page faults per step, ~10 ms of
    a 410 ms step; a plain loop that frees its gradients each step took ~4,000, as its freed
    gradients leave room for the next forward's activations, while Colonnade's persist in a
    flat buffer. Both thresholds fixed (which also turns off glibc's dynamic
    threshold) make those faults 0, as a caching allocator (jemalloc, tcmalloc) would; memory
    already at the step's peak stays mapped, no more. Process-wide, like
    ``torch.set_num_threads``; the trainer calls it on CPU, and it is applied once per
    process (cached).
    """
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    return bool(mallopt(_M_MMAP_THRESHOLD, HOST_MMAP_THRESHOLD)
                and mallopt(_M_TRIM_THRESHOLD, HOST_TRIM_THRESHOLD))
