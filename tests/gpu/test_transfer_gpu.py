"""transfer.copy_to / to_device on the GPU: small copies staged in the pinned ring, many laps of it, the
host writing the next piece while earlier copies are still queued behind slow GPU work."""

import torch

from pageflash import transfer


def test_ring_copies_land_intact_across_laps():
    ring = transfer._RING
    dev = torch.device("cuda")
    gen = torch.Generator().manual_seed(0)
    big = torch.randn(4096, 4096, device=dev)
    outs, wants = [], []
    for i in range(3000):  # ~7 laps of the 4 MB arena
        if i % 100 == 0:
            big = big @ big  # slow GPU work ahead of the copies: the ring must not overwrite queued pieces
            big /= big.norm()
        n = int(torch.randint(1, 1500, (1,), generator=gen))
        src = torch.randint(-2 ** 40, 2 ** 40, (n,), generator=gen, dtype=torch.int64)
        if i % 2:
            dst = torch.empty(n, dtype=torch.int64, device=dev)
            transfer.copy_to(dst, src)
        else:
            dst = transfer.to_device(src, dev)
        outs.append(dst)
        wants.append(src)
    torch.cuda.synchronize()
    assert all(torch.equal(o.cpu(), w) for o, w in zip(outs, wants))
    assert ring._offset > 4 * ring.capacity  # (the laps happened)
