"""Fuzz the parallel matrix: seeded draws, each refused by the validator or equal to its reference.

    colonnade bench fuzz --cases 300 --seed 7
    colonnade bench fuzz --seed 7 --case 41        # one case again

Every draw (architecture, MoE, tp/sp/pp/cp/dp/ep, ZeRO, recompute, precision, ...) is either
refused before launch, with the validator rules that refused it, or trained k steps on the rank
pool and compared with the single-process run of the same model and data (float64 1e-10; bf16
looser). Prints a table, writes benchmarks/results/fuzz.json, exits 1 on any mismatch, late
refusal or hang. The code is :mod:`colonnade.fuzz`; this script is its ``bench`` entry.
"""

from __future__ import annotations

import sys

from colonnade.fuzz.main import main

if __name__ == "__main__":
    sys.exit(main())
