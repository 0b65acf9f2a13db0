"""Where do dead splits cost? A graph planned for a longer bound than the step's sequences launches
programs for splits with no keys (they exit at once) and combines over every split's row.

B1, 32 / 8 heads, D 128; for bound L and actual lengths L and L / 4, splits 16 / 32 / 64, CUDA-graph
replays of: the default; the combine without EAGER (reads only the live rows, after seq_len); the split
kernel alone (combine skipped: timing only); without PDL.
(Run 59 also timed the grid ordered (Hkv, B, splits), every head's first split dispatched before any
second one, with a kernel switch since removed: docs/KERNELS.md.)
Usage: python scripts/decode_dead_splits_probe.py   (PYTHONPATH=.:scripts)
"""

import statistics

import torch

import pageflash.kernels.flash_decoding as fd
from decode_splits_probe import case
from probe_timing import graph_rounds

real_combine = fd.combine_partials


def split_only(*a, **k):
    fd.combine_partials = lambda *a, **k: None
    try:
        return fd.flash_decode(*a, **k)
    finally:
        fd.combine_partials = real_combine


def main():
    rows = []
    for L in (4096, 8192):
        for actual in (L, L // 4):
            q, kc, vc, bt, sl = case(1, L, 32, 8, 128, actual)
            sc = 128 ** -0.5
            for s in (16, 32, 64):
                fns = {
                    "default": lambda s=s: fd.flash_decode(q, kc, vc, bt, sl, sc, num_splits=s),
                    "no-eager": lambda s=s: fd.flash_decode(q, kc, vc, bt, sl, sc, num_splits=s,
                                                            config={"COMBINE_EAGER": False}),
                    "split-only": lambda s=s: split_only(q, kc, vc, bt, sl, sc, num_splits=s),
                    "no-pdl": lambda s=s: fd.flash_decode(q, kc, vc, bt, sl, sc, num_splits=s, config={"PDL": 0}),
                }
                t = graph_rounds(fns, 3, rep=50)
                rows.append((L, actual, s, {k: statistics.median(v) for k, v in t.items()}))
                print(rows[-1], flush=True)
    print(f"{'bound':>6}{'len':>6}{'splits':>7}" + "".join(f"{k:>11}" for k in rows[0][3]))
    for L, actual, s, t in rows:
        print(f"{L:>6}{actual:>6}{s:>7}" + "".join(f"{v:>11.2f}" for v in t.values()))


if __name__ == "__main__":
    main()
