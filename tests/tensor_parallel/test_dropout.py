"""Dropout under tensor/sequence parallelism: masks obey the tracker's rule, results stay exact.

Every keep-mask is recorded on every rank and in the single-process model (step 0, both
micro-batches). The rule, checked site by site:
* tp-split regions differ across tp ranks: attention-probability masks (heads split) and,
  under sp, the residual/embedding masks (sequence split); concatenated in rank order along
  the split dim (heads: 1, sequence: 0) they are the single-process model's mask;
* replicated regions agree: without sp every tp rank holds the reference's whole residual mask.
Because the masks are layout independent, losses, gradients and parameters after 3 steps still
equal the single-process model's (relative error <= 1e-10).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from tests.tensor_parallel.harness import make_batches, parallel_run, tiny_config
from tests.tensor_parallel.test_parity import check_against_reference, reference

P = 0.1


def check_mask_rule(results: list[dict[str, Any]], ref_masks: dict[Any, torch.Tensor],
                    sp: bool, layers: int, microbatches: int) -> None:
    """Every site's masks: split regions differ and tile the reference; replicated agree."""
    assert len(ref_masks) == (1 + 3 * layers) * microbatches, sorted(ref_masks)
    for res in results:
        assert sorted(res["masks"]) == sorted(ref_masks), f"tp rank {res['tp_rank']}: sites"
    for key, full in ref_masks.items():
        site = key[0]
        kept = float(full.double().mean())
        assert 1 - 3 * P < kept < 1 - P / 3, f"{site}: kept fraction {kept:.3f}, p={P}"
        masks = [r["masks"][key] for r in sorted(results, key=lambda r: r["tp_rank"])]
        split_dim = 1 if site.endswith("attn_dropout") else (0 if sp else None)
        if split_dim is None:
            for r, mask in enumerate(masks):
                assert torch.equal(mask, full), f"{key}: replicated mask of tp rank {r} differs"
            continue
        assert torch.equal(torch.cat(masks, dim=split_dim), full), (
            f"{key}: tp ranks' masks do not tile the full mask along dim {split_dim}")
        for r in range(1, len(masks)):
            assert not torch.equal(masks[r], masks[0]), f"{key}: tp ranks 0 and {r} share a mask"


@pytest.mark.parametrize(("arch", "tp", "sp"), [
    pytest.param("llama", 2, True, id="llama-tp2-sp"),
    pytest.param("llama", 4, False, id="llama-tp4-nosp"),
    pytest.param("gpt2", 2, False, id="gpt2-tp2-nosp"),
    pytest.param("gpt2", 4, True, id="gpt2-tp4-sp"),
])
def test_dropout_masks_and_parity(run_ranks: Callable[..., list[Any]], arch: str, tp: int,
                                  sp: bool) -> None:
    config = tiny_config(arch, tp, sp, dropout=P)
    results = run_ranks(tp, parallel_run, config, make_batches(config), record_masks=True)
    ref = reference(arch, P)
    check_mask_rule(results, ref["masks"], sp, config.model.num_layers,
                    config.training.microbatches or 1)
    check_against_reference(results, ref)


def test_dropout_changes_the_loss() -> None:
    """The dropout runs above are not the dropout-free ones in disguise."""
    with_drop, without = reference("llama", P)["losses"], reference("llama", 0.0)["losses"]
    assert abs(with_drop[0][0] - without[0][0]) > 1e-3


def test_mask_rule_checker_catches_violations() -> None:
    """The checker itself fails on swapped shards and on a replicated mask that differs."""
    gen = torch.Generator().manual_seed(0)
    full_attn = torch.rand(2, 4, 6, 6, generator=gen) >= P  # [b, heads, s, s]
    full_res = torch.rand(6, 2, 8, generator=gen) >= P  # [s, b, h]
    sites = ["embedding.dropout", "layers.0.attn.attn_dropout", "layers.0.attn_out",
             "layers.0.mlp_out"]
    ref = {(s, 0, 0): (full_attn if s.endswith("attn_dropout") else full_res) for s in sites}

    def ranks(swap: bool, sp: bool) -> list[dict[str, Any]]:
        out = []
        for r in range(2):
            src = 1 - r if swap else r
            masks = {k: (v.chunk(2, dim=1)[src] if k[0].endswith("attn_dropout")
                         else v.chunk(2, dim=0)[src] if sp else v) for k, v in ref.items()}
            out.append({"tp_rank": r, "masks": masks})
        return out

    check_mask_rule(ranks(False, True), ref, True, 1, 1)
    check_mask_rule(ranks(False, False), ref, False, 1, 1)
    with pytest.raises(AssertionError, match="do not tile"):
        check_mask_rule(ranks(True, True), ref, True, 1, 1)
    bad = ranks(False, False)
    bad[1]["masks"][("layers.0.mlp_out", 0, 0)] = ~full_res
    with pytest.raises(AssertionError, match="replicated mask of tp rank 1 differs"):
        check_mask_rule(bad, ref, False, 1, 1)
