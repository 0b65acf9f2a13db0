"""H100 probe (run 51): the paged kernel's default config (block ids one per page, BT_PAGES; at D 64 with
128-row tiles 4 warps) against the one before (one id per key; 8 warps there), at the
steps the engine sends it: a W-offline-like mixed step (240 decodes of 300-1500 keys beside a 1024-token
chunk over 512 cached), four 1024-token chunks over 1024 cached, a speculative verify step (64 x 5
queries over 2000 cached), a long chunk (4096 new over 4096 cached), at llama-3-8b heads (32 / 8, D 128)
and smollm2's (9 / 3, D 64); bf16 and int8 / e4m3 caches. CUDA-graph replays, ROUNDS alternated rounds,
medians; each launch checked against the float32 reference first.
PYTHONPATH=. python scripts/paged_bt_pages_probe.py [ROUNDS]"""

import statistics
import sys

import torch

from pageflash.bench.kernels import _bench
from pageflash.kernels.paged_attention import paged_attention, prefill_config
from pageflash.layers.attention import paged_attention_ref, quantize_kv_ref

from mixed_step_probe import PAGE, step_metadata  # (scripts/ is on the path when this file runs)


def main() -> None:
    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 3
    g = torch.Generator().manual_seed(0)
    steps = {
        "mixed": [(int(c), 1) for c in torch.randint(300, 1500, (240,), generator=g)] + [(512, 1024)],
        "chunks": [(1024, 1024)] * 4,
        "verify": [(2000, 5)] * 64,
        "long chunk": [(4096, 4096)],
    }
    rows = []
    for hq, hkv, d in ((32, 8, 128), (9, 3, 64)):
        for sname, specs in steps.items():
            meta, total = step_metadata(specs, g)
            bt, qsl, sl, qlens, lens = (meta.block_tables, meta.query_start_loc, meta.seq_lens, meta.query_lens_cpu,
                                        meta.seq_lens_cpu)
            kc = torch.randn(total, PAGE, hkv, d, device="cuda").to(torch.bfloat16)
            vc = torch.randn_like(kc)
            q = torch.randn(sum(qlens), hq, d, device="cuda").to(torch.bfloat16)
            caches = {"bf16": (kc, vc, None)}
            for name, code in (("int8", torch.int8), ("fp8", torch.float8_e4m3fn)):
                kq, ks = quantize_kv_ref(kc, code)
                vq, vs = quantize_kv_ref(vc, code)
                caches[name] = (kq, vq, (ks.transpose(1, 2).contiguous(), vs.transpose(1, 2).contiguous()))
            fns = {}
            for name, (k_, v_, sc) in caches.items():
                ref = paged_attention_ref(q.float(), k_, v_, meta, d**-0.5, sc)
                base = prefill_config(d, hq // hkv, max(qlens), torch.bfloat16, q.device,
                                      None if sc is None else k_.dtype)
                before = dict(base, BT_PAGES=False)
                if d <= 64 and sc is None and base["BLOCK_M"] >= 128:
                    before["num_warps"] = 8  # the config before run 51
                for pp in (False, True):
                    cfg = dict(base) if pp else before
                    fn = (lambda cfg=cfg, k_=k_, v_=v_, sc=sc: paged_attention(
                        q, k_, v_, qsl, sl, bt, d**-0.5, qlens, lens, config=cfg, kv_scales=sc))
                    err = ((fn().float() - ref).norm() / ref.norm()).item()
                    assert err < 1e-2, (sname, name, pp, err)
                    fns[f"{name} {'page' if pp else 'key'}"] = fn
            times = {k: [] for k in fns}
            for _ in range(rounds):
                for k, fn in fns.items():
                    torch.cuda.synchronize()
                    times[k].append(_bench(fn, graph=True) * 1e3)
            med = {k: statistics.median(v) for k, v in times.items()}
            line = f"{hq}/{hkv}x{d} {sname}: " + "; ".join(
                f"{c} {med[c + ' key']:.1f} -> {med[c + ' page']:.1f} us ({med[c + ' key'] / med[c + ' page']:.3f}x)"
                for c in caches)
            print(line, flush=True)
            rows.append(line)
            del kc, vc, caches, fns
            torch.cuda.empty_cache()
    print("\n".join(rows))


if __name__ == "__main__":
    main()
