"""transfer.PinnedRing: small host -> device copies staged in one pinned arena, each piece reused only
once the copy that read it has run. The GPU path runs in tests/gpu; here the arena is plain memory and
the events are fakes whose completion the test controls."""

import pytest
import torch

from pageflash.transfer import PinnedRing


class FakeEvent:
    def __init__(self, log):
        self.done = False
        self.log = log

    def query(self):
        return self.done

    def synchronize(self):
        self.log.append("sync")
        self.done = True


class Ring(PinnedRing):
    def __init__(self, capacity):
        super().__init__(capacity)
        self.events, self.log = [], []

    def _allocate(self):
        return torch.zeros(self.capacity, dtype=torch.uint8)

    def _record(self, device):
        ev = FakeEvent(self.log)
        self.events.append(ev)
        return ev


def test_pieces_are_copied_and_reused_only_after_their_copies_ran():
    ring = Ring(1024)
    srcs = [torch.arange(i, i + 25, dtype=torch.int32) for i in range(40)]  # 100 B -> 128 B pieces
    dsts = [torch.empty(25, dtype=torch.int32) for _ in srcs]
    for i in range(8):  # one lap: 8 x 128 B, nothing waits
        ring.copy(dsts[i], srcs[i])
    assert ring.log == [] and ring.waits == 0
    ring.copy(dsts[8], srcs[8])  # wraps onto piece 0, whose copy has not run: waits for it
    assert ring.log == ["sync"] and ring.waits == 1
    for ev in ring.events:  # every copy so far ran: nothing more to wait for
        ev.done = True
    for i in range(9, 40):
        ring.copy(dsts[i], srcs[i])
        ring.events[-1].done = True
    assert ring.waits == 1 and len(ring._pending) <= 1
    for d, s in zip(dsts, srcs):
        assert torch.equal(d, s)


def test_a_piece_that_does_not_fit_before_the_end_starts_the_next_lap():
    ring = Ring(1024)
    a = torch.ones(200, dtype=torch.uint8)  # 256 B pieces at 0, 256, 512
    for _ in range(3):
        ring.copy(torch.empty(200, dtype=torch.uint8), a)
    assert ring.fits(128) and not ring.fits(129)  # (what _staged sends here: up to capacity / 8)
    c = torch.full((60,), 3, dtype=torch.int32)  # 240 B -> 256 B: fits at 768
    out = torch.empty(60, dtype=torch.int32)
    ring.copy(out, c)
    assert torch.equal(out, c) and ring.waits == 0
    # the next piece (256 B) wraps to 0 and waits for the first piece only; the pending ones after it stay
    ring.copy(torch.empty(200, dtype=torch.uint8), a)
    assert ring.waits == 1 and len(ring._pending) == 4


@pytest.mark.parametrize("dtype", [torch.bool, torch.int64, torch.float32, torch.bfloat16])
def test_dtypes_and_shapes_survive_the_arena(dtype):
    ring = Ring(1 << 16)
    src = (torch.arange(48).reshape(4, 12) % 3).to(dtype)
    dst = torch.empty(4, 12, dtype=dtype)
    ring.copy(dst, src)
    assert torch.equal(dst, src)
