"""Clusters: what one device computes, holds and moves, and the collective-time model.

A :class:`Cluster` is spec-sheet numbers plus two achieved-efficiency constants: ``efficiency``,
the fraction of the peak memory bandwidth and the large-GEMM fraction of the peak matmul rate
that real kernels reach, and ``gemm_knee_balance``, which makes a GEMM's fraction fall with its
arithmetic intensity (:mod:`colonnade.analysis.efficiency`: eff(I) = efficiency I / (I + knee),
knee = gemm_knee_balance x the device's FLOP/byte balance).  They are fitted on one part of
the public record: the A100's ``efficiency`` alone on Narayanan et al. 2021 Table 1
(:func:`colonnade.analysis.fit.fit_efficiency`, minimax over the ten rows), the H100's two on
four rows of llm-foundry's H100 table (:func:`colonnade.analysis.fit.fit_gemm_curve`; the H200
takes them through its own spec sheet).  Every other published figure is held out
(:mod:`colonnade.analysis.holdout`; benchmarks/planner.py prints it).
Communication uses the spec link rates as they are, with no fitted factor.

Collective times (ring algorithms, n ranks, message of S bytes, link rate W, latency alpha):
    all-reduce      2 (n-1)/n S / W + 2 (n-1) alpha
    reduce-scatter  (n-1)/n S / W + (n-1) alpha      (all-gather the same)
    point-to-point  S / W + alpha
W is the per-device NVLink rate when the group sits inside one node.  A group spread over nodes
with k members per node runs k rings side by side, one per NIC, so W = k * (node IB rate / GPUs
per node), capped by NVLink.
"""

from __future__ import annotations

import dataclasses
import math
import os
import tomllib
from dataclasses import dataclass
from pathlib import Path

from colonnade.analysis.activations import KERNEL_PATHS

GIB = 2**30


@dataclass(frozen=True, kw_only=True)
class Cluster:
    """One homogeneous cluster: devices, nodes and links."""

    name: str
    """Preset name (or file stem)."""
    device: str
    """Device model in words."""
    peak_tflops: float
    """Dense bf16/fp16 peak TFLOP/s of one device."""
    peak_tflops_fp32: float
    """Dense fp32 peak TFLOP/s (no TF32) of one device; used for fp32/fp64 runs."""
    memory_gib: float
    """Device memory in GiB."""
    hbm_gbps: float
    """Peak device memory bandwidth in GB/s (elementwise kernels are bound by it)."""
    gpus_per_node: int
    """Devices per node."""
    intra_node_gbps: float
    """Per-device, per-direction bandwidth inside a node in GB/s (NVLink: 600 GB/s total ->
    300 per direction on A100)."""
    inter_node_gbps: float
    """Per-node, per-direction network bandwidth in GB/s (8 x 200 Gb/s HDR = 200 GB/s)."""
    intra_latency_us: float = 5.0
    """Latency of one message step inside a node in microseconds."""
    inter_latency_us: float = 10.0
    """Latency of one message step across nodes in microseconds."""
    p2p_latency_us: float | None = None
    """Latency of one point-to-point message inside a node when it differs from the collective
    step latency (gloo on CPU: send/recv ~0.1 ms, an all-reduce ~1 ms); None: intra_latency_us."""
    p2p_gbps: float | None = None
    """Point-to-point bandwidth inside a node when it differs; None: intra_node_gbps."""
    all_gather_latency_us: float | None = None
    """Per-step latency of an all-gather when it differs from ``intra_latency_us`` (gloo's
    all-gather is cheaper, its reduce-scatter dearer, than half an all-reduce); None: same."""
    reduce_scatter_latency_us: float | None = None
    """Per-step latency of a reduce-scatter when it differs; None: ``intra_latency_us``."""
    efficiency: float = 0.6
    """Achieved fraction of peak memory bandwidth, and of peak FLOP/s by GEMMs of unbounded
    arithmetic intensity (the asymptote of the GEMM curve; every GEMM's when
    ``gemm_knee_balance`` is 0)."""
    gemm_knee_balance: float = 0.0
    """The GEMM curve's knee in units of the device's balance (bf16 peak FLOP/s / HBM bytes/s):
    a GEMM of intensity I FLOP/byte reaches efficiency x I / (I + knee) of peak, knee =
    gemm_knee_balance x balance (:mod:`colonnade.analysis.efficiency`). 0: size-independent
    (CPUs, whose calibration measures the rate at the workload's own sizes)."""
    backward_ratio: float = 2.0
    """Backward / forward time of a decoder layer: 2 by FLOPs (each GEMM has two backward
    GEMMs); elementwise ops, attention kernels and host time move it (CPU calibration
    measures it: ~1.8 on this machine); it sets what full recomputation's extra forward costs."""
    split_backward_us: float = 0.0
    """Host time ZB-H1's split of a layer's backward into input (B) and weight (W) gradients
    adds per micro-batch (finding the graph's boundaries, one engine call each); hidden behind
    kernels on GPUs (0), ~1 ms on this CPU (calibration measures it)."""
    head_efficiency: float | None = None
    """CPU only: the same fraction for the output layer and its cross entropy, measured by
    calibration (one large GEMM and vocabulary-wide elementwise passes behave unlike a
    decoder layer's small ones on a CPU); None: ``efficiency``."""
    reserved_gib: float = 2.0
    """Memory the runtime keeps per device (CUDA context, workspaces, fragmentation)."""
    compute_units: float | None = None
    """CPU only: cores shared by all ranks on the node (ranks beyond it time-share); may be
    fractional on a shared machine (`calibrate.measure_cores`)."""
    step_overhead_s: float = 0.0
    """Fixed host overhead per step (Python, optimizer loop): ~0 on big GPUs."""
    op_overhead_us: float = 0.0
    """Host time per tensor operation (dispatch); matters for tiny models on CPU, hidden by
    asynchronous launches on GPUs (0 there)."""
    launch_us: float = 0.0
    """GPU only: host time to issue one tensor operation (Python, dispatcher, kernel launch).
    Kernels run asynchronously, so it costs nothing while they are longer than their launches;
    a step is at least its operations x ``launch_us`` (tiny models such as the demo are
    launch-bound: :func:`colonnade.analysis.timing.launch_floor_s`).  0: no floor (CPUs pay
    ``op_overhead_us`` on top instead)."""
    sync_skew_2: float = 0.0
    """Measured (``calibrate.measure_skew``): extra wall time, as a fraction of the compute
    between two blocking collectives, that 2 ranks lose waiting for the slower one (OS
    scheduling jitter, other processes); 0 on dedicated GPUs."""
    sync_skew_4: float = 0.0
    """The same for 4 ranks; :meth:`skew_fraction` interpolates in log2(ranks)."""
    kernels: str = "cuda"
    """Whose kernels run the layers, 'cuda' (GPUs) or 'cpu': the activation model's kernel path
    (:data:`colonnade.analysis.activations.KERNEL_PATHS`), which the planner takes from here."""

    def __post_init__(self) -> None:
        if self.kernels not in KERNEL_PATHS:
            raise ValueError(f"cluster '{self.name}': kernels='{self.kernels}' must be one of "
                             f"{', '.join(KERNEL_PATHS)}.")

    def head(self) -> Cluster:
        """The cluster as the output layer and cross entropy see it (``head_efficiency``)."""
        if self.head_efficiency is None:
            return self
        return dataclasses.replace(self, efficiency=self.head_efficiency)

    @property
    def memory_bytes(self) -> float:
        """Usable device memory in bytes (capacity minus the runtime reserve)."""
        return (self.memory_gib - self.reserved_gib) * GIB

    def peak_flops_per_s(self, precision: str) -> float:
        """Peak matmul FLOP/s of one device for ``precision`` (fp64: half the fp32 peak)."""
        peak = self.peak_tflops if precision in ("bf16", "fp16") else self.peak_tflops_fp32
        if precision == "fp64":
            peak /= 2
        return peak * 1e12

    def flops_per_s(self, precision: str) -> float:
        """Achieved matmul FLOP/s of one device for ``precision`` at the curve's asymptote
        (GEMM sizes: :func:`colonnade.analysis.efficiency.gemm_s`)."""
        return self.peak_flops_per_s(precision) * self.efficiency

    @property
    def gemm_knee(self) -> float:
        """Intensity (FLOP/byte) at which a GEMM reaches half of ``efficiency`` x peak:
        gemm_knee_balance x bf16 peak / HBM bandwidth; 0 without a curve."""
        return self.gemm_knee_balance * self.peak_tflops * 1e3 / self.hbm_gbps

    def bytes_per_s(self) -> float:
        """Achieved device memory bandwidth in bytes/s."""
        return self.hbm_gbps * 1e9 * self.efficiency

    def link(self, group: int, per_node: int) -> tuple[float, float]:
        """(bandwidth bytes/s, latency s) of a group of ``group`` ranks, ``per_node`` per node."""
        if group <= per_node:
            return self.intra_node_gbps * 1e9, self.intra_latency_us * 1e-6
        nic = self.inter_node_gbps / self.gpus_per_node
        bw = min(self.intra_node_gbps, max(1, per_node) * nic)
        return bw * 1e9, self.inter_latency_us * 1e-6

    def skew_fraction(self, ranks: int) -> float:
        """Waiting for the slowest of ``ranks`` ranks at each blocking collective, as a
        fraction of the compute between collectives: s2 + (s4 - s2)(log2 n - 1), >= 0."""
        if ranks <= 1:
            return 0.0
        f = self.sync_skew_2 + (self.sync_skew_4 - self.sync_skew_2) * (math.log2(ranks) - 1)
        return max(f, 0.0)

    def all_reduce_s(self, nbytes: float, group: int, per_node: int) -> float:
        """Ring all-reduce time of ``nbytes`` over ``group`` ranks."""
        if group <= 1 or nbytes <= 0:
            return 0.0
        bw, lat = self.link(group, per_node)
        return 2 * (group - 1) / group * nbytes / bw + 2 * (group - 1) * lat

    def gather_s(self, nbytes: float, group: int, per_node: int, kind: str = "") -> float:
        """Ring reduce-scatter or all-gather time (``nbytes`` is the full, unsharded size);
        ``kind`` 'all_gather' / 'reduce_scatter' picks that collective's own latency inside a
        node when the cluster has one."""
        if group <= 1 or nbytes <= 0:
            return 0.0
        bw, lat = self.link(group, per_node)
        own = {"all_gather": self.all_gather_latency_us,
               "reduce_scatter": self.reduce_scatter_latency_us}.get(kind)
        if own is not None and group <= per_node:
            lat = own * 1e-6
        return (group - 1) / group * nbytes / bw + (group - 1) * lat

    def p2p_s(self, nbytes: float, cross_node: bool) -> float:
        """One point-to-point transfer; across nodes each device uses its own NIC."""
        if nbytes <= 0:
            return 0.0
        if cross_node:
            bw = self.inter_node_gbps / self.gpus_per_node * 1e9
            return nbytes / bw + self.inter_latency_us * 1e-6
        bw = self.p2p_gbps if self.p2p_gbps is not None else self.intra_node_gbps
        lat = self.p2p_latency_us if self.p2p_latency_us is not None else self.intra_latency_us
        return nbytes / (bw * 1e9) + lat * 1e-6


# A100 efficiency: fitted by colonnade.analysis.fit.fit_efficiency on Narayanan et al. Table 1
# (minimax relative error over the ten rows); tests/analysis re-runs the fit and checks this value.
A100_EFFICIENCY = 0.70
# Eager PyTorch's per-operation host cost on a current server CPU (~10 us: dispatcher, autograd,
# launch); not fitted to a published figure: benchmarks/gpu_check.py's demo stage measures a
# launch-bound run.
GPU_LAUNCH_US = 10.0
# H100 GEMM curve: fitted by colonnade.analysis.fit.fit_gemm_curve on published.MPT_H100_FIT
# (llm-foundry's H100 BF16 table, 4 rows; minimax 5.4%, with the fused attention's backward
# at 2.5x its forward: timing.FLASH_BACKWARD_EXTRA), checked on the held-out rows of
# colonnade.analysis.holdout; tests/analysis re-runs the fit.  The knee is 0.45 x 295 = 133
# FLOP/byte on an H100 SXM.  The H200 (same compute die, 4.8 TB/s) takes the same two constants
# through its own balance (knee 93 FLOP/byte); colonnade's own H200 run is held out (-5%).
H100_EFFICIENCY = 0.546
H100_KNEE_BALANCE = 0.45

PRESETS: dict[str, Cluster] = {
    "a100-80gb": Cluster(
        name="a100-80gb", device="NVIDIA A100 80GB SXM (DGX A100)", peak_tflops=312.0,
        peak_tflops_fp32=19.5, memory_gib=80.0, hbm_gbps=2039.0, gpus_per_node=8,
        intra_node_gbps=300.0, inter_node_gbps=200.0, efficiency=A100_EFFICIENCY,
        launch_us=GPU_LAUNCH_US,
    ),
    "h100-sxm": Cluster(
        name="h100-sxm", device="NVIDIA H100 SXM 80GB (DGX H100)", peak_tflops=989.0,
        peak_tflops_fp32=67.0, memory_gib=80.0, hbm_gbps=3350.0, gpus_per_node=8,
        intra_node_gbps=450.0, inter_node_gbps=400.0, efficiency=H100_EFFICIENCY,
        gemm_knee_balance=H100_KNEE_BALANCE, launch_us=GPU_LAUNCH_US,
    ),
    "h200": Cluster(
        name="h200", device="NVIDIA H200 SXM 141GB (HGX H200)", peak_tflops=989.0,
        peak_tflops_fp32=67.0, memory_gib=140.0, hbm_gbps=4800.0, gpus_per_node=8,
        intra_node_gbps=450.0, inter_node_gbps=400.0, efficiency=H100_EFFICIENCY,
        gemm_knee_balance=H100_KNEE_BALANCE, launch_us=GPU_LAUNCH_US,
    ),
    # Rough defaults for this kind of machine; `colonnade plan --calibrate` measures the real ones
    # (configs/clusters/cpu-local.toml holds the last measurement and takes precedence).
    "cpu-local": Cluster(
        name="cpu-local", device="this machine's CPU (gloo over loopback)", peak_tflops=0.05,
        peak_tflops_fp32=0.05, memory_gib=16.0, hbm_gbps=5.0, gpus_per_node=8,
        intra_node_gbps=2.0, inter_node_gbps=2.0, intra_latency_us=100.0,
        inter_latency_us=100.0, efficiency=1.0, reserved_gib=0.5,
        compute_units=os.cpu_count() or 1, step_overhead_s=0.005, op_overhead_us=10.0,
        kernels="cpu",
    ),
}
ALIASES = {"dgx-a100": "a100-80gb", "a100": "a100-80gb", "dgx-h100": "h100-sxm",
           "h100": "h100-sxm", "cpu": "cpu-local"}


def _clusters_dir() -> Path:
    return Path(__file__).resolve().parents[2] / "configs" / "clusters"


def cluster_from_toml(path: str | Path) -> Cluster:
    """Read a cluster file: a ``[cluster]`` table (or top-level keys) of Cluster fields.

    A ``base = "a100-80gb"`` key starts from that preset and overrides only the given fields.
    """
    path = Path(path)
    try:
        data = tomllib.loads(path.read_text())
    except (OSError, tomllib.TOMLDecodeError) as err:
        raise ValueError(f"cluster file '{path}' cannot be read: {err}") from err
    data = data.get("cluster", data)
    base_name = data.pop("base", None)
    names = {f.name for f in dataclasses.fields(Cluster)}
    unknown = sorted(set(data) - names)
    if unknown:
        raise ValueError(f"cluster file '{path}': unknown field(s) {unknown}; valid: "
                         f"{sorted(names)}")
    if base_name is not None:
        return dataclasses.replace(get_cluster(str(base_name)), **data)
    missing = sorted(f.name for f in dataclasses.fields(Cluster)
                     if f.default is dataclasses.MISSING and f.name not in data)
    if missing:
        raise ValueError(f"cluster file '{path}' lacks {missing} (or give base = 'a100-80gb').")
    return Cluster(**data)


def get_cluster(name: str) -> Cluster:
    """A preset by name (or alias), a file in configs/clusters/, or a path to a TOML file."""
    key = ALIASES.get(name.lower(), name.lower())
    stored = _clusters_dir() / f"{key}.toml"
    if key == "cpu-local" and stored.exists():
        return cluster_from_toml(stored)
    if key in PRESETS:
        return PRESETS[key]
    if stored.exists():
        return cluster_from_toml(stored)
    if Path(name).suffix == ".toml":
        if not Path(name).exists():
            raise ValueError(f"cluster file '{name}' does not exist.")
        return cluster_from_toml(name)
    raise ValueError(f"unknown cluster '{name}'; use one of {sorted(PRESETS)} "
                     f"(aliases {sorted(ALIASES)}) or a .toml file with a [cluster] table.")


def cluster_to_toml(cluster: Cluster) -> str:
    """The cluster as a ``[cluster]`` TOML table."""
    lines = ["[cluster]"]
    for f in dataclasses.fields(Cluster):
        value = getattr(cluster, f.name)
        if value is None:
            continue
        if isinstance(value, str):
            lines.append(f'{f.name} = "{value}"')
        else:
            lines.append(f"{f.name} = {value!r}")
    return "\n".join(lines) + "\n"
