"""The canvas protocol for transformers' own causal-LM classes run bidirectionally (LLaDA, Dream native paths)."""

from __future__ import annotations

import torch

from lm_eval_spot.adapters.prefix_attention import NAME
from lm_eval_spot.adapters.ragged import FullAttention, RaggedPass, head_sees_only

NO_MASK = {"full_attention": None, "sliding_attention": None}  # masking is the pass's job


class NativeCanvas:
    """A transformers causal-LM class (Llama, Qwen2, ...) run bidirectionally through the project's attention
    (`use_prefix_attention`, which the adapter selects): explicit positions, every position attends every other of
    its own row's sequence, only the kept positions reach the LM head."""

    ragged = True

    def __init__(self, shifted: bool) -> None:
        self.shifted = shifted

    def forward(self, model: torch.nn.Module, ids: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        R, N = ids.shape
        pos = torch.arange(N, device=ids.device).expand(R, -1)
        keep = keep.to(ids.device)
        return self.run(model, ids, pos, RaggedPass([(0, R, N, FullAttention())]),
                        keep.expand(R, -1) if keep.dim() == 1 else keep)

    def run(self, model: torch.nn.Module, ids: torch.Tensor, pos: torch.Tensor, pp: RaggedPass, keep: torch.Tensor
            ) -> torch.Tensor:
        """Rows [B, N] at positions [B, N] with the pass's attention -> raw logits [B, K, V] at keep [B, K]."""
        if model.config._attn_implementation != NAME:
            raise RuntimeError("NativeCanvas needs the model's attention set to the project's (use_prefix_attention)")
        # The model's own forward (hooks on it see the logits); its final norm hands on only each row's kept
        # positions, so the head's one matmul covers every row's block wherever it sits.
        with torch.no_grad(), head_sees_only(model.model.norm, keep):
            return model(input_ids=ids, position_ids=pos, attention_mask=NO_MASK, use_cache=False, logits_to_keep=0,
                         spot_prefix=pp).logits
