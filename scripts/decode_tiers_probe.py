"""Decode graph tiers for short contexts: the split decode's time against the split count, for
sequences far shorter than the static bound a decode graph is planned for.

A decode graph fixes the split count (from the bound: the block-table width); the kernel sizes each
split's chunk from the sequence's actual length (cdiv(len, splits) rounded up to the key tile), so
splits past the last chunk are dead programs that exit at once. For each head shape, batch B, actual
length L and split count S: CUDA-graph replays (do_bench_cudagraph, medians of alternated rounds) of
flash_decode over shuffled pages (bench.kernels.decode_case, a table 4096 keys wide). The table it
prints gives, per (heads, B, L), every S's time, the best S, and what choose_num_splits gives for
bounds 512 / 1024 / 2048 / 4096 / 8192 (the candidate tiers) with the time each would take.
Usage: PYTHONPATH=.:scripts python scripts/decode_tiers_probe.py [--rounds 2] [--json F]
"""

import argparse
import json
import statistics

import torch
import pageflash.kernels.flash_decoding as fd
from pageflash.bench.kernels import decode_case
from probe_timing import graph_rounds

SPLITS = (1, 2, 4, 8, 16, 32, 64)
BOUNDS = (512, 1024, 2048, 4096, 8192)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--heads", type=int, nargs=3, action="append")
    ap.add_argument("--batches", type=int, nargs="*", default=[1, 2, 4, 8, 16])
    ap.add_argument("--lens", type=int, nargs="*", default=[128, 256, 384, 512, 1024, 2048, 4096])
    ap.add_argument("--json")
    a = ap.parse_args()
    heads = a.heads or [[32, 8, 128], [9, 3, 64]]
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    width = max(a.lens)
    rows = []
    for hq, hkv, d in heads:
        for b in a.batches:
            for L in a.lens:
                q, kc, vc, bt, sl = decode_case(b, width, 0, heads=(hq, hkv, d), length=L)
                sc = d ** -0.5
                ref = fd.flash_decode_ref(q, kc, vc, bt, sl, sc)
                fns = {}
                for s in SPLITS:
                    if s > 1 and b * hkv * s > 8 * sms:
                        continue
                    fns[s] = (lambda s=s: fd.flash_decode(q, kc, vc, bt, sl, sc, num_splits=s))
                    err = (fns[s]().float() - ref.float()).abs().max().item()
                    assert err < 2e-2, (hq, hkv, d, b, L, s, err)
                t = graph_rounds(fns, a.rounds, rep=30)
                med = {s: statistics.median(v) for s, v in t.items()}
                tiers = {T: fd.choose_num_splits(b, hkv, T, sms) for T in BOUNDS}
                row = dict(heads=[hq, hkv, d], b=b, L=L, us=med, tiers=tiers)
                rows.append(row)
                best = min(med, key=med.get)
                print(f"{hq}/{hkv}x{d} B{b:<3} L{L:<5} " + " ".join(f"S{s}:{v:.2f}" for s, v in med.items())
                      + f" | best S{best} {med[best]:.2f} | tiers " + " ".join(
                          f"{T}:S{s}={med.get(s, float('nan')):.2f}" for T, s in tiers.items()), flush=True)
                del fns, kc, vc
                torch.cuda.empty_cache()
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f)


if __name__ == "__main__":
    main()
