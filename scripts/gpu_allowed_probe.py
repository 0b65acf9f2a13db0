"""On CUDA: allowed_token_ids through the decode graphs (greedy and sampled, plain and n-gram speculation),
and min_tokens with it; every generated token must lie in the set. Prints one line per case."""
import torch

from pageflash import LLM, SamplingParams

llm = LLM("smollm2-135m", load_format="dummy", max_model_len=512, num_kv_blocks=256)
spec = LLM("smollm2-135m", load_format="dummy", max_model_len=512, num_kv_blocks=256,
           speculative_config={"method": "ngram", "num_speculative_tokens": 3})
allowed = list(range(1000, 1064))
prompts = [{"prompt_token_ids": [100 + i, 200, 300] * (i + 1)} for i in range(8)]
ok = True
for name, engine in (("plain", llm), ("ngram", spec)):
    for temp in (0.0, 1.0):
        sp = SamplingParams(temperature=temp, seed=0, max_tokens=48, ignore_eos=True, allowed_token_ids=allowed,
                            min_tokens=4)
        outs = engine.generate(prompts, sp, use_tqdm=False)
        inside = all(set(o.outputs[0].token_ids) <= set(allowed) for o in outs)
        free = engine.llm_engine.kv.num_free_blocks == engine.llm_engine.kv.pool.num_blocks
        ok &= inside and free
        print(f"{name:6s} T={temp}: all tokens allowed={inside}, lengths={[len(o.outputs[0].token_ids) for o in outs]}, "
              f"no leaks={free}")
plain = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True, allowed_token_ids=allowed),
                     use_tqdm=False)
sped = spec.generate(prompts, SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True, allowed_token_ids=allowed),
                     use_tqdm=False)
same = sum(a.outputs[0].token_ids == b.outputs[0].token_ids for a, b in zip(plain, sped))
print(f"greedy ngram == plain on {same}/{len(prompts)} prompts (bf16)")
print("OK" if ok else "FAILED", torch.cuda.get_device_name())
