"""Stage 3b, what is kept for backward: checkpoint policies (``checkpointing``: their face and ``policy_from_spec``;
the fixed ones in ``policies``), which layers and ops they target (``targets``), the run a policy is applied for
(``context``: ``policy.apply(model, context)``), the ``budget:`` policy (``budget``), its probe forward (``plan``; the
layers it runs: ``layer_kinds``) and planner (``planner``), the training state's bytes (``state``), the offline
memory estimate (``estimate``), offloaded checkpoint inputs (``offload``), spaced checkpoints whose inputs are rebuilt
in backward (``spacing``), decoder MLPs run in checkpointed token chunks at long context (``mlp_chunks``) and what
the machine lets the process take (``machine``: host memory available, a CUDA device's cap). Imports go downward
only (no cycle: tests/test_layout.py): ``checkpointing`` -> ``budget`` -> ``policies`` / ``plan`` / ``state``;
``estimate`` above them.

May import: ``hf_accel.errors`` and ``hf_accel.attention.kernels`` (to keep attention outputs under op-level
checkpointing). Never the trainer.
"""
