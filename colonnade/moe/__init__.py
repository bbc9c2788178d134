"""Mixture of experts: router and auxiliary losses, token dispatch, grouped experts, the layer.

Sits above parallel, tensor_parallel and context_parallel, below models (it never imports
models). The modules: :mod:`~colonnade.moe.router`, :mod:`~colonnade.moe.state`,
:mod:`~colonnade.moe.dispatch`, :mod:`~colonnade.moe.grouped_gemm`,
:mod:`~colonnade.moe.experts`, :mod:`~colonnade.moe.layer`.
"""
