"""Stage 2 and 4, the batch's layout and the attention kernel: ``varlen`` turns a batch's metadata into one
``VarlenBatch`` per forward (cu_seqlens, computed once), ``hf_attention`` is the seam transformers calls (our
``AttentionInterface`` name and mask function), ``kernels/`` holds one file per backend plus the registry that picks one
by declared capability, and ``flash_mha`` is the drop-in ``nn.MultiheadAttention``.

May import: ``hf_accel.errors`` only. Kernels know no model; model families (``hf_accel.patches``) call in here.
"""
