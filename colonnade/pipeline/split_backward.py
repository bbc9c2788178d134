"""Zero-bubble backward split: input gradient now (B), weight gradients later (W).

For a chunk y = f(x; W) with output gradient dy, the backward pass computes
    B: dx = (df/dx)^T dy           (needed at once by the previous stage)
    W: dW = (df/dW)^T dy           (needed only by the optimizer, so it can wait).
Both walk the same autograd graph. B runs the engine from ``y`` to ``x`` only, with
``retain_graph``: the engine then executes exactly the nodes on paths from y to x and computes,
in each node, only the gradients leading to x (an ``mm`` node of ``x W^T`` computes dy W, not
dy^T x). A *boundary* node is a node on such a path with an edge into a *weight-only* subgraph
(one that reaches parameters but not x), e.g. that ``mm`` node, whose second edge leads through
``t`` to the AccumulateGrad of W. While B runs, a pre-hook on every boundary node stores the
gradients flowing into it (its grad_outputs, e.g. dy of the ``mm``). W re-enters the engine at
each boundary node (``GradientEdge``) with those stored gradients and only that boundary's
parameters as ``inputs``, so the engine computes just the weight side (dy^T x) and accumulates
into ``.grad`` through the ordinary AccumulateGrad nodes (parameter hooks still fire).

Summed over boundaries this is exactly the weight gradient of the unsplit backward: every path
from y to a parameter leaves the x-paths at exactly one (boundary, weight edge) pair, and the
gradient arriving there is the same in both. If some parameter is reachable from two boundaries
(a weight used twice inside one chunk), the per-boundary calls would each follow the other's
path; then W falls back to a second full pass ``backward(y, dy, inputs=params)`` (same result,
more compute); so it does with full recomputation (see ``backward_input``). Chunks without an
input that needs a gradient (the first virtual stage) have nothing to split: B does nothing
and W runs the whole backward.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.autograd.graph import GradientEdge, get_gradient_edge

Node = Any  # torch.autograd.graph.Node (C++ node objects have no common Python base type)


@dataclass
class Boundary:
    """A node on an x-path with weight-only children: where W re-enters the engine."""

    node: Node
    params: list[torch.nn.Parameter]
    grads: tuple[torch.Tensor | None, ...] | None = None
    """The node's grad_outputs captured during B."""


@dataclass
class PendingWeightGrad:
    """What W needs after B: the graph (kept alive by ``output``) and the captured gradients."""

    output: torch.Tensor
    grad_output: torch.Tensor | None
    params: list[torch.nn.Parameter]
    boundaries: list[Boundary] = field(default_factory=list)
    full_pass: bool = False
    """True: W runs ``backward(output, grad_output, inputs=params)`` (no usable boundaries)."""


def _children(node: Node) -> list[Node]:
    return [child for child, _ in node.next_functions if child is not None]


def _post_order(root: Node) -> tuple[list[Node], dict[Node, list[Node]]]:
    """Every node reachable from ``root``, children before parents (iterative DFS), and each
    node's children (read once: ``next_functions`` builds a new tuple on every access)."""
    kids = {root: _children(root)}
    order, stack = [], [(root, iter(kids[root]))]
    while stack:
        node, it = stack[-1]
        child = next(it, None)
        if child is None:
            stack.pop()
            order.append(node)
        elif child not in kids:
            kids[child] = _children(child)
            stack.append((child, iter(kids[child])))
    return order, kids


def grad_accumulators(params: Sequence[torch.nn.Parameter]) -> dict[Node, torch.nn.Parameter]:
    """Each trainable parameter's AccumulateGrad node -> the parameter. Holding the nodes keeps
    them alive, so later forwards reuse them and the mapping stays valid (one lookup per
    parameter, a view each: worth computing once per step rather than once per B)."""
    return {get_gradient_edge(p).node: p for p in params if p.requires_grad}


def find_boundaries(output: torch.Tensor, x: torch.Tensor, params: Sequence[torch.nn.Parameter],
                    accumulators: dict[Node, torch.nn.Parameter] | None = None
                    ) -> list[Boundary] | None:
    """Boundary nodes between the x-paths of ``output``'s graph and its weight-only subgraphs
    (``accumulators``: :func:`grad_accumulators` of ``params``, computed when not given).

    Returns None when the split is not exact per boundary (a parameter under two boundaries),
    in which case W must run a full second pass.
    """
    root = output.grad_fn
    x_node = get_gradient_edge(x).node
    if accumulators is None:
        accumulators = grad_accumulators(params)
    order, children = _post_order(root)
    reaches_x: dict[Node, bool] = {}
    below: dict[Node, set[int]] = {}  # indices of params reachable through non-x nodes
    index = {id(p): i for i, p in enumerate(params)}
    for node in order:  # children first
        kids = children[node]
        reaches_x[node] = node is x_node or any(reaches_x[c] for c in kids)
        mine: set[int] = set()
        if node in accumulators:
            mine.add(index[id(accumulators[node])])
        for c in kids:
            if not reaches_x[c]:
                mine |= below[c]
        below[node] = mine
    out: list[Boundary] = []
    owner: set[int] = set()
    for node in reversed(order):  # parents first: a deterministic order on every rank
        if not reaches_x[node] or not below[node] or node is x_node:
            continue
        if owner & below[node]:
            return None
        owner |= below[node]
        out.append(Boundary(node, [params[i] for i in sorted(below[node])]))
    return out


def backward_input(output: torch.Tensor, grad_output: torch.Tensor | None, x: torch.Tensor | None,
                   params: Sequence[torch.nn.Parameter], *, full_pass: bool = False,
                   accumulators: dict[Node, torch.nn.Parameter] | None = None
                   ) -> tuple[torch.Tensor | None, PendingWeightGrad]:
    """B: dx = (dy/dx)^T grad_output, keeping what W needs. Returns (dx or None, pending W).

    ``full_pass`` makes W one second pass instead of one engine call per boundary: needed with
    full activation recomputation, where every engine call that unpacks a checkpointed
    block's saved tensors recomputes the block (one recompute instead of one per boundary).
    """
    params = [p for p in params if p.requires_grad]
    pending = PendingWeightGrad(output, grad_output, params)
    if x is not None and output is x:  # a chunk without layers: dy passes straight through
        return grad_output, PendingWeightGrad(output, None, [])
    if x is None or output.grad_fn is None:
        pending.full_pass = True
        return None, pending
    boundaries = None if full_pass else find_boundaries(output, x, params, accumulators)
    if boundaries is None:
        pending.full_pass = True
        (dx,) = torch.autograd.grad(output, x, grad_output, retain_graph=True)
        return dx, pending
    handles = []
    for b in boundaries:
        def capture(grads: tuple[torch.Tensor | None, ...], b: Boundary = b) -> None:
            b.grads = grads
        handles.append(b.node.register_prehook(capture))
    try:
        (dx,) = torch.autograd.grad(output, x, grad_output, retain_graph=True)
    finally:
        for h in handles:
            h.remove()
    pending.boundaries = boundaries
    return dx, pending


def backward_weight(pending: PendingWeightGrad) -> None:
    """W: accumulate dW = (dy/dW)^T grad_output into every parameter's ``.grad``."""
    if pending.full_pass:
        if pending.output.grad_fn is not None and pending.params:
            torch.autograd.backward(pending.output, pending.grad_output, inputs=pending.params)
        return
    for b in pending.boundaries:
        if b.grads is None:
            raise RuntimeError("zero-bubble W: a boundary node did not run during B; the graph "
                               "changed between B and W")
        edges = [GradientEdge(b.node, k) for k, g in enumerate(b.grads) if g is not None]
        grads = [g for g in b.grads if g is not None]
        if edges:
            torch.autograd.backward(edges, grads, inputs=b.params)
        b.grads = None
    pending.boundaries = []
