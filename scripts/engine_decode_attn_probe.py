"""The decode attention kernel over a real engine's KV cache and block tables, against the same bytes
laid out as the bench lays them (run 49: at TP=2 llama-3-8b batch 64 x 6000 keys the kernel took
347 us a layer inside the engine's decode graph, 270 us in decode_occupancy_probe.py over the same
shape). One GPU, llama-3-8b dummy weights: B prompts of L tokens are prefilled and decoded a few steps
by the engine; the block tables of its last full-batch decode step are recorded; then layer 0's split kernel is
timed (CUDA-graph replays) over:
  engine      the engine's pool and tables, as the decode graph reads them;
  eng-order   the engine's pool, each sequence's pages remapped to ascending ids (same pool size);
  small-shuf / small-order   a fresh pool just large enough (as bench kernels --decode);
  cudnn       SDPA on contiguous copies.
    python scripts/engine_decode_attn_probe.py [B] [L]"""
import statistics
import sys

import torch
from triton.testing import do_bench_cudagraph

import pageflash.engine.model_runner as mr
import pageflash.kernels.flash_decoding as fd
from pageflash import LLM
from pageflash.sampling_params import SamplingParams

if __name__ == "__main__":
    b = int(sys.argv[1]) if len(sys.argv) > 1 else 32
    L = int(sys.argv[2]) if len(sys.argv) > 2 else 6000
    seen = {}
    run = mr.DecodeGraphs.run

    def rec(self, sched, block_tables, prev_tokens=None):  # the last of the largest steps
        if len(block_tables) >= len(seen.get("bt", ())):
            seen["bt"] = [list(t) for t in block_tables]
            seen["lens"] = [s.request.num_computed_tokens + 1 for s in sched.seqs]
        return run(self, sched, block_tables, prev_tokens)

    mr.DecodeGraphs.run = rec
    llm = LLM("llama-3-8b", load_format="dummy", max_num_seqs=max(64, b))
    eng = llm.llm_engine
    params = SamplingParams(temperature=0.0, max_tokens=16 + b * L // 4096, ignore_eos=True)
    g = torch.Generator().manual_seed(0)
    llm.generate([{"prompt_token_ids": torch.randint(1000, 30000, (L,), generator=g).tolist()} for _ in range(b)],
                 params, use_tqdm=False)
    runner = eng.runner
    kc, vc = runner.kv_caches[0][:2]
    pool = kc.shape[0]
    bs = kc.shape[1]
    hkv, d = kc.shape[2], kc.shape[3]
    hq = runner.cfg.num_attention_heads
    w = max(map(len, seen["bt"]))
    bt = torch.zeros(len(seen["bt"]), w, dtype=torch.int32)
    for i, t in enumerate(seen["bt"]):
        bt[i, : len(t)] = torch.tensor(t, dtype=torch.int32)
    bt = bt.cuda()
    sl = torch.tensor(seen["lens"], dtype=torch.int32, device="cuda")
    nb = bt.shape[0]
    print(f"batch {nb}, keys {min(seen['lens'])}-{max(seen['lens'])}, pool {pool} blocks of {bs} "
          f"({kc.numel() * kc.element_size() / 2**30:.1f} GiB per layer's K), heads {hq}/{hkv}x{d}")
    q = torch.randn(nb, hq, d, device="cuda", dtype=kc.dtype)
    sc = d ** -0.5
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    sp_plan = fd.choose_num_splits(nb, hkv, runner.max_model_len, sms)
    sp_len = fd.choose_num_splits(nb, hkv, int(sl.max()), sms)
    # engine pool, pages remapped ascending: copy each sequence's pages to blocks 0.. in order
    used = bt.shape[0] * bt.shape[1]
    order_bt = torch.arange(used, device="cuda", dtype=torch.int32).view_as(bt)
    k2, v2 = kc.clone(), vc.clone()
    k2[order_bt.long().flatten()] = kc[bt.long().flatten()]
    v2[order_bt.long().flatten()] = vc[bt.long().flatten()]
    small_k = kc[bt.long().flatten()].clone()
    small_v = vc[bt.long().flatten()].clone()
    small_shuf = torch.randperm(used, device="cuda").to(torch.int32).view_as(bt)
    sk2 = torch.empty_like(small_k)
    sv2 = torch.empty_like(small_v)
    sk2[small_shuf.long().flatten()] = small_k
    sv2[small_shuf.long().flatten()] = small_v
    Lmax = int(sl.max())
    kk = small_k.view(nb, -1, hkv, d)[:, :Lmax].transpose(1, 2).contiguous()
    vv = small_v.view(nb, -1, hkv, d)[:, :Lmax].transpose(1, 2).contiguous()
    q4 = q.view(nb, hq, 1, d)
    cases = {
        "cudnn": lambda: torch.nn.functional.scaled_dot_product_attention(q4, kk, vv, enable_gqa=True),
    }
    for sp in sorted({sp_plan, sp_len}):
        cases[f"engine sp{sp}"] = lambda sp=sp: fd.flash_decode(q, kc, vc, bt, sl, sc, num_splits=sp)
        cases[f"eng-order sp{sp}"] = lambda sp=sp: fd.flash_decode(q, k2, v2, order_bt, sl, sc, num_splits=sp)
        cases[f"small-shuf sp{sp}"] = lambda sp=sp: fd.flash_decode(q, sk2, sv2, small_shuf, sl, sc, num_splits=sp)
        cases[f"small-order sp{sp}"] = lambda sp=sp: fd.flash_decode(q, small_k, small_v, order_bt, sl, sc,
                                                                     num_splits=sp)
    # as the engine's decode graph calls it: the step's rotary and K/V store inside (the new token's
    # slot -1 here: nothing stored), the two-kernel combine (the default)
    cos, sin = runner.model.rotary.cos, runner.model.rotary.sin
    pos = (sl - 1).long()
    kn = torch.randn(nb, hkv, d, device="cuda", dtype=kc.dtype)
    vn = torch.randn_like(kn)
    no_slot = torch.full((nb,), -1, device="cuda", dtype=torch.int64)

    def rope_call(sp, config=None):
        def fn():
            return fd.flash_decode(q, kc, vc, bt, sl, sc, num_splits=sp, rope=(pos, cos, sin),
                                   k_new=kn, v_new=vn, slot_mapping=no_slot, config=config)
        return fn

    cases[f"engine+rope sp{sp_plan}"] = rope_call(sp_plan)
    for name, cfg in (("w8", dict(num_warps=8)), ("s2", dict(num_stages=2)), ("n32", dict(BLOCK_N=32)),
                      ("w2", dict(num_warps=2))):
        cases[f"engine+rope {name} sp{sp_plan}"] = rope_call(sp_plan, cfg)
        cases[f"engine {name} sp{sp_plan}"] = lambda cfg=cfg: fd.flash_decode(q, kc, vc, bt, sl, sc,
                                                                             num_splits=sp_plan, config=cfg)
    ref = fd.flash_decode(q, small_k, small_v, order_bt, sl, sc, num_splits=1).float()
    for k, fn in cases.items():
        if k != "cudnn" and "rope" not in k:  # (rope: q rotated, the last key the new one)
            err = (fn().float() - ref).abs().max().item()
            assert err < 2e-2, (k, err)
    kv_bytes = 2 * int(sl.sum()) * hkv * d * kc.element_size()
    res = {k: [] for k in cases}
    for _ in range(3):
        for k, fn in cases.items():
            res[k].append(do_bench_cudagraph(fn, rep=60) * 1e3)
    base = statistics.median(res["cudnn"])
    print(f"splits planned for max_model_len {runner.max_model_len}: {sp_plan}; for the longest sequence: {sp_len}")
    for k, v in res.items():
        m = statistics.median(v)
        print(f"  {k:<20}{m:8.1f} us  {kv_bytes / m / 1e3:7.0f} GB/s  cudnn/this {base / m:5.3f}")
    print("compiled split kernels: (ROPE, BLOCK_N, warps, stages) -> registers, spills, shared bytes, cp.async")
    for key, (ck, _tail) in fd._decode_split_kernel._cache.items():
        kw = dict(key[1])
        print(f"  ROPE {kw.get('ROPE')} n{kw.get('BLOCK_N')} w{kw.get('num_warps')} s{kw.get('num_stages')} "
              f"split {kw.get('SPLIT')}: {ck.n_regs} regs, {ck.n_spills} spills, {ck.metadata.shared} B shared, "
              f"{ck.asm.get('ptx', '').count('cp.async')} cp.async")
    llm.shutdown()
