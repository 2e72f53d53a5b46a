"""The GPU tests' packed training run: the same document lengths every step, new random tokens each step (no
document predicts the next), AdamW on the trainable parameters, the loss of each step read after it.

``padded_rows=True`` trains on the same documents and tokens as a right-padded batch (one document a row): the reference
where stock attention does not keep packed documents apart as they are alone (Llama 4's chunked layers cut a packed
row into chunks from the row's start, not each document's). Its loss averages the same targets as the packed row's."""
from __future__ import annotations

import torch

LENGTHS = [300, 17, 900, 1200, 64, 513]


def packed_batches(vocab: int, steps: int):
    """``steps`` packed rows of LENGTHS' documents."""
    g = torch.Generator().manual_seed(0)
    pos = torch.cat([torch.arange(n) for n in LENGTHS])[None]
    for _ in range(steps):
        ids = torch.randint(0, vocab, (1, sum(LENGTHS)), generator=g)
        yield dict(input_ids=ids, position_ids=pos, labels=ids.masked_fill(pos == 0, -100))


def padded(batch: dict) -> dict:
    """``batch``'s packed row as a right-padded batch, one document a row (labels -100 on the padding)."""
    docs = batch["input_ids"][0].split(LENGTHS)
    ids = torch.zeros(len(docs), max(LENGTHS), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, doc in enumerate(docs):
        ids[row, :len(doc)], mask[row, :len(doc)] = doc, 1
    return dict(input_ids=ids, attention_mask=mask, labels=ids.masked_fill(mask == 0, -100))


def train(model, steps: int, lr: float, padded_rows: bool = False, device: str = "cuda") -> list[float]:
    """Train ``model`` (on ``device``) ``steps`` packed steps (``padded_rows``: the same documents right-padded); its
    losses."""
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr)
    losses = []
    for batch in packed_batches(model.config.vocab_size, steps):
        batch = padded(batch) if padded_rows else batch
        loss = model(**{k: v.to(device) for k, v in batch.items()}, use_cache=False).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses
