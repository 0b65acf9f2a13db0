"""A request as the scheduler sees it: tokens so far, how many have KV computed, and its status."""

from __future__ import annotations

import enum
from typing import Any, Optional

import torch

from pageflash.engine.sampler import SeedStream
from pageflash.outputs import Logprob, RequestMetrics
from pageflash.sampling_params import SamplingParams


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED = "finished"


class Request:
    """One sequence. Parallel sampling (n > 1) runs one Request until its prompt is computed, then
    forks n - 1 siblings that share its KV blocks (each sibling is a Request with its own index).

    The scheduler only reasons about token counts: num_tokens (prompt + output), num_computed_tokens
    (with KV in the cache), and spec_token_ids (draft tokens to verify this step).

    With async scheduling a sampled token may still be on the device while the next step is
    scheduled: num_pending counts those (0 or 1 at scheduling time, up to 2 while the next step is
    launched); they are part of num_tokens but not yet of token_ids, and pending_row is the row of
    the in-flight step's sampled tokens that holds the newest one.
    """

    def __init__(
        self,
        request_id: str,
        prompt: Optional[str],
        prompt_token_ids: list[int],
        params: SamplingParams,
        arrival_time: float,
        index: int = 0,
        group_id: Optional[str] = None,
        seeds: Optional[SeedStream] = None,
    ) -> None:
        self.request_id = request_id  # unique per sequence (siblings get "<group_id>#<index>")
        self.group_id = group_id or request_id  # the user's request id
        self.index = index
        self.prompt = prompt
        self.prompt_token_ids = prompt_token_ids
        self.params = params
        self.token_ids: list[int] = list(prompt_token_ids)
        self.num_computed_tokens = 0
        self.status = Status.WAITING
        self.seeds = seeds  # a seeded request's generators, keyed by output position (sampler.SeedStream)
        self.spec_token_ids: list[int] = []
        self.num_pending = 0  # sampled on the device, not yet in token_ids (async scheduling)
        self.pending_row = -1
        self.spec_state: Any = None  # proposer's per-request state
        self.grammar: Any = None  # structured outputs: the llguidance matcher of this sequence
        self.bad_words: tuple[tuple[int, ...], ...] = ()  # params.bad_words tokenized (LLMEngine)
        self.pooling: Any = None  # a PoolingParams: an embedding request, finished at its prompt's end
        self.lora: Any = None  # a lora.adapter.LoRAAdapter: the adapter this request runs under (None: the base)
        self.lora_slot = 0  # its device slot while running (0: none)
        self.lora_request: Any = None  # the LoRARequest that named it (RequestOutput.lora_request)
        self.num_cached_tokens: Optional[int] = None  # prompt tokens found in the prefix cache at first admission
        self.embedding: Optional[list[float]] = None
        self.logprobs: Optional[list[dict[int, Logprob]]] = [] if params.logprobs is not None else None
        self.text_offsets: Optional[list[int]] = [] if params.logprobs is not None else None
        self.prompt_logprobs: Optional[list[Optional[dict[int, Logprob]]]] = (
            [None] if params.prompt_logprobs is not None else None)
        self.cumulative_logprob: float = 0.0
        self.finish_reason: Optional[str] = None
        self.stop_reason: Any = None
        self.forked = params.n == 1  # whether the n siblings exist yet
        self.detokenizer: Any = None
        self.output_text = ""
        self.metrics = RequestMetrics(arrival_time=arrival_time)

    @property
    def needs_prompt_logprobs(self) -> bool:
        """Whether prompt logprobs are still to be computed (then no prefix-cache hits for it)."""
        return self.prompt_logprobs is not None and len(self.prompt_logprobs) < len(self.prompt_token_ids)

    @property
    def prefix_salt(self) -> Any:
        """The root of this request's prefix-cache hash chain: KV computed under one adapter (or the
        base model) never serves another."""
        return None if self.lora is None else ("lora", self.lora.uid)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids) + self.num_pending

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[len(self.prompt_token_ids) :]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - len(self.prompt_token_ids)

    @property
    def generator(self) -> Optional[torch.Generator]:
        """A seeded request's generator for the token it samples next (output position
        num_output_tokens + num_pending); None without a seed."""
        return None if self.seeds is None else self.seeds.at(self.num_output_tokens + self.num_pending)

    def generator_at(self, pos: int, salt: int = 0) -> Optional[torch.Generator]:
        """A seeded request's generator for output position pos and a use (SeedStream's salts)."""
        return None if self.seeds is None else self.seeds.at(pos, salt)

    @property
    def is_finished(self) -> bool:
        return self.status == Status.FINISHED

    def __repr__(self) -> str:
        return (f"Request({self.request_id!r}, status={self.status.value}, tokens={self.num_tokens}, "
                f"computed={self.num_computed_tokens})")
