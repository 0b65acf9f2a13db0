"""Two-GPU tensor parallelism, one phase per process (eager | graphs): a tiny greedy run of qwen3-0.6b
(dummy weights, float32) over NCCL, with timings; run under scripts/tp_probe_site so that a hang
leaves every rank's stacks in $OUT (TP_DUMP_AFTER seconds)."""
import sys
import time

from pageflash import LLM, SamplingParams

if __name__ == "__main__":
    phase = sys.argv[1]
    t0 = time.time()
    llm = LLM("qwen3-0.6b", load_format="dummy", dtype="float32", max_model_len=256, num_kv_blocks=64,
              tensor_parallel_size=2, enforce_eager=phase == "eager")
    print(f"[{phase}] engine up in {time.time() - t0:.1f} s; graphs: {llm.llm_engine.runner.graphs is not None}",
          flush=True)
    t1 = time.time()
    outs = llm.generate([{"prompt_token_ids": list(range(3, 3 + n))} for n in (5, 40)],
                        SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    print(f"[{phase}] generated in {time.time() - t1:.1f} s: {[o.outputs[0].token_ids for o in outs]}", flush=True)
    t2 = time.time()
    llm.shutdown()  # (a teardown that blocks: "leaving the process group did not finish ... rankN" in the log)
    print(f"[{phase}] shut down in {time.time() - t2:.1f} s", flush=True)
