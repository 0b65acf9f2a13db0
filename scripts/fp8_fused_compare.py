"""GPU diagnostic: the first (uncached) step of two fresh FP8 engines, activation codes from the norms'
and activation's launches (PAGEFLASH_FP8_FUSED_QUANT=1) against the separate quantizer (=0): the first
modules whose outputs part (norms compared as their e4m3 codes and scales). Run 55 found one code in
560k of gemma-3-1b's layer-1 norm. python scripts/fp8_fused_compare.py [MODEL]"""
import os
import sys

import torch

from pageflash import LLM, SamplingParams
from pageflash.kernels import fp8_linear as F8
from pageflash.layers.norm import RMSNorm

model = sys.argv[1] if len(sys.argv) > 1 else "gemma-3-1b"
P = [[(7 * i + j) % 1000 + 3 for j in range(n)] for i, n in enumerate((5, 17, 33, 64, 100, 1, 250, 16))]


def norm_codes(o):
    # (an Fp8Rows is a tuple too: a norm with a residual returns (Fp8Rows, residual))
    o = o[0] if isinstance(o, tuple) and not isinstance(o, F8.Fp8Rows) else o
    if isinstance(o, F8.Fp8Rows):
        return torch.cat([o.codes.float(), o.scale], 1)
    q, s = F8.quantize_rows_fp8(o.contiguous())
    return torch.cat([q.float(), s], 1)


def capture(fused):
    os.environ["PAGEFLASH_FP8_FUSED_QUANT"] = fused
    llm = LLM(model, load_format="dummy", max_model_len=512, num_kv_blocks=512, dtype="bfloat16", enforce_eager=True,
              quantization="fp8")
    m = llm.llm_engine.runner.model
    got, order = {}, []

    def hook(name, is_norm):
        def f(mod, inp, out):
            if name in got:
                return
            v = norm_codes(out) if is_norm else (out[0] if isinstance(out, tuple) else out).float()
            got[name] = v.detach().clone()
            order.append(name)
        return f

    for name, mod in m.named_modules():
        if name.startswith("layers.") and name.count(".") >= 2:
            mod.register_forward_hook(hook(name, isinstance(mod, RMSNorm)))
    llm.generate([{"prompt_token_ids": p} for p in P], SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)
    del llm
    torch.cuda.empty_cache()
    return got, order


a, order = capture("1")
b, _ = capture("0")
n = 0
for name in order:
    x, y = a[name], b.get(name)
    if y is None or x.shape != y.shape or not torch.equal(x, y):
        d = (x - y).abs() if y is not None and x.shape == y.shape else None
        print("differs", name, tuple(x.shape), None if d is None else (float(d.max()), int((d > 0).sum()),
              d.nonzero()[:4].tolist()))
        n += 1
        if n >= 10:
            break
print("modules", len(order), "first step rows", a[order[0]].shape[0])
