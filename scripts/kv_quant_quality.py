"""The quantized KV cache on the real model (SmolLM2-135M-Instruct, the embedded Q4_1 GGUF, float32 on
CPU): greedy chat answers to 8 prompts with kv_cache_dtype auto / int8 / fp8 (how many are identical,
how many tokens agree), then the mean NLL of prompt + the auto answer, teacher-forced in 16-token
chunks so that every chunk reads the earlier ones from the (quantized) cache.
Usage: PYTHONPATH=. python scripts/kv_quant_quality.py"""
import torch
from pageflash import LLM, SamplingParams
prompts = ["The capital of France is", "Write a short poem about the sea.", "Explain what a hash table is.",
           "List three prime numbers:", "def fibonacci(n):", "Translate 'good morning' into Spanish.",
           "What is 12 times 13?", "Once upon a time"]
p = SamplingParams(temperature=0, max_tokens=64)
res = {}
for kv in ("auto", "int8", "fp8"):
    llm = LLM("smollm2-135m", kv_cache_dtype=kv, max_model_len=512)
    outs = llm.chat([[{"role": "user", "content": q}] for q in prompts], p, use_tqdm=False)
    res[kv] = [o.outputs[0].token_ids for o in outs]
for kv in ("int8", "fp8"):
    same = sum(a == b for a, b in zip(res["auto"], res[kv]))
    pref = [next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b))) for a, b in zip(res["auto"], res[kv])]
    print(kv, f"identical {same}/{len(prompts)}, common prefix tokens {pref}")
# teacher-forced: mean NLL of prompt + auto's continuation, chunked by 16 tokens so that each chunk
# reads the earlier ones from the (quantized) cache
tok = LLM("smollm2-135m", max_model_len=512).get_tokenizer()
seqs = []
for q, out in zip(prompts, res["auto"]):
    ids = tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True)
    if not isinstance(ids, list):
        ids = ids["input_ids"]
    seqs.append(list(ids) + out)
for kv in ("auto", "int8", "fp8"):
    llm = LLM("smollm2-135m", kv_cache_dtype=kv, max_model_len=512, max_num_batched_tokens=16, enable_prefix_caching=False)
    outs = llm.generate([{"prompt_token_ids": s} for s in seqs], SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)
    nll, n = 0.0, 0
    for s, o in zip(seqs, outs):
        for t, lp in zip(s[1:], o.prompt_logprobs[1:]):
            nll -= lp[t].logprob
            n += 1
    print(kv, f"mean NLL {nll / n:.4f} over {n} tokens")
