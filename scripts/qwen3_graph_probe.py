"""Qwen3 (dummy qwen3-0.6b, bf16): CUDA graphs vs eager greedy tokens, with the fused in-place q/k norm
and with the two-norm reference path; prints where the outputs first differ.
Usage: PYTHONPATH=. python scripts/qwen3_graph_probe.py"""

import sys

import pageflash.model.llama as llama
from pageflash import LLM, SamplingParams

sys.path.insert(0, "tests/gpu")
from test_engine_gpu import GREEDY, PROMPTS  # noqa: E402


def run(**kw):
    llm = LLM("qwen3-0.6b", load_format="dummy", max_model_len=512, num_kv_blocks=512, **kw)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


orig = llama._fused_qk_norm
for fused in (True, False):
    llama._fused_qk_norm = orig if fused else (lambda qkv, w: None)
    for dtype in ("bfloat16", "float32"):
        eager, graphs = run(dtype=dtype, enforce_eager=True), run(dtype=dtype)
        eager2 = run(dtype=dtype, enforce_eager=True)
        diffs = [(i, next(j for j, (a, b) in enumerate(zip(e, g)) if a != b)) for i, (e, g) in enumerate(zip(eager, graphs)) if e != g]
        print(f"fused={fused} {dtype}: graphs==eager {not diffs} first diffs (prompt, pos) {diffs}; eager repeat equal {eager == eager2}")
