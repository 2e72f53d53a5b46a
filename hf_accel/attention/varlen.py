"""The one description of a batch's layout that every attention call shares: where the real tokens sit once the
(B, S) batch is flattened, and where each document starts.

A forward pass computes it once (the first attention layer does, later layers and checkpoint recomputation hit the
memo below) from whichever the caller gave: a collator's ``cu_seq_lens_q`` + ``max_length_q`` (no host sync), or a 2D
padding mask and/or ``position_ids`` that restart per packed document (exactly one host sync).
"""
from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any

import torch

from ..errors import InvalidBatch, UnsupportedModel

INT32_LIMIT = 2**31 - 1


@dataclass(frozen=True)
class VarlenBatch:
    """Varlen metadata of one (B, S) batch.

    cu_seqlens: (num_docs + 1,) int32 on the model's device, offsets into the selected (real) tokens.
    max_seqlen: longest document, a Python int (kernels need it on the host).
    indices:    (num_tokens,) int64 positions of the real tokens in the flattened B*S, or None when every slot is real.
    has_holes:  a masked slot sits between real tokens of a row: a token's distance to another then counts the hole
                in transformers' masks (its sliding windows count slots), not in this layout.
    """

    batch_size: int
    seq_len: int
    cu_seqlens: torch.Tensor
    max_seqlen: int
    indices: torch.Tensor | None
    has_holes: bool = False

    @property
    def num_docs(self) -> int:
        return self.cu_seqlens.numel() - 1

    def unpad(self, x_bshd: torch.Tensor) -> torch.Tensor:
        """(B, S, H, D) -> (T, H, D) keeping only real tokens."""
        x_thd = x_bshd.reshape(self.batch_size * self.seq_len, *x_bshd.shape[2:])
        return x_thd if self.indices is None else x_thd.index_select(0, self.indices)

    def pad(self, x_thd: torch.Tensor) -> torch.Tensor:
        """(T, H, D) -> (B, S, H, D); padding slots are zero."""
        if self.indices is None:
            return x_thd.reshape(self.batch_size, self.seq_len, *x_thd.shape[1:])
        full = x_thd.new_zeros(self.batch_size * self.seq_len, *x_thd.shape[1:])
        full = full.index_copy(0, self.indices, x_thd)
        return full.reshape(self.batch_size, self.seq_len, *x_thd.shape[1:])


def _check_int32(total: int) -> None:
    if total > INT32_LIMIT:
        raise InvalidBatch(
            f"the batch holds {total} token slots, more than int32 cumulative lengths can address ({INT32_LIMIT}); "
            "split it into smaller micro-batches."
        )


def from_cu_seqlens(
    cu_seq_lens: torch.Tensor, max_length: int, batch_size: int, seq_len: int, device: torch.device
) -> VarlenBatch:
    """Trust a collator's metadata over the flattened B*S tokens (no host sync)."""
    _check_int32(batch_size * seq_len)
    if cu_seq_lens.ndim != 1 or cu_seq_lens.numel() < 2:
        raise InvalidBatch(f"cu_seq_lens must be 1D with at least 2 entries, got shape {tuple(cu_seq_lens.shape)}.")
    if isinstance(max_length, torch.Tensor):
        max_length = int(max_length.item())  # host sync, only when a caller passed a tensor
    return VarlenBatch(
        batch_size=batch_size,
        seq_len=seq_len,
        cu_seqlens=cu_seq_lens.to(device=device, dtype=torch.int32),
        max_seqlen=int(max_length),
        indices=None,
    )


def from_mask_and_positions(
    attention_mask: torch.Tensor | None,
    position_ids: torch.Tensor | None,
    batch_size: int,
    seq_len: int,
    device: torch.device,
) -> VarlenBatch:
    """Documents from a 2D padding mask (B, S) and/or position_ids (B or 1, S).

    The real tokens (mask 1) of a row are kept in order; masked slots are dropped wherever they sit (left or right
    padding, or holes inside a row), so a real token sees every earlier real token of its document and no masked one:
    what transformers computes for that mask. A masked slot never starts a document.

    A document starts at a row's first real token and wherever position_ids restart: a real token whose position is
    not above the previous real token's (packed rows restart at 0). Without an attention mask, a document also starts
    wherever positions do not continue the previous token's by +1, transformers' own rule for packed rows given
    without a mask. The whole computation happens on one host copy.
    """
    _check_int32(batch_size * seq_len)
    layout = []
    if attention_mask is not None:
        layout.append(attention_mask.to(torch.long).expand(batch_size, seq_len))
    if position_ids is not None:
        layout.append(position_ids.to(torch.long).expand(batch_size, seq_len))
    if layout:
        # The one host sync of the forward pass: the batch layout comes to the CPU once.
        host = torch.stack(layout).cpu()
    mask_bs = host[0].bool() if attention_mask is not None else torch.ones(batch_size, seq_len, dtype=torch.bool)
    starts_bs = mask_bs & ~_has_real_before(mask_bs)  # each row's first real token
    if position_ids is not None:
        pos_bs = host[-1]
        prev_pos = _previous_real(pos_bs, mask_bs)
        restarts = pos_bs <= prev_pos
        if attention_mask is None:
            restarts |= pos_bs != prev_pos + 1
        starts_bs |= mask_bs & restarts

    has_real_after = _has_real_before(mask_bs.flip(1)).flip(1)
    has_holes = bool((~mask_bs & _has_real_before(mask_bs) & has_real_after).any())
    real_flat = mask_bs.reshape(-1)
    starts_flat = starts_bs.reshape(-1)
    indices = None
    if not bool(real_flat.all()):
        indices = real_flat.nonzero().squeeze(1)
        starts_flat = starts_flat[indices]
    num_tokens = int(starts_flat.numel())
    if num_tokens == 0:
        raise InvalidBatch("the batch has no real token (its attention_mask is all zeros).")
    doc_starts = starts_flat.nonzero().squeeze(1)
    cu = torch.cat([doc_starts, torch.tensor([num_tokens])]).to(torch.int32)
    max_seqlen = int((cu[1:] - cu[:-1]).max())
    return VarlenBatch(
        batch_size=batch_size,
        seq_len=seq_len,
        cu_seqlens=cu.to(device, non_blocking=True),
        max_seqlen=max_seqlen,
        indices=None if indices is None else indices.to(device, non_blocking=True),
        has_holes=has_holes,
    )


def _has_real_before(mask_bs: torch.Tensor) -> torch.Tensor:
    """(B, S) bool: some slot left of this one in its row is real."""
    return torch.nn.functional.pad(mask_bs.cumsum(1)[:, :-1] > 0, (1, 0), value=False)


def _previous_real(values_bs: torch.Tensor, mask_bs: torch.Tensor) -> torch.Tensor:
    """(B, S): for every slot, ``values_bs`` at the nearest real slot to its left in the row (anything where none)."""
    slots = torch.arange(mask_bs.shape[1]).expand_as(mask_bs)
    last_real = torch.where(mask_bs, slots, -1).cummax(1).values  # last real slot at or left of each slot
    before = torch.nn.functional.pad(last_real[:, :-1], (1, 0), value=-1).clamp_min(0)
    return values_bs.gather(1, before)


class IdentityMemo:
    """Single-entry memo keyed by the identity of the tensors a forward pass hands to every layer.

    Weak references make a stale entry (a freed tensor whose id was reused) a miss, never a wrong hit.
    """

    def __init__(self) -> None:
        self._refs: tuple = ()
        self._value: Any = None

    @staticmethod
    def _ref(t):
        return None if t is None else weakref.ref(t)

    def get(self, key: tuple) -> Any:
        if self._value is None or len(key) != len(self._refs):
            return None
        for tensor, ref in zip(key, self._refs):
            if (tensor is None) != (ref is None) or (ref is not None and ref() is not tensor):
                return None
        return self._value

    def put(self, key: tuple, value: Any) -> None:
        self._refs = tuple(self._ref(t) for t in key)
        self._value = value


_memo = IdentityMemo()


def key_padding_from_4d(mask_b1qk: torch.Tensor) -> torch.Tensor:
    """(B, 1, S, S) causal mask (bool, or additive float) -> (B, S) bool of real tokens.

    Every real token sees itself and no padding token is seen, so the diagonal is the padding mask, whether padding
    sits left or right and whether the mask is causal, windowed or block-diagonal over packed documents (transformers
    5.24 builds Falcon's mask from position_ids; 5.17-5.23 did not).
    """
    diagonal = mask_b1qk[:, 0].diagonal(dim1=-2, dim2=-1)
    if diagonal.dtype == torch.bool:
        return diagonal
    return diagonal > torch.finfo(diagonal.dtype).min / 2


def varlen_batch(
    *,
    batch_size: int,
    seq_len: int,
    device: torch.device,
    attention_mask: torch.Tensor | None = None,
    position_ids: torch.Tensor | None = None,
    cu_seq_lens: torch.Tensor | None = None,
    max_length: int | None = None,
) -> VarlenBatch:
    """The batch's VarlenBatch, computed once per forward pass and shared by every layer.

    ``attention_mask`` is a 2D padding mask, or a model's 4D causal mask (reduced to its key padding).
    """
    key = (attention_mask, position_ids, cu_seq_lens)
    hit = _memo.get(key)
    if hit is not None and hit.batch_size == batch_size and hit.seq_len == seq_len:
        return hit
    if attention_mask is not None and attention_mask.ndim == 4:
        attention_mask = key_padding_from_4d(attention_mask)
    for name, layout in (("attention mask", attention_mask), ("position_ids", position_ids)):
        if layout is not None and layout.shape[-1] != seq_len:
            raise UnsupportedModel(
                f"an attention call over {seq_len} positions in a forward whose {name} covers {layout.shape[-1]}: "
                "the model attends over sequences of its own making (e.g. BLT's byte patches), whose documents "
                "hf_accel's seam cannot read from the forward's layout. Train it unpatched (hf_accel.unpatch(model)).")
    if cu_seq_lens is not None and max_length is not None and attention_mask is None:
        value = from_cu_seqlens(cu_seq_lens, max_length, batch_size, seq_len, device)
    else:
        value = from_mask_and_positions(attention_mask, position_ids, batch_size, seq_len, device)
    _memo.put(key, value)
    return value


_chunk_memo: dict[tuple[int, int], tuple[weakref.ref, VarlenBatch]] = {}


def chunked(meta: VarlenBatch, chunk: int) -> VarlenBatch:
    """``meta`` with each document cut into pieces of ``chunk`` tokens counted from the document's start, so a query
    attends only to keys of its own piece (Llama 4's chunked-attention layers): what the document computes alone.
    Memoised per layout: one host read of the boundaries per forward, shared by every chunked layer."""
    hit = _chunk_memo.get((id(meta), chunk))
    if hit is not None and hit[0]() is meta:
        return hit[1]
    bounds = meta.cu_seqlens.tolist()  # host sync: chunked layers only, once per forward
    cut = [start for begin, end in zip(bounds, bounds[1:]) for start in range(begin, end, chunk)] + bounds[-1:]
    value = VarlenBatch(meta.batch_size, meta.seq_len, torch.tensor(cut, dtype=torch.int32).to(meta.cu_seqlens.device),
                        min(meta.max_seqlen, chunk), meta.indices, meta.has_holes)
    if len(_chunk_memo) > 8:
        _chunk_memo.clear()
    _chunk_memo[(id(meta), chunk)] = (weakref.ref(meta), value)
    return value
