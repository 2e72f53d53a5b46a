"""Which configuration each stock anchor is, as data (issue 70): whose stack, the settings that project documents as
its fastest for the workload, where it says so, the documented options left out and why, and the other stock
configurations of the same question. Where two stock configurations compete (TRL's QLoRA with and without Liger,
with and without PEFT's kbit preparation), both run and the faster of the same run is the anchor
(`report.add_ratios`, `tables.summary_table`).

TRL's configurations are built from their `TrlRecipe` (train.run_trl reads it), so what a configuration runs and what
this table says it runs cannot part: tests/test_bench_anchors.py builds each one's trainer arguments through a
stand-in trainer and checks them against the table, and the table against TRL's own code (what its SFTTrainer does
with those settings, on the CPU). bench.py prints the table of a run's stock configurations into its record
(`anchors`, `anchor_revision`); benchmarks/HISTORY.md marks rows of records made before a configuration's
definition last changed (`REDEFINED`)."""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Callable

FA4 = "flash_attention_4"
# bumped whenever an anchor's (or a headline row's) definition changes; each record carries the revision it ran with
ANCHOR_REVISION = 2

_TRL_DOCS = ("TRL 1.16 SFTConfig / SFTTrainer (docs 'Reducing memory usage' and 'Speeding up training': packing "
             "with BFD, which turns padding-free on, with a FlashAttention kernel; 'Liger Kernel Integration': "
             "use_liger_kernel=True; 'PEFT integration': SFTTrainer(peft_config=LoraConfig(...)), a 4-bit base "
             "loaded with BitsAndBytesConfig and passed as is)")


@dataclass(frozen=True)
class TrlRecipe:
    """What a TRL configuration sets beyond the harness's shared settings (steps, learning rate, token budget, bf16,
    fused AdamW). Prompt-masked data always goes in TRL's prompt-completion form (`completion_mask`) with
    `completion_only_loss=True`; LoRA workloads always get their adapters from `peft_config`; checkpointing is the
    workload's (TRL's default is on)."""

    attn_implementation: str = FA4  # the fastest attention transformers offers these families for packed rows
    packing_strategy: str = "bfd"  # TRL's default: best-fit decreasing, and with packing=True padding-free
    loss_type: str = "nll"  # TRL 1.16's only loss that computes the workload's loss ("dft" is another objective)
    liger: bool = False  # SFTConfig(use_liger_kernel=True): Liger's layer kernels (TRL keeps its own LM head)
    quantized: bool = False  # the base in bitsandbytes NF4, loaded with a BitsAndBytesConfig (QLoRA)
    kbit_preparation: bool = False  # PEFT's prepare_model_for_kbit_training on the 4-bit base before the trainer


@dataclass(frozen=True)
class Anchor:
    config: str
    project: str
    settings: str  # in words, as the project names them
    documented: str  # where the project says so
    trl: TrlRecipe | None = None  # TRL configurations: what run_trl is given
    competes_with: tuple[str, ...] = ()  # stock configurations answering the same question (the faster is the anchor)
    left_out: tuple[str, ...] = ()  # documented options not run here, each with why

    def record(self) -> dict[str, Any]:
        """What a bench.py record prints of this anchor."""
        out = {k: v for k, v in asdict(self).items() if v not in (None, ())}
        out["trl"] = None if self.trl is None else asdict(self.trl)
        return out


_TRL_LEFT_OUT = (
    "model_init_kwargs={'use_kernels': True} (the Hub kernels TRL 1.16 names as use_liger_kernel's successor): they "
    "download from the Hub, which the benchmark machines cannot reach",
    "gradient_checkpointing_kwargs={'selective': True} (TRL's selective checkpointing): its policy saves the "
    "attention ops the torch dispatcher sees; flash-attn-4 launches its kernels outside it, so with FA4 it recomputes "
    "what full checkpointing does (read in trl/models/selective_activation_checkpointing.py; not measured)",
    "loss_type='dft': a different objective (Dynamic Fine-Tuning), not the workload's loss",
    "activation_offloading=True: saves memory, adds host copies (slower by design)",
)
_LIGER_PAIR = ("trl-fa4-packed", "trl-fa4-packed-liger")
_QLORA_GROUP = ("trl-qlora", "trl-qlora-noliger", "trl-qlora-kbit", "unsloth-qlora")

ANCHORS: dict[str, Anchor] = {a.config: a for a in [
    Anchor("trl-fa4-packed", "TRL", "SFTTrainer, packing=True (BFD, padding-free), attn_implementation="
           "'flash_attention_4', loss_type='nll'; LoRA through peft_config; prompt-masked data through "
           "completion_mask + completion_only_loss=True", _TRL_DOCS, TrlRecipe(),
           competes_with=_LIGER_PAIR[1:] + ("unsloth",), left_out=_TRL_LEFT_OUT),
    Anchor("trl-fa4-packed-liger", "TRL + Liger", "as trl-fa4-packed, plus use_liger_kernel=True (Liger's norms, "
           "RoPE and SwiGLU; TRL 1.16 keeps its own chunked LM head; with LoRA on MoE experts liger_kernel_config="
           "{'swiglu': False}: Liger's fused experts take no LoRA)", _TRL_DOCS, TrlRecipe(liger=True),
           competes_with=_LIGER_PAIR[:1] + ("unsloth",), left_out=_TRL_LEFT_OUT),
    Anchor("trl-qlora", "TRL + Liger", "TRL's QLoRA: the NF4 base (bf16 compute) passed as loaded, "
           "SFTTrainer(peft_config=LoraConfig(...)) (TRL makes the adapters bf16 and does not run PEFT's "
           "prepare_model_for_kbit_training: norms, embeddings and LM head stay bf16), packing=True (BFD, "
           "padding-free), flash_attention_4, use_liger_kernel=True", _TRL_DOCS,
           TrlRecipe(liger=True, quantized=True), competes_with=tuple(c for c in _QLORA_GROUP if c != "trl-qlora"),
           left_out=_TRL_LEFT_OUT),
    Anchor("trl-qlora-noliger", "TRL", "as trl-qlora without use_liger_kernel (TRL 1.16 marks the flag deprecated)",
           _TRL_DOCS, TrlRecipe(quantized=True),
           competes_with=tuple(c for c in _QLORA_GROUP if c != "trl-qlora-noliger"), left_out=_TRL_LEFT_OUT),
    Anchor("trl-qlora-kbit", "TRL + PEFT + Liger", "as trl-qlora, the base first through PEFT's "
           "prepare_model_for_kbit_training (norms, embeddings and LM head in fp32; the recipe of PEFT's docs and of "
           "TRL's experimental trainers; the bench's trl-qlora before issue 70)",
           "PEFT docs (quantization guide: prepare_model_for_kbit_training before get_peft_model)",
           TrlRecipe(liger=True, quantized=True, kbit_preparation=True),
           competes_with=tuple(c for c in _QLORA_GROUP if c != "trl-qlora-kbit"), left_out=_TRL_LEFT_OUT),
    Anchor("unsloth", "Unsloth", "FastLanguageModel (bf16) with its LoRA (or full_finetuning=True), its offloaded "
           "checkpointing ('unsloth') where the workload checkpoints, TRL's SFTTrainer packing=True as it patches it",
           "Unsloth docs and notebooks", competes_with=_LIGER_PAIR,
           left_out=("its flash-attn 2 / xformers attention: no flash-attn 2 wheel for the GPU image's torch, and "
                     "xformers did not import beside it (it falls back to SDPA)",)),
    Anchor("unsloth-eager", "Unsloth", "as unsloth with UNSLOTH_COMPILE_DISABLE=1", "Unsloth's own switch",
           competes_with=("unsloth",)),
    Anchor("unsloth-qlora", "Unsloth", "FastLanguageModel(load_in_4bit=True), its LoRA and offloaded checkpointing, "
           "TRL's SFTTrainer packing=True as it patches it", "Unsloth docs and notebooks",
           competes_with=tuple(c for c in _QLORA_GROUP if c != "unsloth-qlora")),
    Anchor("hf-sdpa-padded", "transformers", "Trainer-style padded micro-batches of 8, attn_implementation='sdpa' "
           "(eager where transformers refuses SDPA): the only stock packing-free path, the anchor where stock "
           "packing attends across documents (Falcon)", "transformers docs (attention interface)",
           left_out=("flash_attention_2 for Falcon (its only flash path): flash-attn 2 has no wheel for the GPU "
                     "image (an hour's compile); flash_attention_4 names route Falcon to that class",)),
    Anchor("hf-fa4-padded", "transformers", "padded micro-batches, attn_implementation='flash_attention_4'",
           "transformers docs (attention interface)"),
    Anchor("hf-sdpa-packed", "transformers", "DataCollatorWithFlattening (one row, position_ids), sdpa",
           "transformers docs / the packing blog post"),
    Anchor("liger-sdpa-padded", "Liger", "liger_kernel's kernels applied to the instance (norms, RoPE, SwiGLU, fused "
           "linear cross-entropy) on stock sdpa, padded", "Liger docs"),
]}


def stock_anchors(configs: list[str]) -> dict[str, dict[str, Any]]:
    """The table's records of the stock configurations among `configs` (what bench.py prints into a record)."""
    return {name: ANCHORS[name].record() for name in configs if name in ANCHORS}


@dataclass(frozen=True)
class Redefinition:
    """A configuration whose definition changed at `revision`: records made before it (no `anchor_revision`, or an
    older one) measured `before`, on the workloads `applies` accepts."""

    revision: int
    applies: Callable[[Any], bool]  # the Workload -> whether its rows of this configuration changed
    tag: str  # the short mark on such a row in the runs log
    before: str
    after: str = field(default="")


def _lora(workload: Any) -> bool:
    return bool(workload.lora)


def _qlora(workload: Any) -> bool:
    return "qlora" in workload.name


_PEFT_MODEL_BEFORE = "the bench's own PeftModel (get_peft_model before the trainer) passed to SFTTrainer"
REDEFINED: dict[str, Redefinition] = {
    "trl-qlora": Redefinition(
        2, _qlora, "older anchor",
        "PEFT's prepare_model_for_kbit_training on the NF4 base (fp32 norms, embeddings and LM head) and the bench's "
        "PeftModel passed to SFTTrainer: what TRL's own QLoRA path does not do, slower and several GiB larger "
        "(issue 70); that configuration runs on as trl-qlora-kbit",
        "TRL's QLoRA path: SFTTrainer(peft_config=...) on the base as loaded"),
    "trl-fa4-packed": Redefinition(2, _lora, "older anchor", _PEFT_MODEL_BEFORE,
                                   "SFTTrainer(peft_config=...), TRL's own LoRA path"),
    "trl-fa4-packed-liger": Redefinition(2, _lora, "older anchor", _PEFT_MODEL_BEFORE,
                                         "SFTTrainer(peft_config=...), TRL's own LoRA path"),
    "hf_accel-qlora": Redefinition(
        2, _qlora, "PEFT-prepared base",
        "hf_accel.patch(model) on PEFT's prepare_model_for_kbit_training recipe (fp32 norms, embeddings and LM head); "
        "that configuration runs on as hf_accel-qlora-kbit",
        "hf_accel's recommended recipe: the NF4 base as loaded (bf16 norms, embeddings and LM head)"),
}


def older_definition(config: str, workload_name: str, revision: int | None) -> Redefinition | None:
    """The redefinition a row of `config` in a record of `workload_name` with `revision` (None: before revisions were
    recorded) predates, or None when the row measured the configuration as it is defined now."""
    change = REDEFINED.get(config)
    if change is None or (revision or 1) >= change.revision:
        return None
    from .workloads import WORKLOADS

    workload = WORKLOADS.get(workload_name)
    return change if workload is not None and change.applies(workload) else None


def anchors_text(configs: list[str]) -> str:
    """One line per stock configuration among `configs`: what it runs (for a run's markdown table)."""
    lines = [f"- `{name}` ({ANCHORS[name].project}): {ANCHORS[name].settings}" for name in configs if name in ANCHORS]
    return "" if not lines else "Stock configurations (benchlib.anchors; the fastest of the run is the anchor):\n" + \
        "\n".join(lines)
