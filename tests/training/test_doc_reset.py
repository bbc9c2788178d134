"""Document-boundary reset (data.reset_position_ids / data.reset_attention_mask).

Independent check: with both resets on, the logits of a packed sample equal those of running
each of its documents alone (positions from 0, nothing else in context); either reset alone
is not enough. The layouts' parity is in tests/pipeline/test_parity.py (test_document_reset).
"""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
import torch

from colonnade.config.sections import Config, DataConfig, ModelConfig, TrainingConfig
from colonnade.config.validate import resolve, validate
from colonnade.data import prepare
from colonnade.models.blocks import DocReset, doc_context
from colonnade.models.build import build_reference
from colonnade.parallel.groups import ProcessGroups

VOCAB, SEQ, EOD = 64, 16, 7


def _config(arch: str, data: DataConfig | None = None, vocab: int = VOCAB) -> Config:
    model = ModelConfig(arch=arch, num_layers=2, hidden_size=32, num_heads=4, vocab_size=vocab,
                        max_seq_len=SEQ, tie_embeddings=arch == "gpt2", bias=arch == "gpt2")
    tr = TrainingConfig(steps=2, seq_len=SEQ, micro_batch_size=2, microbatches=1,
                        precision="fp64", eval_interval=0)
    return validate(resolve(Config(model=model, training=tr, data=data or DataConfig()), 1), 1)


def test_doc_context_positions_and_mask() -> None:
    tokens = torch.tensor([[1, EOD, 2, 3, EOD, 4]])
    ctx = doc_context(tokens, DocReset(EOD))
    assert ctx.positions is not None and ctx.mask is not None
    assert ctx.positions.tolist() == [[0, 1, 0, 1, 2, 0]]
    allowed = ctx.mask[0, 0].int().tolist()
    assert allowed[1] == [1, 1, 0, 0, 0, 0]  # EOD belongs to the document it ends
    assert allowed[4] == [0, 0, 1, 1, 1, 0]
    assert allowed[5] == [0, 0, 0, 0, 0, 1]


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
@torch.no_grad()
def test_packed_documents_equal_separate_runs(arch: str) -> None:
    model = build_reference(_config(arch), torch.float64).eval()
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(8, VOCAB, (2, SEQ), generator=gen)
    ends = [[4, 10], [7]]  # row 0: documents [0, 5), [5, 11), [11, 16); row 1: [0, 8), [8, 16)
    for row, cuts in enumerate(ends):
        tokens[row, cuts] = EOD
    model.doc_reset = DocReset(EOD)
    packed = model(tokens)[..., :VOCAB]  # [s, b, V]
    model.doc_reset = None
    plain = model(tokens)[..., :VOCAB]
    for row, cuts in enumerate(ends):
        bounds = [0, *[c + 1 for c in cuts], SEQ]
        for a, e in itertools.pairwise(bounds):
            alone = model(tokens[row:row + 1, a:e])[:, 0, :VOCAB]  # [e - a, V]
            err = float((packed[a:e, row] - alone).abs().max())
            assert err < 1e-12, (row, a, e, err)
            if a > 0:  # without the reset, context leaks across the EOD
                assert float((plain[a:e, row] - alone).abs().max()) > 1e-4
    alone = model(tokens[0:1, 5:11])[:, 0, :VOCAB]
    for positions, attention in ((True, False), (False, True)):
        model.doc_reset = DocReset(EOD, positions=positions, attention=attention)
        err = float((model(tokens)[5:11, 0, :VOCAB] - alone).abs().max())
        if arch == "llama" and attention:  # RoPE is relative: the mask alone is enough
            assert err < 1e-12
        else:  # context leaks, or learned positions are offset
            assert err > 1e-4


def test_trainer_turns_reset_on_from_the_config(tmp_path: Path) -> None:
    """data.reset_* reach every chunk with the EOD id of the run's tokenizer."""
    from colonnade.training.loop import Trainer
    from colonnade.training.setup import Runtime, build_data

    src = tmp_path / "docs.jsonl"
    src.write_text("".join(f'{{"text": "document number {i} says hello"}}\n' for i in range(80)))
    res = prepare(src, tmp_path / "prep", 300, progress=False, log=lambda _m: None)
    data = DataConfig(prepared_dir=str(tmp_path / "prep"), reset_position_ids=True,
                      reset_attention_mask=True, valid_fraction=0.1)
    cfg = _config("gpt2", data, vocab=300)
    groups = ProcessGroups.single()
    trainer = Trainer(Runtime(cfg, torch.device("cpu"), groups), build_data(cfg, groups))
    assert [c.doc_reset for c in trainer.chunks] == [DocReset(res.eod_id, True, True)]
    batches = trainer.next_batches()
    assert int((batches[0][0] == res.eod_id).sum()) > 0  # packed windows hold boundaries
    loss = trainer.train_step(batches)["loss"]
    assert 4.0 < loss < 7.0  # ~log(300) at initialisation
