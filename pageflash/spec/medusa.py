"""Medusa heads (Cai et al. 2024): extra heads on the target's last hidden state that predict the
tokens after the next one.

The target's LM head reads the final (normed) hidden state h_t of position t and predicts token
t + 1. Head i (0-based) reads the same h_t and predicts token t + 2 + i. Each head is a stack of
residual blocks ``x + SiLU(W x + b)`` (W zero-initialized, so an untrained head starts as the LM
head itself) followed by an LM head: the target's own (``shared_lm_head``, the default: few
parameters, quick to train) or a private copy initialized from it (the Medusa paper's choice).

File format (``save_heads`` / ``load_heads``): one safetensors file with the heads' tensors and the
config as JSON in its metadata (key ``medusa_config``); a copy of the config is written next to it
as ``<file>.json`` for people and tools.

:class:`MedusaProposer` turns the heads' predictions at a request's last hidden state into a chain
(each head's argmax) or a SpecInfer tree (top-b of each head per level). Drafts are deterministic,
so stochastic verification treats them as one-hot (lossless).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from typing import Optional

import torch
from torch import nn

from pageflash.spec.proposer import ProposalRequest, truncate_tree
from pageflash.spec.tree import DraftTree, ExpansionConfig, tree_from_level_candidates


@dataclass(frozen=True)
class MedusaConfig:
    hidden_size: int
    vocab_size: int
    num_heads: int = 4
    num_layers: int = 1
    shared_lm_head: bool = True
    base_model: str = ""

    def __post_init__(self) -> None:
        for name in ("hidden_size", "vocab_size", "num_heads", "num_layers"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"MedusaConfig.{name} must be a positive integer, got {v!r}")


class ResBlock(nn.Module):
    def __init__(self, hidden_size: int) -> None:
        super().__init__()
        self.linear = nn.Linear(hidden_size, hidden_size)
        nn.init.zeros_(self.linear.weight)
        nn.init.zeros_(self.linear.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + nn.functional.silu(self.linear(x))


class MedusaHeads(nn.Module):
    """forward(hidden [N, H], lm_head_weight [V, H]) -> logits float32 [num_heads, N, V]."""

    def __init__(self, config: MedusaConfig, lm_head_weight: Optional[torch.Tensor] = None) -> None:
        super().__init__()
        self.config = config
        h, v = config.hidden_size, config.vocab_size
        self.blocks = nn.ModuleList(
            nn.Sequential(*[ResBlock(h) for _ in range(config.num_layers)]) for _ in range(config.num_heads)
        )
        self.lm_heads: Optional[nn.ModuleList] = None
        if not config.shared_lm_head:
            self.lm_heads = nn.ModuleList(nn.Linear(h, v, bias=False) for _ in range(config.num_heads))
            if lm_head_weight is not None:
                with torch.no_grad():
                    for head in self.lm_heads:
                        head.weight.copy_(lm_head_weight)

    def forward(self, hidden: torch.Tensor, lm_head_weight: torch.Tensor) -> torch.Tensor:
        """hidden: [N, H] final-normed hidden states; lm_head_weight: [V, H] the target's LM head."""
        x = hidden.to(self.blocks[0][0].linear.weight.dtype)
        outs = []
        for i, block in enumerate(self.blocks):
            y = block(x)
            w = lm_head_weight.to(y.dtype) if self.lm_heads is None else self.lm_heads[i].weight
            outs.append(nn.functional.linear(y, w).float())
        return torch.stack(outs)


def save_heads(heads: MedusaHeads, path: str) -> None:
    from safetensors.torch import save_file

    cfg = json.dumps(asdict(heads.config))
    tensors = {k: v.detach().float().contiguous().cpu() for k, v in heads.state_dict().items()}
    save_file(tensors, path, metadata={"medusa_config": cfg})
    with open(path + ".json", "w") as f:
        f.write(json.dumps(asdict(heads.config), indent=2) + "\n")


def load_heads(path: str, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32) -> MedusaHeads:
    """Heads saved by :func:`save_heads`. Raises ValueError for a file that is not one."""
    import os

    from safetensors import safe_open
    from safetensors.torch import load_file

    if not os.path.isfile(path):
        raise ValueError(f"medusa_path {path!r} does not exist (train heads with `pageflash train-medusa`)")
    try:
        with safe_open(path, "pt") as f:
            meta = f.metadata() or {}
    except Exception as e:  # not a safetensors file
        raise ValueError(f"medusa_path {path!r} is not a safetensors file of Medusa heads: {e}") from e
    raw = meta.get("medusa_config")
    if raw is None and os.path.isfile(path + ".json"):
        with open(path + ".json") as f:
            raw = f.read()
    if raw is None:
        raise ValueError(f"medusa_path {path!r} has no medusa_config (not written by `pageflash train-medusa`)")
    config = MedusaConfig(**json.loads(raw))
    heads = MedusaHeads(config)
    heads.load_state_dict(load_file(path))
    return heads.to(device=device, dtype=dtype).eval()


class MedusaProposer:
    """Drafts from Medusa heads at each request's last hidden state (``ProposalRequest.hidden_states``).

    hidden_states is h_t, the final hidden state of the row whose LM-head output was the root (the
    token at t + 1, sampled by the previous step), so tree level d (the token at t + 1 + d, d >= 1)
    is head d - 1: no shift. tree None: a chain of the first k heads' argmaxes. tree: SpecInfer
    expansion where level d takes the top branching[d - 1] tokens of head d - 1 whatever the parent
    (``tree_from_level_candidates``).
    """

    def __init__(
        self,
        heads: MedusaHeads,
        lm_head_weight: torch.Tensor,
        tree: Optional[ExpansionConfig] = None,
        name: str = "medusa",
    ) -> None:
        self.heads = heads
        self.lm_head_weight = lm_head_weight
        self.tree = tree
        self.name = name
        if tree is not None and tree.depth > heads.config.num_heads:
            raise ValueError(
                f"speculative_config: tree has {tree.depth} levels but the Medusa file has only "
                f"{heads.config.num_heads} heads"
            )

    @torch.inference_mode()
    def propose(self, requests: list[ProposalRequest]) -> list[Optional[DraftTree]]:
        out: list[Optional[DraftTree]] = [None] * len(requests)
        active = [i for i, r in enumerate(requests) if r.num_speculative_tokens > 0 and r.hidden_states is not None]
        if not active:
            return out
        hidden = torch.stack([requests[i].hidden_states.reshape(-1) for i in active])
        logits = self.heads(hidden, self.lm_head_weight)  # [K, B, V]
        if self.tree is None:
            depth = min(self.heads.config.num_heads, max(requests[i].num_speculative_tokens for i in active))
            toks = logits[:depth].argmax(-1).T.tolist()  # [B, depth]
            for b, i in enumerate(active):
                out[i] = DraftTree.chain(toks[b][: requests[i].num_speculative_tokens])
            return out
        widths = self.tree.branching
        top = [logits[d].topk(widths[d], dim=-1).indices.tolist() for d in range(self.tree.depth)]  # [D][B][w]
        for b, i in enumerate(active):
            tree = tree_from_level_candidates([top[d][b] for d in range(self.tree.depth)], self.tree)
            tree = truncate_tree(tree, requests[i].num_speculative_tokens)
            out[i] = tree if len(tree) else None
        return out
