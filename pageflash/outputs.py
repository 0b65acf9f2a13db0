"""What the engine hands back: RequestOutput with one CompletionOutput per sample (vLLM's shapes)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional, Union


@dataclass
class Logprob:
    """Log-probability of one token; rank is 1-based among the vocabulary (1 = most likely)."""

    logprob: float
    rank: Optional[int] = None
    decoded_token: Optional[str] = None


@dataclass
class CompletionOutput:
    """One generated sequence. text and token_ids are cumulative."""

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: Optional[float] = None
    logprobs: Optional[list[dict[int, Logprob]]] = None
    finish_reason: Optional[str] = None  # "stop" | "length" | "abort"
    stop_reason: Union[int, str, None] = None  # the stop string or stop token id that ended it
    # With logprobs: where each token's text starts in text, as the detokenizer built it (a token
    # holding part of a character starts where that character will; past a stop string's cut: the cut)
    text_offsets: Optional[list[int]] = None
    lora_request: Optional[Any] = None  # the LoRARequest it ran under (vLLM's); None: the base model

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    """Wall-clock times (time.monotonic()) of one request's life."""

    arrival_time: float
    first_scheduled_time: Optional[float] = None
    first_token_time: Optional[float] = None
    finished_time: Optional[float] = None
    num_preemptions: int = 0
    # speculative decoding: per-step accepted counts (empty when not speculating)
    spec_accepted: list[int] = field(default_factory=list)


@dataclass
class RequestOutput:
    request_id: str
    prompt: Optional[str]
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: Optional[RequestMetrics] = None
    # SamplingParams.prompt_logprobs: None for the first prompt token, then per token a dict holding
    # its own logprob and the top ones (vLLM's format); filled as the prompt's chunks are computed
    prompt_logprobs: Optional[list[Optional[dict[int, Logprob]]]] = None
    # an embedding request (PoolingParams): its vector; outputs is then empty
    embedding: Optional[list[float]] = None
    # prompt tokens served from the prefix cache (vLLM's num_cached_tokens); None before scheduling
    num_cached_tokens: Optional[int] = None
    # vLLM's, for code that reads them: the LoRARequest the request ran under (None: the base model);
    # encoder-decoder and disaggregated-serving fields, None here (decoder-only models, one engine)
    lora_request: Optional[Any] = None
    encoder_prompt: Optional[str] = None
    encoder_prompt_token_ids: Optional[list[int]] = None
    kv_transfer_params: Optional[dict[str, Any]] = None

    def __repr__(self) -> str:
        return (
            f"RequestOutput(request_id={self.request_id!r}, prompt={self.prompt!r}, "
            f"num_prompt_tokens={len(self.prompt_token_ids)}, outputs={self.outputs!r}, finished={self.finished})"
        )


@dataclass
class EmbeddingOutput:
    """One prompt's embedding (vLLM's)."""

    embedding: list[float]


@dataclass
class EmbeddingRequestOutput:
    """What LLM.embed returns per prompt (vLLM's shape): ``outputs.embedding``."""

    request_id: str
    outputs: EmbeddingOutput
    prompt_token_ids: list[int]
    finished: bool = True
