"""``PatchReport``: what patch() did to one model, as data and as the text it prints."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class PatchReport:
    """What patch() did: which modules, which backend serves training calls, what was passed over and why."""

    model_type: str
    backend_requested: str
    backend: str
    selection: str
    patched_modules: list[str]
    touches: str
    lora_targets: tuple[str, ...]
    checkpointing: str | None = None
    fused_ops: bool = False
    fused_ce: bool = False
    compiled_layers: int = 0
    precision: str | None = None  # precision="fp8": what was converted and that it changes the computation
    mlp_chunks: str = "off"  # what mlp_chunks resolved to, one line
    speedups: list[str] = field(default_factory=list)  # one line per fused_ce / fused_ops / compile: chosen, and why
    replaced_attn_implementation: str | None = None  # the model's attn_implementation ("eager", "sdpa"): it keeps it
    attentions: str | None = None  # what runs a call asking for attention probabilities (output_attentions=True)
    notes: list[str] = field(default_factory=list)
    # why documents packed in one row would reach each other (or not restart their positions) in the patched model,
    # None where each computes what it computes alone; hf_accel's Trainers pad such a model instead of packing it
    packing: str | None = None

    def __str__(self) -> str:
        lines = [
            f"hf_accel: patched {len(self.patched_modules)} attention modules of a {self.model_type} model "
            f"({self.touches})",
            f"  backend: {self.selection}",
            f"  LoRA targets for this family: {', '.join(self.lora_targets)}",
        ]
        if self.replaced_attn_implementation:
            lines.append(f"  attn_implementation stays {self.replaced_attn_implementation!r} (what transformers reports "
                         "and set_attn_implementation changes); hf_accel's kernel serves training calls and "
                         "unpadded prefills, the reported implementation decode steps, compiled evaluation and, "
                         "outside training, forwards whose padding mask fills a KV cache or hides a slot")
        if self.attentions:
            lines.append(f"  output_attentions=True runs {self.attentions}")
        if self.checkpointing:
            lines.append(f"  checkpointing: {self.checkpointing}")
        if self.fused_ops:
            lines.append("  fused ops: liger-kernel norms / SwiGLU bound to this instance")
        if self.fused_ce:
            lines.append("  fused cross-entropy: training loss from hidden states, no full logits")
        lines.append(f"  mlp_chunks: {self.mlp_chunks}")
        if self.packing:
            lines.append(f"  packing: not kept apart ({self.packing}); hf_accel's Trainers pad this model")
        if self.precision:
            lines.append(f"  precision: {self.precision}")
        if self.compiled_layers:
            lines.append(f"  compiled: {self.compiled_layers} decoder layers' training forwards (torch.compile, "
                         "attention left to the kernel above)")
        lines += [f"  {line}" for line in self.speedups]
        lines += [f"  note: {n}" for n in self.notes]
        return "\n".join(lines)
