"""LoRA adapters over the base model, as vLLM serves them (docs/ARCHITECTURE.md, "LoRA").

request.py: LoRARequest; adapter.py: PEFT folders read and checked against the model; manager.py:
the adapters in host memory (AdapterCache) and which sit in the device's slots (AdapterSlots);
layers.py: the stacked slot weights and the per-token delta of each targeted projection
(kernels/lora_shrink.py, kernels/lora_expand.py on CUDA)."""

from pageflash.lora.request import LoRARequest

__all__ = ["LoRARequest"]
