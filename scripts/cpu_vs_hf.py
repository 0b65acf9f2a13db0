"""Batch-1 greedy decode on the CPU: pageflash's LLM against HF transformers on the same weights.

Both load the default model's GGUF (smollm2-135m, dequantized to float32); rounds alternate
LLM.generate and HF generate in one process, so both meet the same machine load. EOS is ignored on
our side and suppressed on HF's (min_new_tokens), so token ids may differ after an EOS; the
figure is tok/s. Usage: python scripts/cpu_vs_hf.py [--tokens 48] [--rounds 3]
"""

import argparse
import os
import time

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from pageflash import LLM, SamplingParams
from pageflash.model.loader import resolve_model


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--prompt", default="Write a short story about a robot learning to paint.")
    a = ap.parse_args()
    src = resolve_model("smollm2-135m", "auto")
    folder, name = os.path.split(src.path)
    tok = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    hf = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32).eval()
    llm = LLM()
    ids = tok(a.prompt, return_tensors="pt").input_ids
    sp = SamplingParams(temperature=0, max_tokens=a.tokens, ignore_eos=True)
    llm.generate([a.prompt], sp, use_tqdm=False)  # warm-up
    with torch.inference_mode():
        hf.generate(ids, max_new_tokens=4, do_sample=False)
    for r in range(a.rounds):
        t = time.perf_counter()
        llm.generate([a.prompt], sp, use_tqdm=False)
        ours = a.tokens / (time.perf_counter() - t)
        with torch.inference_mode():
            t = time.perf_counter()
            hf.generate(ids, max_new_tokens=a.tokens, min_new_tokens=a.tokens, do_sample=False)
            theirs = a.tokens / (time.perf_counter() - t)
        print(f"round {r}: pageflash {ours:.1f} tok/s, HF transformers {theirs:.1f} tok/s", flush=True)


if __name__ == "__main__":
    main()
