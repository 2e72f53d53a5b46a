"""Stage 3b, what is kept for backward: checkpoint policies (``checkpointing``), which layers and ops they target
(``targets``), the ``budget:`` policy (``budget``), its probe forward (``plan``) and planner (``planner``), the offline
memory estimate (``estimate``), offloaded checkpoint inputs (``offload``), spaced checkpoints whose inputs are rebuilt
in backward (``spacing``) and decoder MLPs run in checkpointed token chunks at long context (``mlp_chunks``).

May import: ``hf_accel.errors`` and ``hf_accel.attention.kernels`` (to keep attention outputs under op-level
checkpointing). Never the trainer.
"""
