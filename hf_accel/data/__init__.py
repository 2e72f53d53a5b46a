"""Stage 1, what becomes a batch: collators (padding-free rows, cu_seq_lens), token-budget samplers, tokenization with
completion-only labels, and the embedded default task.

May import: ``hf_accel.errors`` only. Nothing here knows a model, a kernel or a trainer.
"""
from .collators import DataCollatorForPacking, DataCollatorForPadding
from .prepare import DataWaitTimer, dataloader_kwargs, pretokenize, sft_lengths, tokenize_example, tokenize_messages
from .sampling import LengthGroupedBatchSampler, TokenBudgetBatchSampler, best_fit_decreasing

__all__ = ["DataCollatorForPacking", "DataCollatorForPadding", "DataWaitTimer", "LengthGroupedBatchSampler",
           "TokenBudgetBatchSampler", "best_fit_decreasing", "dataloader_kwargs", "pretokenize", "sft_lengths",
           "tokenize_example", "tokenize_messages"]
