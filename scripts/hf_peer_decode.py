"""Peer: HF transformers generate on a named config (random bf16 weights), batch 1 decode tok/s.

Greedy, EOS ignored, 128 random prompt tokens; decode tok/s = (new - 1) tokens over the time of a
generate of `new` tokens minus that of a 1-token generate (the prefill), medians of 3. Mixtures of
experts run through transformers' experts_implementation (default "grouped_mm", torch._grouped_mm);
attention through transformers' default for the model (sdpa, or eager where it softcaps: Gemma 2).
Usage: PYTHONPATH=. python scripts/hf_peer_decode.py [model] [new_tokens] [experts_implementation]
"""

import statistics
import sys
import time

import torch
from transformers import AutoConfig, AutoModelForCausalLM

from pageflash.model.registry import NAMED_CONFIGS

name = sys.argv[1] if len(sys.argv) > 1 else "qwen1.5-moe-a2.7b"
new = int(sys.argv[2]) if len(sys.argv) > 2 else 128
impl = sys.argv[3] if len(sys.argv) > 3 else "grouped_mm"
d = dict(NAMED_CONFIGS[name])
d.pop("eos_token_id", None)
cfg = AutoConfig.for_model(**d)
moe = bool(getattr(cfg, "num_experts", 0) or getattr(cfg, "num_local_experts", 0))
if moe:
    cfg._experts_implementation = impl
torch.manual_seed(0)
with torch.device("cuda"):
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).eval()
ids = torch.randint(0, 10000, (1, 128), device="cuda")


def gen(n: int) -> float:
    torch.cuda.synchronize()
    t = time.perf_counter()
    with torch.no_grad():
        model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                       do_sample=False, pad_token_id=0, eos_token_id=None)
    torch.cuda.synchronize()
    return time.perf_counter() - t


gen(4)  # warm-up
pre = statistics.median(gen(1) for _ in range(3))
full = statistics.median(gen(new) for _ in range(3))
print(f"HF transformers {name} ({impl + ' experts, ' if moe else ''}{model.config._attn_implementation} attention, "
      f"eager, default cache): batch 1 decode "
      f"{(new - 1) / (full - pre):.1f} tok/s; prefill+1 {pre * 1e3:.1f} ms; {new} tokens {full:.2f} s")
