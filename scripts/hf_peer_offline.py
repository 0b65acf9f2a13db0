"""Peer: HF transformers generate_batch (continuous batching, attn "paged|sdpa") on W-offline.

Same requests as `pageflash bench throughput` (pageflash.bench.throughput.w_offline_requests),
random bf16 weights of a named config, EOS ignored. Usage: python scripts/hf_peer_offline.py [model] [num_prompts]
"""

import inspect
import json
import os
import sys
import time

import torch
from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

from pageflash.bench.throughput import w_offline_requests
from pageflash.model.registry import NAMED_CONFIGS

name = sys.argv[1] if len(sys.argv) > 1 else "smollm2-135m"
num = int(sys.argv[2]) if len(sys.argv) > 2 else 256
d = dict(NAMED_CONFIGS[name])
d.pop("eos_token_id", None)
cfg = AutoConfig.for_model(**d)
torch.manual_seed(0)
model = AutoModelForCausalLM.from_config(cfg, attn_implementation="paged|sdpa", dtype=torch.bfloat16).cuda().eval()
reqs = w_offline_requests(num)
gc = GenerationConfig(max_new_tokens=512, do_sample=False, eos_token_id=None, pad_token_id=0)
kw = {}
if "progress_bar" in inspect.signature(model.generate_batch).parameters:
    kw["progress_bar"] = False
inputs = [p for p, _ in reqs]
# warm-up on a few short requests (graph capture, compilation) outside the timed run
model.generate_batch(inputs=[p[:16] for p in inputs[:4]], generation_config=GenerationConfig(
    max_new_tokens=8, do_sample=False, eos_token_id=None, pad_token_id=0), **kw)
torch.cuda.synchronize()
t = time.perf_counter()
out = model.generate_batch(inputs=inputs, generation_config=gc, **kw)
torch.cuda.synchronize()
wall = time.perf_counter() - t
ntok = sum(len(o.generated_tokens) for o in out.values())
res = dict(peer="hf-generate_batch", model=name, num_prompts=num, output_tokens=ntok, wall_s=wall,
           output_tok_s=ntok / wall, transformers=__import__("transformers").__version__)
print(json.dumps(res))
os.makedirs(os.environ.get("OUT", "out"), exist_ok=True)
with open(os.path.join(os.environ.get("OUT", "out"), "hf_peer.json"), "w") as f:
    json.dump(res, f)
