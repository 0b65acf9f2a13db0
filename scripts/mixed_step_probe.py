"""H100 probe: one attention layer of a mixed step (240 decode sequences with 300-1500 keys, then a
1024-token prefill chunk over 512 cached keys), llama-3-8b heads, through TritonBackend.forward (store
+ attention) with the leading decodes through Flash-Decoding (mixed_decode) or all rows through the
paged kernel; bf16 and int8 / fp8 caches. Usage: PYTHONPATH=. python scripts/mixed_step_probe.py"""

import torch

from pageflash.bench.kernels import _bench
from pageflash.kernels.backend import TritonBackend
from pageflash.layers.attention import AttentionMetadata

HQ, HKV, D, PAGE = 32, 8, 128, 16


def step_metadata(specs, g: torch.Generator) -> tuple[AttentionMetadata, int]:
    """A step's metadata on CUDA for specs [(cached tokens, new tokens)] per sequence, the sequences'
    blocks shuffled over a pool of exactly their blocks; returns (meta, pool size in blocks)."""
    lens = [c + n for c, n in specs]
    nbs = [-(-s // PAGE) for s in lens]
    total = sum(nbs)
    bt = torch.zeros(len(specs), max(nbs), dtype=torch.int32)
    perm = torch.randperm(total, generator=g)
    o = 0
    slots = []
    for i, ((c, n), nb) in enumerate(zip(specs, nbs)):
        bt[i, :nb] = perm[o:o + nb].int()
        o += nb
        slots += [int(bt[i, p // PAGE]) * PAGE + p % PAGE for p in range(c, c + n)]
    qlens = [n for _, n in specs]
    meta = AttentionMetadata(
        torch.tensor([0] + torch.tensor(qlens).cumsum(0).tolist(), dtype=torch.int32, device="cuda"),
        torch.tensor(lens, dtype=torch.int32, device="cuda"), bt.cuda(),
        torch.tensor(slots, device="cuda"), qlens, lens, PAGE)
    return meta, total


def main() -> None:
    g = torch.Generator().manual_seed(0)
    for n_dec, chunk in ((240, 1024), (64, 2048), (16, 512)):
        specs = [(int(c), 1) for c in torch.randint(300, 1500, (n_dec,), generator=g)] + [(512, chunk)]
        meta, total = step_metadata(specs, g)
        t = meta.num_tokens
        q = torch.randn(t, HQ, D, device="cuda").to(torch.bfloat16)
        k = torch.randn(t, HKV, D, device="cuda").to(torch.bfloat16)
        v = torch.randn_like(k)
        row = []
        for name, code in (("bf16", torch.bfloat16), ("int8", torch.int8), ("fp8", torch.float8_e4m3fn)):
            kc = torch.zeros(total, PAGE, HKV, D, device="cuda", dtype=code)
            vc = torch.zeros_like(kc)
            sc = None if code == torch.bfloat16 else (torch.ones(total, HKV, PAGE, device="cuda"),
                                                      torch.ones(total, HKV, PAGE, device="cuda"))
            for mixed in (False, True):
                be = TritonBackend()
                be.mixed_decode = mixed
                plan = be.plan(meta)
                be.forward(q, k, v, kc, vc, plan, D**-0.5, kv_scales=sc)
                torch.cuda.synchronize()
                us = 1e3 * _bench(lambda: be.forward(q, k, v, kc, vc, plan, D**-0.5, kv_scales=sc))
                row.append(f"{name} {'split' if mixed else 'paged'} {us:.0f}")
        print(f"{n_dec} decodes + {chunk}-token chunk, us: " + ", ".join(row), flush=True)


if __name__ == "__main__":
    main()
