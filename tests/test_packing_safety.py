"""A patched model whose packed documents would reach each other (token mixing outside the seam: MiniMax's lightning
attention layers; its own positions: BART's decoder) says so in its report, and hf_accel's Trainers never pack it:
the Trainer pads, the TRL drop-in refuses TRL's packing before training, DPO / GRPO keep TRL's padded rows."""
from __future__ import annotations

import copy

import pytest
import torch
import transformers

import hf_accel
from hf_accel.errors import ConfigurationError
from hf_accel.training.trainer import Trainer
from tests.tiny_models import VOCAB, make


def _minimax():
    from transformers import MiniMaxConfig, MiniMaxForCausalLM

    config = MiniMaxConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=4,
                           num_experts_per_tok=2, layer_types=["full_attention", "linear_attention"],
                           block_size=4, pad_token_id=0, use_cache=False)
    torch.manual_seed(0)
    return MiniMaxForCausalLM(config)


def test_a_model_mixing_tokens_outside_the_seam_reports_that_packed_documents_meet():
    """The live reference: patched MiniMax's packed row is not each document alone (its lightning attention layer
    carries the first document into the second); the report names that layer; Llama's reports nothing."""
    ref = _minimax().train()
    ours = copy.deepcopy(ref)
    report = hf_accel.patch(ours)
    ids = torch.randint(1, VOCAB, (1, 14), generator=torch.Generator().manual_seed(0))
    pos = torch.cat([torch.arange(6), torch.arange(8)])[None]
    with torch.no_grad():
        packed = ours(input_ids=ids, position_ids=pos).logits
        alone = torch.cat([ref(input_ids=ids[:, :6]).logits, ref(input_ids=ids[:, 6:]).logits], dim=1)
    assert (packed - alone).abs().max() > 1e-3
    assert report.packing and "decoder layers 1 (MiniMaxDecoderLayer)" in report.packing
    assert "packing: not kept apart" in str(report)
    assert hf_accel.patch(make("llama-gqa")).packing is None


def test_the_trainer_pads_a_model_that_would_not_keep_packed_documents_apart(tmp_path):
    data = [{"input_ids": list(range(3, 3 + n)), "labels": list(range(3, 3 + n))} for n in (5, 7, 6, 4)]
    args = transformers.TrainingArguments(output_dir=str(tmp_path / "minimax"), max_steps=1, report_to="none",
                                          use_cpu=True, save_strategy="no", disable_tqdm=True)
    trainer = Trainer(model=_minimax(), args=args, train_dataset=data)
    assert trainer.data_collator.fallback_to_padding and trainer.patch_report.packing
    batch = trainer.data_collator(data[:2])
    assert batch["input_ids"].shape[0] == 2  # one document a row
    args = transformers.TrainingArguments(output_dir=str(tmp_path / "llama"), max_steps=1, report_to="none",
                                          use_cpu=True, save_strategy="no", disable_tqdm=True)
    assert not Trainer(model=make("llama-gqa"), args=args, train_dataset=data).data_collator.fallback_to_padding


def test_the_trl_drop_in_refuses_trl_packing_it_cannot_keep_apart(tmp_path):
    trl = pytest.importorskip("trl")
    from datasets import Dataset

    from hf_accel.data.default_task import build_tokenizer
    from hf_accel.patching import STATE_ATTR

    data = Dataset.from_list([{"input_ids": list(range(3, 3 + n))} for n in (5, 7, 6, 4)])
    model = _minimax()
    args = trl.SFTConfig(output_dir=str(tmp_path / "sft"), packing=True, max_steps=1, report_to="none",
                         use_cpu=True, save_strategy="no", disable_tqdm=True, max_length=32)
    with pytest.raises(ConfigurationError, match="packing=True.*MiniMaxDecoderLayer.*packing=False"):
        hf_accel.SFTTrainer(model=model, args=args, train_dataset=data, processing_class=build_tokenizer())
    assert STATE_ATTR not in model.__dict__  # left unpatched
    args = trl.SFTConfig(output_dir=str(tmp_path / "padded"), packing=False, padding_free=False, max_steps=1,
                         report_to="none", use_cpu=True, save_strategy="no", disable_tqdm=True, max_length=32)
    trainer = hf_accel.SFTTrainer(model=_minimax(), args=args, train_dataset=data, processing_class=build_tokenizer())
    assert trainer.patch_report.packing
