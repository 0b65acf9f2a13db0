"""The INT8 / FP8 weight-only GEMV's tile on this GPU (batch-1 decode). Usage:
PYTHONPATH=. python scripts/w8_gemv_probe.py [BEST_FILE]

For each llama-3-8b projection, int8 and float8_e4m3fn codes with a per-row scale, a CUDA graph of 32
calls over 8 distinct weights (every call reads HBM, as in a decode step; scripts/gemv_probe.py's
method) is replayed and timed for each (rows, r, bk, stages, warps) of the sweep, and a pure read of
the same code bytes gives the ceiling. Every config is first checked against the float32 reference.
Prints, per dtype, the configs ranked by the layer's sum over the four projections (us) and its GB/s
(codes + scales over time), the default marked; M 2 is timed for the top 3 and the default.
BEST_FILE: the two best configs per dtype, one "dtype rows,r,bk,stages,warps" per line (for A/Bs:
PAGEFLASH_W8_GEMV_CFG). TILES="r,bk,stages,warps;..." and ROWS="8,16,32" change the sweep, DTYPES="int8"
picks the codes.
"""

import os
import sys

import torch
import triton

from graph_timing import graph_time, read_kernel  # (scripts/, the running script's folder)
from pageflash.kernels.fp8_linear import quantize_fp8
from pageflash.kernels.gemv import gemv, gemv_ref
from pageflash.kernels.w8_linear import quantize_int8, w8_gemv_cfg


SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
NW = 8
TILES = [tuple(int(v) for v in t.split(",")) for t in os.environ.get(
    "TILES", "8,512,4,4;8,1024,3,4;8,1024,4,4;8,2048,2,4;8,2048,3,8;4,1024,3,4;4,2048,3,4;16,1024,2,8;"
             "16,512,3,4;8,1024,3,8;16,1024,3,8").split(";")]
ROWS = [int(v) for v in os.environ.get("ROWS", "8,16,32").split(",")]


def main():
    dev = os.environ.get("PROBE_DEVICE", "cuda")  # cpu: a smoke run under TRITON_INTERPRET=1
    torch.manual_seed(0)
    default = tuple(w8_gemv_cfg(torch.device(dev)))
    cfgs = list(dict.fromkeys([default] + [(rows, r, bk, st, wp) for r, bk, st, wp in TILES
                                           for rows in ROWS if rows % r == 0]))
    sink = torch.empty(1 << 20, device=dev, dtype=torch.int32)
    best_lines = []
    dtypes = os.environ.get("DTYPES", "int8 e4m3").split()
    for label, quant in [(d, q) for d, q in (("int8", quantize_int8), ("e4m3", quantize_fp8)) if d in dtypes]:
        per = {c: {} for c in cfgs}  # cfg -> shape -> us (M 1)
        read_us, nbytes = {}, {}
        bad = set()
        weights = {}
        for name, (n, k) in SHAPES.items():
            ws = [quant((torch.randn(n, k, device=dev) * 0.02).to(torch.bfloat16)) for _ in range(NW)]
            weights[name] = ws
            x = torch.randn(2, k, device=dev).to(torch.bfloat16)
            nbytes[name] = n * k + 4 * n
            codes = [q.view(torch.int8) for q, _ in ws]
            block, pr = 4096, 8
            grid = (triton.cdiv(n * k, block * pr),)
            read_us[name] = graph_time(lambda i: read_kernel[grid](codes[i % NW], n * k, sink, BLOCK=block, PER=pr,
                                                                    STAGES=3, num_warps=8))
            q0, s0 = ws[0]
            ref = gemv_ref(x[:1].float(), q0, s0)
            tol = 1e-2 * ref.abs().max().item() + 1e-3
            for c in cfgs:
                if c in bad:
                    continue
                try:
                    y = gemv(x[:1], q0, *c, scale=s0)
                    if (y.float() - ref).abs().max().item() > tol:
                        print(f"{label} {name} {c} WRONG", flush=True)
                        bad.add(c)
                        continue
                    out = torch.empty(1, n, device=dev, dtype=torch.bfloat16)
                    per[c][name] = graph_time(lambda i: gemv(x[:1], ws[i % NW][0], *c, scale=ws[i % NW][1], out=out))
                except Exception as e:  # noqa: BLE001 (a config that does not compile or fit is skipped)
                    print(f"{label} {name} {c} {type(e).__name__}: {e}"[:160], flush=True)
                    bad.add(c)
        total_bytes = sum(nbytes.values())
        ok = [c for c in cfgs if c not in bad and len(per[c]) == len(SHAPES)]
        ranked = sorted(ok, key=lambda c: sum(per[c].values()))
        read_sum = sum(read_us.values())
        print(f"\n{label}: pure read of the codes {read_sum:.1f} us a layer "
              f"({sum(n * k for n, k in SHAPES.values()) / read_sum / 1e3:.0f} GB/s); per shape "
              + " ".join(f"{s} {v:.1f}" for s, v in read_us.items()))
        print(f"{'config (rows,r,bk,st,wp)':26s} {'layer us':>8s} {'GB/s':>5s} {'% read':>6s}  "
              + " ".join(f"{s:>7s}" for s in SHAPES))
        for c in ranked[:12] + ([default] if default in ranked[12:] else []):
            t = sum(per[c].values())
            mark = " (default)" if c == default else ""
            print(f"{str(c):26s} {t:8.1f} {total_bytes / t / 1e3:5.0f} {100 * read_sum / t:5.1f}%  "
                  + " ".join(f"{per[c][s]:7.1f}" for s in SHAPES) + mark)
        # M 2 for the top 3 and the default
        print(f"{label} M 2:", end="")
        for c in list(dict.fromkeys(ranked[:3] + ([default] if default in ranked else []))):
            t = 0.0
            for name, (n, k) in SHAPES.items():
                ws = weights[name]
                x2 = torch.randn(2, k, device=dev).to(torch.bfloat16)
                out = torch.empty(2, n, device=dev, dtype=torch.bfloat16)
                t += graph_time(lambda i: gemv(x2, ws[i % NW][0], *c, scale=ws[i % NW][1], out=out))
            print(f"  {c} {t:.1f} us", end="")
        print(flush=True)
        best_lines += [f"{label} {','.join(map(str, c))}" for c in ranked[:2]]
        del weights
        torch.cuda.empty_cache()
    if len(sys.argv) > 1:
        with open(sys.argv[1], "w") as f:
            f.write("\n".join(best_lines) + "\n")


if __name__ == "__main__":
    main()
