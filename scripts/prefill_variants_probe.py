"""Probe: variants of the FlashAttention-2 forward's inner loop on the W-attn-prefill shapes (causal bf16),
against the package's kernel and SDPA (cuDNN, FLASH) in the same process.

Variants (one standalone copy of the forward for the batched causal case, HEAD_DIM == BLOCK_D):
- FUSE: the running max from the raw q.k maximum times the scale, and the exponent as one FMA
  (qk * scale - m) instead of a multiply, then a subtract, per score;
- TAU > 0: lazy rescaling. The accumulator and the running sum are rescaled only when some row's max
  grew by more than TAU (log2 units) in this tile (one block-wide reduction, a uniform branch);
  otherwise the old max stays the reference and p = exp2(s - m_old) <= 2^TAU;
- WS: `tl.range(..., warp_specialize=True)` (if this Triton accepts it on the GPU);
- tile configs.
Each variant's output is compared with the package kernel's (max |diff|) before it is timed.

Usage: PYTHONPATH=. python scripts/prefill_variants_probe.py [--quick]      (GPU)
       TRITON_INTERPRET=1 PYTHONPATH=. python scripts/prefill_variants_probe.py --check  (CPU, small, fp32/fp16)
"""

from __future__ import annotations

import sys

import torch
import triton
import triton.language as tl

LOG2E = 1.4426950408889634


@triton.jit
def _inner(acc, l_i, m_i, q, k_base, v_base, stride_t, lo, hi, qk_scale, offs_m, offs_n, offs_d,
           MASKED: tl.constexpr, BLOCK_N: tl.constexpr, FUSE: tl.constexpr, TAU: tl.constexpr,
           WS: tl.constexpr):
    for start_n in tl.range(lo, hi, BLOCK_N, warp_specialize=WS):
        start_n = tl.multiple_of(start_n, BLOCK_N)
        cols = start_n + offs_n
        k = tl.load(k_base + cols[:, None] * stride_t + offs_d[None, :])
        qk = tl.dot(q, tl.trans(k))
        if MASKED:
            qk = tl.where(offs_m[:, None] >= cols[None, :], qk, float("-inf"))
        if FUSE:
            m_ij = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)
        else:
            qk = qk * qk_scale
            m_ij = tl.maximum(m_i, tl.max(qk, 1))
        if TAU > 0:
            if tl.max(m_ij - m_i, 0) > TAU:
                alpha = tl.math.exp2(m_i - m_ij)
                l_i = l_i * alpha
                acc = acc * alpha[:, None]
                m_i = m_ij
            m_ref = m_i
        else:
            alpha = tl.math.exp2(m_i - m_ij)
            l_i = l_i * alpha
            acc = acc * alpha[:, None]
            m_ref = m_ij
            m_i = m_ij
        if FUSE:
            p = tl.math.exp2(qk * qk_scale - m_ref[:, None])
        else:
            p = tl.math.exp2(qk - m_ref[:, None])
        l_i = l_i + tl.sum(p, 1)
        v = tl.load(v_base + cols[:, None] * stride_t + offs_d[None, :])
        acc = tl.dot(p.to(v.dtype), v, acc)
    return acc, l_i, m_i


@triton.jit
def _fwd_probe(Q, K, V, O, N, qk_scale, stride_b, stride_h, stride_t, GROUP: tl.constexpr,
               D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, FUSE: tl.constexpr,
               TAU: tl.constexpr, WS: tl.constexpr):
    """q/k/v/o [B, H, N, D] contiguous; N % BLOCK_M == 0; causal."""
    pid_m = tl.num_programs(0) - 1 - tl.program_id(0)
    h = tl.program_id(1)
    b = tl.program_id(2)
    m0 = pid_m * BLOCK_M
    hk = h // GROUP
    b64 = b.to(tl.int64)
    q_base = Q + b64 * stride_b + h * stride_h
    k_base = K + b64 * (stride_b // GROUP) + hk * stride_h
    v_base = V + b64 * (stride_b // GROUP) + hk * stride_h
    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, D)
    q = tl.load(q_base + offs_m[:, None] * stride_t + offs_d[None, :])
    m_i = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, D], dtype=tl.float32)
    acc, l_i, m_i = _inner(acc, l_i, m_i, q, k_base, v_base, stride_t, 0, m0, qk_scale, offs_m, offs_n, offs_d,
                           False, BLOCK_N, FUSE, TAU, WS)
    acc, l_i, m_i = _inner(acc, l_i, m_i, q, k_base, v_base, stride_t, m0, m0 + BLOCK_M, qk_scale, offs_m, offs_n,
                           offs_d, True, BLOCK_N, FUSE, TAU, False)
    acc = acc / l_i[:, None]
    o_ptrs = O + b64 * stride_b + h * stride_h + offs_m[:, None] * stride_t + offs_d[None, :]
    tl.store(o_ptrs, acc.to(O.dtype.element_ty))


def probe_fwd(q, k, v, cfg):
    b, h, n, d = q.shape
    hkv = k.shape[1]
    o = torch.empty_like(q)
    assert n % cfg["BLOCK_M"] == 0 and q.is_contiguous() and k.is_contiguous() and v.is_contiguous()
    grid = (n // cfg["BLOCK_M"], h, b)
    _fwd_probe[grid](q, k, v, o, n, d**-0.5 * LOG2E, q.stride(0), q.stride(1), q.stride(2), h // hkv, d,
                     cfg["BLOCK_M"], cfg["BLOCK_N"], cfg.get("FUSE", False), cfg.get("TAU", 0.0),
                     cfg.get("WS", False), num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    return o


def ref(q, k, v):
    g = q.shape[1] // k.shape[1]
    kk, vv = k.repeat_interleave(g, 1).float(), v.repeat_interleave(g, 1).float()
    s = q.float() @ kk.transpose(-1, -2) * q.shape[-1] ** -0.5
    n = q.shape[2]
    s.masked_fill_(torch.ones(n, n, dtype=torch.bool, device=q.device).triu(1), float("-inf"))
    return (s.softmax(-1) @ vv)


def check():
    torch.manual_seed(0)
    for dt in (torch.float32, torch.float16):
        for (b, h, hkv, n, d) in [(2, 4, 2, 64, 32), (1, 2, 1, 48, 16)]:
            q, k, v = (torch.randn(b, x, n, d, dtype=dt) for x in (h, hkv, hkv))
            q = q * 3  # scores spread wide enough that the lazy branch both fires and skips
            r = ref(q, k, v)
            for cfg in [dict(FUSE=False, TAU=0.0), dict(FUSE=True, TAU=0.0), dict(FUSE=True, TAU=8.0),
                        dict(FUSE=False, TAU=8.0), dict(FUSE=True, TAU=1.0)]:
                cfg.update(BLOCK_M=16, BLOCK_N=16, num_warps=4, num_stages=1)
                o = probe_fwd(q, k, v, cfg)
                err = (o.float() - r).abs().max().item()
                tol = 1e-4 if dt == torch.float32 else 3e-3
                print(f"{dt} {(b, h, hkv, n, d)} {cfg}: max err {err:.2e}", flush=True)
                assert err < tol, err
    print("check passed")


def main():
    if "--check" in sys.argv:
        check()
        return
    import torch.nn.functional as F

    from pageflash.bench.kernels import PREFILL_SHAPES, SDPA_BACKENDS, _bench, _sdpa, _try
    from pageflash.kernels.flash_attention import _fwd

    quick = "--quick" in sys.argv
    table = []
    for b, h, n, d in PREFILL_SHAPES:
        torch.manual_seed(0)
        q, k, v = (torch.randn(b, h, n, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        flops = 4 * b * h * n * n * d / 2
        tf = lambda ms: flops / (ms * 1e-3) / 1e12  # noqa: E731
        base_o = _fwd(q, k, v, None, n, True, d**-0.5, False, None)
        base_o = base_o[0] if isinstance(base_o, tuple) else base_o
        res = {"ours": tf(_bench(lambda: _fwd(q, k, v, None, n, True, d**-0.5, False, None)))}
        if d <= 64:
            tiles = [(64, 64, 4, 3), (128, 64, 4, 3), (128, 64, 8, 3), (128, 128, 8, 2)]
        else:
            tiles = [(128, 64, 8, 3), (128, 128, 8, 2), (128, 64, 8, 4), (128, 128, 8, 3)]
        if quick:
            tiles = tiles[:2]
        variants = []
        for bm, bn, w, s in tiles:
            for fuse, tau, ws in [(False, 0.0, False), (True, 0.0, False), (True, 8.0, False), (False, 8.0, False)]:
                variants.append(dict(BLOCK_M=bm, BLOCK_N=bn, num_warps=w, num_stages=s, FUSE=fuse, TAU=tau, WS=ws))
        variants.append(dict(BLOCK_M=128, BLOCK_N=128 if d > 64 else 64, num_warps=8, num_stages=2, FUSE=True,
                             TAU=8.0, WS=True))
        variants.append(dict(BLOCK_M=128, BLOCK_N=64, num_warps=4, num_stages=2, FUSE=True, TAU=0.0, WS=True))
        for cfg in variants:
            name = (f"{cfg['BLOCK_M']}x{cfg['BLOCK_N']} w{cfg['num_warps']} s{cfg['num_stages']}"
                    f"{' fuse' if cfg['FUSE'] else ''}{' tau8' if cfg['TAU'] else ''}{' ws' if cfg['WS'] else ''}")

            def run(cfg=cfg):
                o = probe_fwd(q, k, v, cfg)
                torch.cuda.synchronize()
                err = (o.float() - base_o.float()).abs().max().item()
                if not err < 2e-2:
                    raise AssertionError(f"max |diff| {err}")
                return tf(_bench(lambda: probe_fwd(q, k, v, cfg)))

            res[name] = _try(run)
            print(f"  B{b} H{h} N{n} D{d} {name}: {res[name] if res[name] is None else round(res[name])}", flush=True)
        for be in SDPA_BACKENDS[:2]:
            def srun(be=be):
                with _sdpa(be):
                    F.scaled_dot_product_attention(q, k, v, is_causal=True)
                    torch.cuda.synchronize()
                    return tf(_bench(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True)))
            res["sdpa " + be] = _try(srun)
        table.append(((b, h, n, d), res))
        print(f"B{b} H{h} N{n} D{d}: " + ", ".join(f"{k_}: {v_:.0f}" if v_ else f"{k_}: n/a" for k_, v_ in res.items()),
              flush=True)
        del q, k, v, base_o
        torch.cuda.empty_cache()
    print("\n| variant | " + " | ".join(f"{s[0]},{s[1]},{s[2]},{s[3]}" for s, _ in table) + " |")
    print("| --- |" + " --- |" * len(table))
    keys = []
    for _, res in table:
        keys += [k_ for k_ in res if k_ not in keys]
    for k_ in keys:
        print(f"| {k_} | " + " | ".join(f"{r[k_]:.0f}" if r.get(k_) else "n/a" for _, r in table) + " |")


if __name__ == "__main__":
    main()
