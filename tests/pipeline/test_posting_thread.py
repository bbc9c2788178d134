"""Gloo's p2p groups are issued by a posting thread (``p2p._PostingThread``), so a compute never
waits while a send or receive is being issued: gloo can hold the caller of ``isend`` / ``irecv``
on its peer connection's lock while its I/O thread moves an earlier message.

A stand-in group whose ``p2p`` blocks until released shows that ``PipeComm.post`` returns
without issuing anything, that a receive's data is there once ``wait`` returns, that every
operation is issued by the posting thread in posting order, and that an error raised while
issuing reaches the compute thread at its next wait.
"""

from __future__ import annotations

import threading
from typing import Any

import pytest
import torch

from colonnade.pipeline.p2p import Message, Op, PipeComm

pytestmark = pytest.mark.timing  # races the OS (see conftest); `make flake-hunt`

SHAPE = (2, 3)


class _Done:
    def wait(self) -> None:
        pass

    def is_completed(self) -> bool:
        return True


BACKSTOP_S = 120.0
"""Only for a broken product: every wait below is for an event the test itself sets or that
the posting thread reaches without depending on time, so no loaded machine gets near it."""


class _BlockingGroup:
    """A gloo-like pp group (no coalescing): ``p2p`` blocks until ``release`` is set, then
    fills each receive buffer with 7 and records (name, issuing thread)."""

    coalesces = False
    ranks = [0, 1]

    def __init__(self, fail: bool = False) -> None:
        self.release = threading.Event()
        self.calls: list[tuple[str, str]] = []
        self.fail = fail

    def p2p(self, sends: list[Any], recvs: list[tuple[torch.Tensor, int]], *,
            name: str = "") -> _Done:
        assert self.release.wait(BACKSTOP_S)
        if self.fail:
            raise RuntimeError("peer closed the connection")
        self.calls.append((name, threading.current_thread().name))
        for buf, _ in recvs:
            buf.fill_(7.0)
        return _Done()


def _comm(group: _BlockingGroup) -> PipeComm:
    return PipeComm(group, 0, lambda k: SHAPE, torch.float32, torch.device("cpu"))  # type: ignore[arg-type]


def _group(k: int) -> tuple[Op, ...]:
    """Send activation k forward, receive gradient k back (1F1B's pairing on stage 0)."""
    return (Op("send", 1, Message("F", k, 0)), Op("recv", 1, Message("B", k, 0)))


def test_post_returns_before_the_group_is_issued() -> None:
    group = _BlockingGroup()
    comm = _comm(group)
    for k in range(2):
        comm.post(_group(k), [torch.ones(SHAPE)])
    assert group.calls == []  # both posted while the first issue is still blocked
    comm.reap()  # never blocks on a group not yet issued
    assert len(comm.pending) == 2
    group.release.set()
    for k in range(2):
        assert torch.equal(comm.wait(Message("B", k, 0)), torch.full(SHAPE, 7.0))
    comm.finish()
    assert group.calls == [("pp_send", "pp-p2p-post"), ("pp_recv_B", "pp-p2p-post")] * 2
    assert not comm.pending and not comm.stream.thread.is_alive()  # type: ignore[union-attr]


def test_an_error_while_issuing_reaches_the_compute_thread() -> None:
    group = _BlockingGroup(fail=True)
    comm = _comm(group)
    comm.post(_group(0), [torch.ones(SHAPE)])
    comm.post(_group(1), [torch.ones(SHAPE)])
    group.release.set()
    with pytest.raises(RuntimeError, match="peer closed the connection"):
        comm.wait(Message("B", 0, 0))
    with pytest.raises(RuntimeError, match="peer closed the connection"):
        comm.finish()  # the later group was never issued; finish reports the same error
    assert comm.stream is not None
    comm.stream.thread.join(BACKSTOP_S)  # finish() queued its end; it ends without more groups
    assert not comm.stream.thread.is_alive()  # ended, not left waiting for more groups
