"""pageflash: a paged, continuously batched LLM inference engine in Python, PyTorch and Triton.

The public names are imported lazily, so that `import pageflash.kernels` (on a GPU box without the
loaders' dependencies, say) does not pull in the whole engine.
"""

from typing import TYPE_CHECKING

__all__ = ["LLM", "SamplingParams", "StructuredOutputsParams", "BeamSearchParams", "PoolingParams", "RequestOutput",
           "CompletionOutput", "Logprob"]
__version__ = "0.1.0"

_WHERE = {
    "LLM": "pageflash.llm",
    "SamplingParams": "pageflash.sampling_params",
    "StructuredOutputsParams": "pageflash.sampling_params",
    "PoolingParams": "pageflash.sampling_params",
    "BeamSearchParams": "pageflash.beam_search",
    "RequestOutput": "pageflash.outputs",
    "CompletionOutput": "pageflash.outputs",
    "Logprob": "pageflash.outputs",
}

if TYPE_CHECKING:  # pragma: no cover
    from pageflash.llm import LLM
    from pageflash.outputs import CompletionOutput, Logprob, RequestOutput
    from pageflash.beam_search import BeamSearchParams
    from pageflash.sampling_params import PoolingParams, SamplingParams, StructuredOutputsParams


def __getattr__(name: str):
    if name in _WHERE:
        import importlib

        return getattr(importlib.import_module(_WHERE[name]), name)
    raise AttributeError(f"module 'pageflash' has no attribute {name!r}")
