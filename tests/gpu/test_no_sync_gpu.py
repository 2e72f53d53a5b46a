"""No host synchronisation inside a training step (issue 7: "no per-layer host syncs"): after warm-up, a patched
model's packed step -- forward with the fused loss, backward, fused AdamW -- runs under
``torch.cuda.set_sync_debug_mode("error")``, which raises on any call that waits for the GPU (``.item()``,
``.tolist()``, a blocking host-to-device copy, ``nonzero``...). The batch comes from hf_accel's packing collator
(``cu_seq_lens_q`` + ``max_length_q``), pinned and copied without blocking, as ``hf_accel.data.prepare.dataloader_kwargs()``
sets up."""
from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

import hf_accel
from hf_accel.data.collators import DataCollatorForPacking

pytestmark = pytest.mark.gpu


def _model():
    return LlamaForCausalLM(LlamaConfig(
        vocab_size=32000, hidden_size=1024, intermediate_size=4096, num_hidden_layers=4, num_attention_heads=16,
        num_key_value_heads=4, tie_word_embeddings=True, attn_implementation="sdpa"))


def _batches(n, vocab, target_rows=False):
    """Packed steps; with ``target_rows`` prompt-masked (each document's first half) and the collator's target rows."""
    g = torch.Generator().manual_seed(0)
    collate = DataCollatorForPacking(pad_token_id=0, max_tokens=None, target_rows=target_rows)
    out = []
    for i in range(n):
        lengths = [300 + 40 * i, 17, 900, 64 + i]
        features = [{"input_ids": torch.randint(1, vocab, (n_tok,), generator=g).tolist()} for n_tok in lengths]
        if target_rows:
            for f in features:
                f["labels"] = [-100] * (len(f["input_ids"]) // 2) + f["input_ids"][len(f["input_ids"]) // 2:]
        out.append({k: v.pin_memory() if torch.is_tensor(v) else v for k, v in collate(features).items()})
    return out


@pytest.mark.parametrize("compile_layers,target_rows", [(False, False), (True, False), (True, True)])
def test_training_step_never_waits_for_the_gpu(compile_layers, target_rows):
    torch.manual_seed(0)
    model = _model().cuda().to(torch.bfloat16).train()
    hf_accel.patch(model, fused_ce=True, compile=compile_layers)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=True)

    def train_step(batch):
        batch = {k: v.cuda(non_blocking=True) if torch.is_tensor(v) else v for k, v in batch.items()}
        loss = model(**batch, use_cache=False).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.detach()

    batches = _batches(6, model.config.vocab_size, target_rows)
    for batch in batches[:3]:  # warm-up: kernel JIT, compilation, the recompile that makes lengths dynamic
        train_step(batch)
    torch.cuda.synchronize()
    losses = []
    torch.cuda.set_sync_debug_mode("error")
    try:
        for batch in batches[3:]:
            losses.append(train_step(batch))
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert all(torch.isfinite(x) for x in losses)


def _sync_guard():
    """A Trainer callback: any host sync from step 3 to step 6 raises (CUDA's sync debug mode)."""
    import transformers

    class SyncGuard(transformers.TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            if state.global_step == 3:
                torch.cuda.synchronize()
                torch.cuda.set_sync_debug_mode("error")

        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step == 6:
                torch.cuda.set_sync_debug_mode("default")

    return SyncGuard()


def test_trainer_steps_never_wait_for_the_gpu(tmp_path):
    """hf_accel.Trainer (packing, fused loss, throughput meter, non-blocking batch copies) between logging steps:
    no host sync from steps 3 to 6, with TrainingArguments' defaults: transformers' own per-step NaN/inf loss check
    (``logging_nan_inf_filter=True``) reads the loss back, and the Trainer turns it off while it trains (its guard
    covers it on the device)."""
    import transformers

    from hf_accel.training.trainer import AccelArguments, Trainer

    torch.manual_seed(0)
    model = _model().cuda()
    g = torch.Generator().manual_seed(1)
    data = [{"input_ids": torch.randint(1, 32000, (int(n),), generator=g).tolist()}
            for n in torch.randint(16, 900, (64,), generator=g)]
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path), max_steps=8, per_device_train_batch_size=4, bf16=True, logging_steps=100,
        save_strategy="no", report_to="none", dataloader_num_workers=2)
    trainer = Trainer(model=model, args=args, train_dataset=data, accel=AccelArguments(fused_ce=True),
                      callbacks=[_sync_guard()])
    try:
        trainer.train()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert trainer.state.global_step == 8


def test_sft_trainer_steps_never_wait_for_the_gpu(tmp_path):
    """hf_accel.SFTTrainer on TRL's own data path (SFTConfig(packing=True): BFD packing, padding-free rows collated in
    the training process), SFTConfig's defaults otherwise: no host sync from steps 3 to 6. The TRL route's 5% behind
    the harness loop on Llama-1B (run 41) is GPU idle time if a step waits for the GPU (issue 69c)."""
    import datasets
    import trl

    from hf_accel.data.default_task import build_tokenizer
    from hf_accel.training.trl_trainer import SFTTrainer

    torch.manual_seed(0)
    model = _model().cuda()
    g = torch.Generator().manual_seed(1)
    rows = [torch.randint(3, 32000, (int(n),), generator=g).tolist()
            for n in torch.randint(16, 900, (256,), generator=g)]
    args = trl.SFTConfig(output_dir=str(tmp_path), max_steps=8, per_device_train_batch_size=4, max_length=1024,
                         packing=True, bf16=True, logging_steps=100, save_strategy="no", report_to="none")
    trainer = SFTTrainer(model=model, args=args, train_dataset=datasets.Dataset.from_dict({"input_ids": rows}),
                         processing_class=build_tokenizer(), callbacks=[_sync_guard()])
    try:
        trainer.train()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert trainer.state.global_step == 8
