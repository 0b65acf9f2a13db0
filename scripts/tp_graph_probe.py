"""Two GPUs: each decode graph replayed alone, back to back, on every rank at once -- the GPU time of the
step's kernels and all-reduces without the host, the input copies or the sampler (run 48's bucket-64
cliff: is it in the graph, or around it?). llama-3-8b dummy weights, bf16.
    python scripts/tp_graph_probe.py [TP] [MAX_MODEL_LEN] [BUCKETS...]"""
import sys

from pageflash import LLM

if __name__ == "__main__":
    tp = int(sys.argv[1]) if len(sys.argv) > 1 else 2
    max_len = int(sys.argv[2]) if len(sys.argv) > 2 else 8192
    buckets = [int(b) for b in sys.argv[3:]] or [16, 32, 48, 64, 80]
    llm = LLM("llama-3-8b", load_format="dummy", tensor_parallel_size=tp, max_model_len=max_len)
    runner = llm.llm_engine.runner
    for b in buckets:
        if tp > 1:
            local, rest = runner._call("time_decode_graph", b, 20)
        else:
            local, rest = runner.time_decode_graph(b, 20), []
        print(f"tp={tp} max_model_len={max_len} bucket {b:3d}: " + " ".join(
            f"rank{i} {ms:.3f} ms" for i, ms in enumerate([local, *rest])), flush=True)
    llm.shutdown()
