"""The L2 weight prefetcher (kernels/prefetch.py) on CPU: sizes parsing, the load-mode kernel under
the interpreter, and that a model with a prefetcher that is not active behaves exactly as without.
The CUDA side (graph branches, bitwise logits) is tests/gpu/test_engine_gpu.py."""

import pytest
import torch

from pageflash.kernels.prefetch import WeightPrefetcher, _sinks, l2_prefetch, parse_sizes


def test_parse_sizes():
    assert parse_sizes("o=16, qkv=0.5") == {"o": 16 << 20, "qkv": 1 << 19}
    assert parse_sizes("") == {}
    with pytest.raises(ValueError, match="kind=MiB"):
        parse_sizes("attn=4")
    with pytest.raises(ValueError, match="kind=MiB"):
        parse_sizes("o")


def test_load_mode_reads_the_requested_head_of_the_tensor():
    """The load kernel's per-program sums add up to the sum of exactly the first nbytes."""
    w = torch.randn(300, 70)
    n = 5000
    l2_prefetch(w, n * 4, "load", programs=3)
    sink = _sinks[w.device]
    grid = -(-n // (1024 * -(-n // (3 * 1024))))
    assert torch.allclose(sink[:grid].sum(), w.view(-1)[:n].sum(), rtol=1e-5, atol=1e-3)


def test_bad_arguments():
    with pytest.raises(ValueError, match="mode"):
        l2_prefetch(torch.zeros(4), 16, "nope")
    with pytest.raises(ValueError, match="contiguous"):
        l2_prefetch(torch.zeros(4, 4).t(), 16, "load")
    with pytest.raises(ValueError, match="mode"):
        WeightPrefetcher({"o": 1}, "nope")


def test_set_prefetcher_reaches_every_layer_and_cpu_forks_do_nothing():
    """set_prefetcher gives every layer the prefetcher (and None takes it away); a prefetcher that is
    inactive, or active on CPU tensors, opens no stream and leaves nothing to join."""
    from pageflash.config import ModelConfig
    from pageflash.model.llama import LlamaForCausalLM

    cfg = ModelConfig.from_hf_dict(dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, vocab_size=50,
                                        max_position_embeddings=64, rms_norm_eps=1e-5,
                                        architectures=["LlamaForCausalLM"]))
    model = LlamaForCausalLM(cfg, 64)
    pf = WeightPrefetcher({"o": 1 << 20, "qkv": 1 << 20})
    model.set_prefetcher(pf)
    assert all(m.prefetcher is pf for m in (model, model.layers[0], model.layers[0].self_attn, model.layers[1].mlp))
    for active in (False, True):
        pf.active = active
        pf.fork("o", model.layers[0].self_attn.o_proj.weight)
        assert pf._stream is None and not pf._pending
        pf.join()
    model.set_prefetcher(None)
    assert model.layers[0].self_attn.prefetcher is None
