"""What replaces stock ops on a patched model: the chunked linear cross-entropy (``cross_entropy``, its autograd
functions ``ce_functions`` and their Triton row kernel ``ce_kernel``), liger's fused norms / SwiGLU bound per
instance (``ops``), PEFT LoRA's autocast cast skip (``lora_casts``) and inductor-compiled decoder layers
(``compiling``).

May import: ``hf_accel.errors`` and ``hf_accel.memory.targets`` (to find decoder layers). Never the trainer.
"""
