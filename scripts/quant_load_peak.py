"""GPU: peak device memory while an engine starts on a random HF checkpoint (8 layers, hidden 1024,
float32) with quantization="int8" (staged: layer by layer, quantized on arrival) and without
quantization, each in a fresh process. Usage: PYTHONPATH=. python scripts/quant_load_peak.py"""

import subprocess
import sys
import tempfile

CHILD = r"""
import sys, torch
sys.path.insert(0, "tests")
from pageflash import LLM
torch.cuda.reset_peak_memory_stats()
llm = LLM(sys.argv[1], quantization=None if sys.argv[2] == "none" else sys.argv[2], dtype="float32",
          num_kv_blocks=64, max_model_len=256, enforce_eager=True)
print(f"{sys.argv[2]}: peak {torch.cuda.max_memory_allocated() / 2**20:.0f} MiB, "
      f"held after start {torch.cuda.memory_allocated() / 2**20:.0f} MiB")
"""


def main() -> None:
    sys.path.insert(0, "tests")
    from hf_ref import make_random_hf_folder

    cfg = dict(vocab_size=8000, hidden_size=1024, intermediate_size=4096, num_hidden_layers=8,
               max_position_embeddings=512, rms_norm_eps=1e-6, tie_word_embeddings=False, model_type="llama",
               architectures=["LlamaForCausalLM"], num_attention_heads=16, num_key_value_heads=4,
               rope_theta=10000.0)
    with tempfile.TemporaryDirectory() as d:
        folder = make_random_hf_folder(d, cfg, std=0.05)
        for q in ("none", "int8"):
            subprocess.run([sys.executable, "-c", CHILD, folder, q], check=True)


if __name__ == "__main__":
    main()
