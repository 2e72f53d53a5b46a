"""How many tokens one chunk of the fused loss takes: sized by the memory its logits hold, so the loss
(``hf_accel.fused.cross_entropy``) and the offline estimate (``memory.estimate``) count the same chunk."""
from __future__ import annotations

CHUNK_BYTES = 512 * 2**20  # automatic chunks: one chunk's logits take about this much


def auto_chunk_size(num_tokens: int, vocab: int, element_size: int, budget_bytes: int = CHUNK_BYTES) -> int:
    """The largest power-of-two token chunk whose (chunk, vocab) logits fit in `budget_bytes` (at least 128)."""
    fit = max(1, budget_bytes // max(1, vocab * element_size))
    chunk = max(128, 1 << (fit.bit_length() - 1))
    return min(chunk, max(1, num_tokens))
