"""Stage 3b, what is kept for backward: checkpoint policies (``checkpointing``), which layers and ops they target
(``targets``), the ``budget:`` policy (``budget``) and its plans from a probe forward (``plan``), the offline memory estimate (``estimate``), offloaded
checkpoint inputs (``offload``) and decoder MLPs run in checkpointed token chunks at long context (``mlp_chunks``).

May import: ``hf_accel.errors`` and ``hf_accel.attention.kernels`` (to keep attention outputs under op-level
checkpointing). Never the trainer.
"""
