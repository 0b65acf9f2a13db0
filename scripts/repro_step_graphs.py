"""Debug helper: run n-gram speculation on the dummy smollm2 config (batch 1) under a few toggles,
each in its own process; prints OK or the error. Usage: python scripts/repro_step_graphs.py [variant]"""
import os
import subprocess
import sys

VARIANTS = {
    "default": {},
    "no-skinny": {"PAGEFLASH_SKINNY_GEMM": "0"},
    "eager-static": {"REPRO_EAGER_STATIC": "1"},
}


def child() -> None:
    import torch
    from pageflash import LLM, SamplingParams
    import random

    rng = random.Random(0)
    base = [rng.randrange(1000, 9000) for _ in range(64)]
    llm = LLM("smollm2-135m", load_format="dummy", max_model_len=2048, num_kv_blocks=2048,
              speculative_config={"method": "ngram", "num_speculative_tokens": int(os.environ.get("K", "5"))})
    r = llm.llm_engine.runner
    if os.environ.get("REPRO_EAGER_STATIC"):
        r.enable_step_graphs(256, cuda_graphs=False)
    sp = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
    out = llm.generate({"prompt_token_ids": base * 8}, sp, use_tqdm=False)
    torch.cuda.synchronize()
    print("OK", len(out[0].outputs[0].token_ids), "replays", r.step_graphs.replays, "keys", list(r.step_graphs.graphs))


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "child":
        child()
        sys.exit(0)
    names = sys.argv[1:] or list(VARIANTS)
    for name in names:
        env = dict(os.environ, **VARIANTS[name])
        p = subprocess.run([sys.executable, __file__, "child"], env=env, capture_output=True, text=True)
        lines = (p.stdout + p.stderr).strip().splitlines()
        err = [l for l in lines if "Error" in l or l.startswith("OK")]
        print(f"{name:14s} rc={p.returncode} {err[-1] if err else lines[-3:]}")
