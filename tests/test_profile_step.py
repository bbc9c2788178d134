"""benchmarks/profile_step.py's categories: the self time of Colonnade's communicating autograd
functions (a gloo collective's blocking wait happens inside them, with no op of its own) is
communication, forward and backward; every name it lists is such a function."""

from __future__ import annotations

import importlib

import torch

from tests.bench_import import load_benchmark

MODULES = ("colonnade.tensor_parallel.mappings", "colonnade.tensor_parallel.partition",
           "colonnade.parallel.all_to_all")


def test_communicating_functions_count_as_communication() -> None:
    ps = load_benchmark("profile_step.py", "bench_profile_step")
    for name in ("OpG", "OpFBackward", "OpGSeqBackward", "LinearReduceScatter",
                 "GatheredLinearsBackward", "OpAllToAll"):
        assert ps._leaf_category(name) == "communication", name
    assert ps._leaf_category("GeluTanhBackward") is None  # elementwise
    assert ps._leaf_category("VocabParallelCrossEntropy") == "loss"
    classes = {name: cls for mod in MODULES for name, cls in vars(importlib.import_module(mod))
               .items() if isinstance(cls, type) and issubclass(cls, torch.autograd.Function)}
    assert set(ps.COMM_FUNCTIONS) <= set(classes)
    assert {n for n in classes if n.startswith("Op")} <= set(ps.COMM_FUNCTIONS)
