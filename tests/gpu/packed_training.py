"""The GPU tests' packed training run: the same document lengths every step, new random tokens each step (no
document predicts the next), AdamW on the trainable parameters, the loss of each step read after it."""
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


def train(model, steps: int, lr: float) -> list[float]:
    """Train ``model`` (on CUDA) ``steps`` packed steps; its losses."""
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr)
    losses = []
    for batch in packed_batches(model.config.vocab_size, steps):
        loss = model(**{k: v.cuda() for k, v in batch.items()}, use_cache=False).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses
