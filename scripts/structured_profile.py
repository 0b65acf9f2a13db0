"""Host profile of a constrained batch (cProfile, top functions by own time) and llguidance's
per-call costs: consume_token one by one vs the executor's consume_token_par, bitmasks.

Usage: PYTHONPATH=.:/tmp/llg python scripts/structured_profile.py --model .carry/smollm2-tok
"""

import argparse
import cProfile
import io
import pstats
import time

from pageflash import LLM, SamplingParams, StructuredOutputsParams


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--batch", type=int, default=64)
    args = ap.parse_args()
    llm = LLM(args.model, load_format="dummy", max_model_len=1024, max_num_seqs=128)
    eng = llm.llm_engine
    n = args.batch
    tp = [[1 + (13 * i + j) % 5000 for j in range(32)] for i in range(n)]
    sp = SamplingParams(temperature=1.0, seed=3, max_tokens=128, structured_outputs=StructuredOutputsParams(json_object=True))
    llm.generate(tp, [sp] * n, use_tqdm=False)  # warm
    pr = cProfile.Profile()
    t0 = time.perf_counter()
    pr.enable()
    outs = llm.generate(tp, [sp] * n, use_tqdm=False)
    pr.disable()
    dt = time.perf_counter() - t0
    toks = [o.outputs[0].token_ids for o in outs]
    print(f"profiled run: {sum(map(len, toks))} tokens in {dt:.3f} s")
    s = io.StringIO()
    pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(25)
    print(s.getvalue()[-6000:])
    # llguidance alone over the same token streams
    so = eng.structured_outputs()
    ms = [so.matcher(sp.structured_outputs) for _ in range(n)]
    steps = max(map(len, toks))
    t_seq = t_mask = 0.0
    for j in range(steps):
        live = [(m, t[j]) for m, t in zip(ms, toks) if j < len(t) and not m.is_stopped()]
        t0 = time.perf_counter()
        so.bitmasks([m for m, _ in live])
        t_mask += time.perf_counter() - t0
        t0 = time.perf_counter()
        for m, tok in live:
            m.consume_token(tok)
        t_seq += time.perf_counter() - t0
    ms = [so.matcher(sp.structured_outputs) for _ in range(n)]
    t_par = 0.0
    for j in range(steps):
        live = [(m, t[j]) for m, t in zip(ms, toks) if j < len(t) and not m.is_stopped()]
        t0 = time.perf_counter()
        so._executor.consume_token_par(live)
        t_par += time.perf_counter() - t0
    print(f"per step over {steps} steps: bitmasks {t_mask / steps * 1e3:.3f} ms, consume one by one "
          f"{t_seq / steps * 1e3:.3f} ms, consume_token_par {t_par / steps * 1e3:.3f} ms")


if __name__ == "__main__":
    main()
