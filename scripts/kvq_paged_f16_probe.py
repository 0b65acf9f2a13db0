"""H100 probe (run 50): the paged kernel over int8 / e4m3 caches with the codes widened to bf16 or to
float16 (F16_CODES), default configs, llama-3-8b heads, three steps: a W-offline-like mixed step (240
decodes of 300-1500 keys beside a 1024-token chunk over 512 cached), four 1024-token chunks over 1024
cached, and a speculative verify step (64 sequences x 5 tree-less queries over 2000 cached keys). Checks
each launch against the float32 reference first. PYTHONPATH=. python scripts/kvq_paged_f16_probe.py"""

import torch

from pageflash.bench.kernels import _bench
from pageflash.kernels.paged_attention import paged_attention, prefill_config
from pageflash.layers.attention import paged_attention_ref, quantize_kv_ref

from mixed_step_probe import step_metadata  # (scripts/ is on the path when this file runs)

HQ, HKV, D, PAGE = 32, 8, 128, 16


def main() -> None:
    g = torch.Generator().manual_seed(0)
    steps = {
        "mixed": [(int(c), 1) for c in torch.randint(300, 1500, (240,), generator=g)] + [(512, 1024)],
        "chunks": [(1024, 1024)] * 4,
        "verify": [(2000, 5)] * 64,
    }
    rows = []
    for sname, specs in steps.items():
        meta, total = step_metadata(specs, g)
        bt, qsl, sl, qlens, lens = meta.block_tables, meta.query_start_loc, meta.seq_lens, meta.query_lens_cpu, \
            meta.seq_lens_cpu
        kc = torch.randn(total, PAGE, HKV, D, device="cuda").to(torch.bfloat16)
        vc = torch.randn_like(kc)
        q = torch.randn(sum(qlens), HQ, D, device="cuda").to(torch.bfloat16)
        torch.cuda.synchronize()
        t_bf = _bench(lambda: paged_attention(q, kc, vc, qsl, sl, bt, D**-0.5, qlens, lens), graph=True) * 1e3
        line = f"{sname}: bf16 {t_bf:.1f} us"
        for name, code in (("int8", torch.int8), ("fp8", torch.float8_e4m3fn)):
            kq, ks = quantize_kv_ref(kc, code)
            vq, vs = quantize_kv_ref(vc, code)
            sc = (ks.transpose(1, 2).contiguous(), vs.transpose(1, 2).contiguous())
            ref = paged_attention_ref(q.float(), kq, vq, meta, D**-0.5, sc)
            base = prefill_config(D, HQ // HKV, max(qlens), torch.bfloat16, q.device, code)
            for f16 in (False, True):
                cfg = dict(base, F16_CODES=f16)
                fn = (lambda cfg=cfg: paged_attention(q, kq, vq, qsl, sl, bt, D**-0.5, qlens, lens, config=cfg,
                                                      kv_scales=sc))
                err = ((fn().float() - ref).norm() / ref.norm()).item()
                assert err < 1e-2, (sname, name, f16, err)
                t = _bench(fn, graph=True) * 1e3
                line += f"; {name}{' f16' if f16 else ''} {t:.1f} us (err {err:.4f})"
        print(line, flush=True)
        rows.append(line)
    print("\n".join(rows))


if __name__ == "__main__":
    main()
