"""Split counts for short contexts at small batches: choose_num_splits' min_chunk (keys of the static
bound per split) against the time of a decode launch.

For each head shape, batch B and static bound L (the block-table span, as the engine's graphs plan
it), sequences of L keys and of L / 4 (a graph planned for more keys than a step holds), CUDA-graph
replays (do_bench_cudagraph, median of alternated rounds) of flash_decode with the split count that
choose_num_splits gives at min_chunk 32 / 64 / 128 / 256 (256: the default before run 59); cuDNN SDPA
on contiguous KV of the actual length for reference. Pages shuffled (bench.kernels.decode_case).
Usage: PYTHONPATH=.:scripts python scripts/decode_splits_probe.py [--rounds 2] [--heads 32 8 128]
"""

import argparse
import statistics

import torch
import pageflash.kernels.flash_decoding as fd
from pageflash.bench.kernels import contiguous_kv, decode_case
from probe_timing import graph_rounds

CHUNKS = (32, 64, 128, 256)


def case(b, L, hq, hkv, d, actual, seed=0):
    return decode_case(b, L, seed, heads=(hq, hkv, d), length=actual)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--heads", type=int, nargs=3, action="append")
    ap.add_argument("--batches", type=int, nargs="*", default=[1, 2, 4, 8])
    ap.add_argument("--lens", type=int, nargs="*", default=[512, 1024, 2048, 4096, 8192])
    a = ap.parse_args()
    heads = a.heads or [[32, 8, 128], [9, 3, 64]]
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    rows = []
    for hq, hkv, d in heads:
        for b in a.batches:
            for L in a.lens:
                for actual in (L, L // 4):
                    q, kc, vc, bt, sl = case(b, L, hq, hkv, d, actual)
                    sc = d ** -0.5
                    ref = fd.flash_decode_ref(q, kc, vc, bt, sl, sc) if b * actual <= 16384 else None
                    counts = {c: fd.choose_num_splits(b, hkv, L, sms, min_chunk=c) for c in CHUNKS}
                    fns = {}
                    for s in sorted(set(counts.values())):
                        fns[s] = (lambda s=s: fd.flash_decode(q, kc, vc, bt, sl, sc, num_splits=s))
                        if ref is not None:
                            err = (fns[s]().float() - ref.float()).abs().max().item()
                            assert err < 2e-2, (hq, hkv, d, b, L, actual, s, err)
                    kk, vv = contiguous_kv(kc, vc, bt, actual)
                    q4 = q.view(b, hq, 1, d)
                    fns["cudnn"] = lambda: torch.nn.functional.scaled_dot_product_attention(q4, kk, vv, enable_gqa=True)
                    t = graph_rounds(fns, a.rounds, rep=50)
                    med = {k: statistics.median(v) for k, v in t.items()}
                    row = dict(heads=(hq, hkv, d), b=b, L=L, actual=actual, counts=counts, us=med)
                    rows.append(row)
                    print(row, flush=True)
                    del fns, kk, vv, kc, vc
                    torch.cuda.empty_cache()
    print(f"{'heads':<10}{'B':>3}{'bound':>6}{'len':>6}" + "".join(f"{'mc' + str(c):>12}" for c in CHUNKS)
          + f"{'cudnn':>8}")
    for r in rows:
        cells = "".join(f"{r['us'][r['counts'][c]]:>8.2f}/{r['counts'][c]:<3}" for c in CHUNKS)
        print(f"{'%d/%d/%d' % r['heads']:<10}{r['b']:>3}{r['L']:>6}{r['actual']:>6}{cells}{r['us']['cudnn']:>8.2f}")


if __name__ == "__main__":
    main()
