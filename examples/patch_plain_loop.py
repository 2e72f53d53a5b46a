"""hf_accel.patch + a plain PyTorch loop over packed (padding-free) batches. Offline, CPU, seconds.

    python examples/patch_plain_loop.py
"""
import torch
from transformers import LlamaConfig, LlamaForCausalLM

import hf_accel
from hf_accel.data.collators import DataCollatorForPacking
from hf_accel.data.default_task import build_tokenizer, make_examples
from hf_accel.data.prepare import tokenize_example

tokenizer = build_tokenizer()
torch.manual_seed(0)
model = LlamaForCausalLM(LlamaConfig(
    vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, use_cache=False))
print(hf_accel.patch(model, backend="auto"))  # attention only; returns what it did

data = [tokenize_example(x, tokenizer) for x in make_examples(256, seed=0)]
collate = DataCollatorForPacking(pad_token_id=tokenizer.pad_token_id)  # one packed row per batch
loader = torch.utils.data.DataLoader(data, batch_size=16, shuffle=True, collate_fn=collate)
optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
model.train()
for step, batch in enumerate(loader):
    # num_items_in_batch: the loss is a sum over targets / their count, independent of how documents are grouped
    num_items = batch["labels"][:, 1:].ne(-100).sum()
    loss = model(**batch, num_items_in_batch=num_items).loss
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    if step % 4 == 0:
        print(f"step {step:2d}  loss {loss.item():.3f}  tokens {batch['input_ids'].numel()}")
hf_accel.unpatch(model)  # back to stock transformers, exactly
