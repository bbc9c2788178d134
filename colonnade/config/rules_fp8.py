"""The validator's float8 rules (one of :data:`colonnade.config.validate.RULES`):
training.fp8.

Every precision is accepted: bf16, fp16 and fp32 models run float8 GEMMs with outputs in
their dtype, and fp64 runs the emulation exactly (the parity tests' setting). Whether a GPU
has float8 tensor cores is not a property of the configuration: the trainer refuses a GPU
without them when it picks the device (:func:`colonnade.training.setup.init_runtime`), since
the emulation there would be silently slower than bf16.
"""

from __future__ import annotations

from colonnade.config.choices import FP8_RECIPES
from colonnade.config.sections import Config


def fp8_rules(c: Config, _: int | None) -> list[str]:
    """training.fp8 is a known recipe; not with the chunked sp overlap (tp_comm_chunks > 1),
    whose chunked GEMMs are not float8."""
    fp8, p, out = c.training.fp8, c.parallel, []
    if fp8 not in FP8_RECIPES:
        out.append(f"training.fp8='{fp8}' is unknown; use one of {', '.join(FP8_RECIPES)}.")
    elif fp8 != "off" and p.tp_comm_chunks > 1:
        out.append(f"training.fp8='{fp8}' does not go with parallel.tp_comm_chunks="
                   f"{p.tp_comm_chunks} (the chunked sp overlap's GEMMs are not float8); set "
                   "parallel.tp_comm_chunks=1 or training.fp8='off'.")
    return out
