"""``hf_accel.DPOTrainer``: TRL's ``DPOTrainer`` with hf_accel's patch on the policy and the reference model, and
the chosen / rejected forwards run padding-free on one packed row.

TRL 1.16's DPO data path: ``DataCollatorForPreference`` stacks ``[chosen..., rejected...]`` as 2B right-padded rows
(prompt + completion, ``completion_mask`` on the completion), and ``_compute_loss`` calls the policy (and the
reference: a separate model, or the PEFT policy with its adapter disabled) as ``model(input_ids, attention_mask,
labels, fused_lm_head=True)``. TRL's ``add_fused_lm_head`` answers that call with per-token log-probabilities from a
chunked LM head (``FusedCausalLMOutput``; no ``(tokens, vocab)`` logits). TRL's own ``padding_free`` option is
switched off in 1.16 ("temporarily unavailable after a refactor").

This trainer binds one more layer on that call (``bind_packed_forward``): the 2B padded rows become one packed row of
their real tokens, each at the position the padded forward gives it (its column: restarting at 0 per sequence for
right-padded rows), with the ``cu_seq_lens`` the patched attention seam reads; the first token of each sequence gets
no label (in a padded row nothing predicts it either); TRL's chunked head scores the packed row, and every per-token
field comes back to its padded ``(2B, S - 1)`` place, zero elsewhere. TRL then
computes whatever it computes from them (every ``loss_type``, ``ld_alpha``, WPO weights, f-divergences, metrics) on
the same numbers as for the padded batch: nothing of TRL's loss is replaced, so no loss variant is refused.

Left to TRL unchanged: ``precompute_ref_log_probs`` (it runs while TRL's ``__init__`` builds the trainer, before the
patch: padded, stock attention), vision-language models (refused), evaluation and generation (the padded call, or
none, reaches the same forward: packed too when it comes with ``fused_lm_head=True``).
"""
from __future__ import annotations

import logging
import types
import weakref
from collections.abc import Callable
from typing import Any

import torch
import trl

from ..attention.hf_attention import record_inner_forward
from ..binding import bind_forward
from ..errors import ConfigurationError, UnsupportedVersion
from ..memory.checkpointing import reapply_checkpointing
from ..patching import patch
from .trainer import AccelArguments, AccelMixin
from .trl_trainer import refuse_vision

logger = logging.getLogger("hf_accel")

IGNORE_INDEX = -100


class PackedTRLMixin:
    """What ``DPOTrainer`` and ``GRPOTrainer`` add to a TRL trainer that scores sequences through TRL's fused LM
    head: the patched reference model, the packed forwards, the checkpoint policy kept across TRL's reference calls.
    Sits before ``AccelMixin`` in the MRO; ``_accel_finish_setup`` runs after ``_accel_setup``."""

    _name = "hf_accel trainer"
    _rows = "rows"  # what the packed rows are, for the notes
    _left_padded = False  # whether TRL's scoring rows come left-padded (GRPO's prompts): packed by the patched seam only

    _config: str  # the name of TRL's config class for this trainer (each trainer's own)
    _batches = "per_device_train_batch_size=..."  # what forms its batches, for prepare_args' message

    def _accel_before_trl(self, model: Any, args: Any, accel: AccelArguments | None) -> tuple[Any, AccelArguments]:
        """Before TRL's constructor: TRL's config (its defaults where none is given, bf16 on a GPU), ``accel``
        checked against what the trainer serves, a vision model refused."""
        if args is None:
            on_gpu = torch.cuda.is_available()
            args = getattr(trl, self._config)(output_dir=f"hf_accel-{self._config.removesuffix('Config').lower()}",
                                              report_to="none", bf16=on_gpu, use_cpu=not on_gpu)
        accel = accel or AccelArguments()
        prepare_args(args, accel, self._name, f"{self._config}({self._batches})")
        refuse_vision(model, self._name)
        return args, accel

    def _accel_after_trl(self, accel: AccelArguments) -> None:
        """After TRL's constructor: the model TRL built refused if it is a vision model, then the patch, the
        reference model and the packing."""
        refuse_vision(self.model, self._name)
        self._accel_setup(accel)
        self._accel_finish_setup()

    def _accel_finish_setup(self) -> None:
        self._accel_reference()
        self._accel_pack()

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        # TRL turns checkpointing off and on again (with its own arguments: every layer) around generation and the
        # reference forward of a PEFT policy: put the policy's per-layer choice back before and after the step's
        # forwards (DPO's reference call comes after the policy's, GRPO's generation before)
        unwrapped = self.accelerator.unwrap_model(self.model)
        reapply_checkpointing(unwrapped)
        try:
            return super().compute_loss(model, inputs, return_outputs=return_outputs,
                                        num_items_in_batch=num_items_in_batch)
        finally:
            reapply_checkpointing(unwrapped)

    def _accel_fused_ce(self) -> Any:
        return False  # TRL's fused LM head (add_fused_lm_head) answers every scoring forward: nothing for ours to bind

    def _accel_check_explicit(self) -> None:
        if self.accel.fused_ce is True:
            raise ConfigurationError(
                f"AccelArguments(fused_ce=True) is not served by {self._name}: it needs per-token log-probabilities, "
                "which TRL's chunked LM head (add_fused_lm_head) already computes without full logits. Pass "
                "fused_ce='auto' or False.")
        super()._accel_check_explicit()

    def _reference_note(self) -> str:
        return "reference: the policy with its PEFT adapter disabled (TRL's use_adapter)"

    def _accel_reference(self) -> None:
        """Patch a separate reference model like the policy (attention seam only: it runs under no_grad, so no
        checkpointing, compile or fused loss). A PEFT policy with no ``ref_model`` is its own reference."""
        self.ref_patch_report = None
        ref = self._unwrapped_ref()
        if ref is None:
            self._accel_note(self._reference_note())
            return
        if not self.accel.patch:
            return
        options = self.accel.patch_options(fused_ce=False, compile=False, checkpointing=None, mlp_chunks=False)
        self.ref_patch_report = patch(ref, options=options)
        logger.info("hf_accel: reference model: %s", self.ref_patch_report)
        self._accel_note("reference: its own model, patched (attention seam only: it runs under no_grad)")

    def _unwrapped_ref(self) -> torch.nn.Module | None:
        if getattr(self, "ref_model", None) is None:
            return None
        return self.accelerator.unwrap_model(self.ref_model)

    def _accel_pack(self) -> None:
        if not self.accel.packing:
            self._accel_note(f"{self._rows}: TRL's padded rows (AccelArguments(packing=False))")
            return
        from trl.trainer import utils as trl_utils

        if not hasattr(trl_utils, "add_fused_lm_head"):  # the call this packs: TRL's fused LM head (TRL 1.16)
            raise UnsupportedVersion(
                f"{self._name} packs the scoring forwards TRL makes through its fused LM head (add_fused_lm_head, "
                f"TRL 1.16); TRL {trl.__version__} has none. Install trl>=1.16, or pass AccelArguments(packing=False).")
        policy = self.accelerator.unwrap_model(self.model)
        base = policy.get_base_model() if hasattr(policy, "get_base_model") else policy
        patched = self.accel.patch
        if patched and self.patch_report is not None and self.patch_report.packing:
            self._accel_note(f"{self._rows}: TRL's padded rows (the patched model would not keep packed documents "
                             f"apart: {self.patch_report.packing})")
            return
        if not patched and not _stock_keeps_documents_apart(base):
            # e.g. stock Falcon before transformers 5.24 builds its mask without position_ids: packed documents would
            # attend to each other
            self._accel_note(f"{self._rows}: TRL's padded rows (stock attention of this model does not keep packed "
                             "documents apart; the patched model packs)")
            return
        self._undo_packing = [bind_packed_forward(base, seam_reads_cu_seqlens=patched)]
        # the padding logged is what the forwards compute: none where the rows pack (bind_packed_forward)
        self._accel_packs_padded_rows = patched or not self._left_padded
        ref = self._unwrapped_ref()
        if ref is not None:
            self._undo_packing.append(bind_packed_forward(ref, seam_reads_cu_seqlens=patched))
        self._accel_note(f"{self._rows}: padding-free, one packed row per scoring forward (policy and reference), "
                         "log-probs from TRL's chunked LM head")

    def _accel_note(self, line: str) -> None:
        logger.info("hf_accel: %s", line)
        if self.patch_report is not None and line not in self.patch_report.notes:
            self.patch_report.notes.append(line)


def prepare_args(args: Any, accel: AccelArguments, name: str, batches: str) -> None:
    """Refuse what the trainer ``name`` does not serve; keep TRL from enabling full checkpointing on top of
    ``accel.checkpointing``."""
    if accel.max_tokens_per_batch is not None:
        raise ConfigurationError(
            f"AccelArguments(max_tokens_per_batch={accel.max_tokens_per_batch}) is not served by {name} (TRL forms "
            f"the batches). Pass max_tokens_per_batch=None and size batches with {batches}.")
    if accel.checkpointing is not None:
        for field in ("gradient_checkpointing", "activation_checkpointing"):  # 5.23 renamed the field
            if hasattr(args, field):
                setattr(args, field, False)


class ReferenceTrainerMixin(PackedTRLMixin):
    """The constructor TRL's trainers with a reference model share (``(model, ref_model, args, ...)``: DPO, KTO):
    ``accel`` checked, vision models refused, then TRL's own constructor, then the patch and the packing."""

    def __init__(self, model: Any, ref_model: Any = None, args: Any = None, *pos, accel: AccelArguments | None = None,
                 **kwargs) -> None:
        args, accel = self._accel_before_trl(model, args, accel)
        super().__init__(model, ref_model, args, *pos, **kwargs)
        self._accel_after_trl(accel)

    def _reference_note(self) -> str:
        if self.precompute_ref_logps:
            return "reference: log-probs precomputed by TRL before the patch (padded, stock attention)"
        return super()._reference_note()


class DPOTrainer(ReferenceTrainerMixin, AccelMixin, trl.DPOTrainer):
    """``trl.DPOTrainer`` plus ``accel`` (an ``AccelArguments``). ``accel.packing`` (default True): the chosen and
    rejected forwards of the policy and of the reference model run padding-free on one packed row; False keeps TRL's
    padded rows (the patch still applies). ``accel.patch`` patches the policy and a separate reference model.
    ``accel.max_tokens_per_batch`` is not served here (TRL's ``per_device_train_batch_size`` forms the batches)."""

    _name = "hf_accel.DPOTrainer"
    _config = "DPOConfig"
    _rows = "chosen / rejected"


def bind_packed_forward(model: torch.nn.Module, *, seam_reads_cu_seqlens: bool = True) -> Callable[[], None]:
    """Bind a ``forward`` on this causal LM (whose forward TRL's ``add_fused_lm_head`` has bound) that runs a
    ``fused_lm_head=True`` call on padded rows as one packed row and hands back the padded-shape output. Every other
    call goes to the forward it wraps unchanged. Returns the action that restores that forward.

    Each token keeps the position the padded forward gives it (its column: transformers' default ``position_ids``),
    so a left-padded row (GRPO's prompts) computes what it computed padded, absolute position embeddings included.
    The packed row's documents are then told by ``cu_seq_lens``, which hf_accel's patched attention reads
    (``seam_reads_cu_seqlens``); stock attention tells them by ``position_ids`` restarting at 0, so an unpatched
    model packs only rows that start at column 0 (right padding) and leaves the others padded."""
    inner = model.forward

    def forward(self, *args, fused_lm_head: bool = False, **kwargs):
        if not fused_lm_head or _unpackable(args, kwargs) is not None:
            return inner(*args, fused_lm_head=fused_lm_head, **kwargs)
        return packed_fused_call(inner, left_padding=seam_reads_cu_seqlens, **kwargs)

    forward.__signature__ = getattr(inner, "__signature__", None) or _signature_of(inner)
    return bind_forward(model, types.MethodType(forward, model))


def _stock_keeps_documents_apart(model: torch.nn.Module) -> bool:
    from ..facts import stock_keeps_documents_apart
    from .data_loading import model_family

    family = model_family(model)  # a family typed in patches/ may know better than the live check
    return family.stock_keeps_documents_apart(model) if family is not None else stock_keeps_documents_apart(model)


def _signature_of(fn: Callable) -> Any:
    import inspect

    sig = inspect.signature(fn)
    return sig.replace(parameters=[inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD),
                                   *sig.parameters.values()])


def _unpackable(args: tuple, kwargs: dict[str, Any]) -> str | None:
    """Why this fused call stays padded (None: it packs): positional inputs, embeddings or pixel inputs, labels
    already shifted, a layout of its own (position_ids), or no 2-D ids with an attention mask."""
    if args:
        return "positional arguments"
    if kwargs.get("shift_labels") is not None or kwargs.get("position_ids") is not None:
        return "shift_labels / position_ids given"
    if kwargs.get("inputs_embeds") is not None or kwargs.get("pixel_values") is not None:
        return "embeddings or pixel inputs"
    ids, mask, labels = kwargs.get("input_ids"), kwargs.get("attention_mask"), kwargs.get("labels")
    if ids is None or mask is None or labels is None or ids.dim() != 2 or mask.shape != ids.shape:
        return "no (B, S) input_ids, attention_mask and labels"
    return None


def packed_fused_call(inner: Callable, *, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                      labels: torch.Tensor, left_padding: bool = True, **kwargs) -> Any:
    """``inner(fused_lm_head=True, ...)`` on the real tokens of padded ``(B, S)`` rows packed into ``(1, T)``; its
    per-token fields (``(1, T - 1)``) put back at their ``(B, S - 1)`` places, zero on padding. Each row's real tokens
    must be one run (padding left and / or right of it; ``left_padding=False``: right only); other rows (a hole, an
    empty row) go to ``inner`` padded, as they came."""
    batch, seq = input_ids.shape
    layout = _layout_of(attention_mask)
    if layout is None or (not left_padding and layout.left_padded):
        return inner(fused_lm_head=True, input_ids=input_ids, attention_mask=attention_mask, labels=labels, **kwargs)
    device = input_ids.device
    idx = layout.on(device)
    labels_t = labels.reshape(-1).index_select(0, idx["take"]).index_fill(0, idx["starts"], IGNORE_INDEX)
    position_ids = idx["position_ids"][None]
    # the patched model's record of this forward was taken from the padded call: the packed row replaces it
    undo = record_inner_forward(position_ids, idx["cu"], layout.max_length, padding_mask=False)
    try:
        out = inner(fused_lm_head=True, input_ids=input_ids.reshape(-1).index_select(0, idx["take"])[None],
                    position_ids=position_ids, labels=labels_t[None], cu_seq_lens_q=idx["cu"], cu_seq_lens_k=idx["cu"],
                    max_length_q=layout.max_length, max_length_k=layout.max_length, **kwargs)
    finally:
        undo()
    return _unpack_output(out, idx, batch, seq)


_LAST: dict[str, Any] = {}  # one slot: the last attention mask read and its layout


def _layout_of(attention_mask: torch.Tensor) -> _Layout | None:
    """The packing layout of these padded rows; None where a row is empty or its real tokens are not one run.
    DPO's reference forward gets the very mask its policy forward got: its layout is the one already read."""
    last = _LAST.get("mask")
    if last is not None and last() is attention_mask and _LAST["version"] == attention_mask._version:
        return _LAST["layout"]
    batch, seq = attention_mask.shape
    real_bs = attention_mask != 0
    lengths_b = real_bs.sum(1)
    first_b = real_bs.int().argmax(1)  # the first real column (0 for an empty row)
    columns = torch.arange(seq, device=attention_mask.device)
    one_run = real_bs == ((columns >= first_b[:, None]) & (columns < (first_b + lengths_b)[:, None]))
    # the one host read of this mask: the layout (first columns, lengths) and whether each row is one run
    host = torch.cat([first_b, lengths_b, one_run.all().reshape(1)]).tolist()
    firsts, lengths, ok = host[:batch], host[batch:2 * batch], bool(host[-1])
    layout = _Layout(firsts, lengths, seq) if ok and min(lengths) >= 1 else None
    _LAST.update(mask=weakref.ref(attention_mask), version=attention_mask._version, layout=layout)
    return layout


class _Layout:
    """Host-side indices of one batch's packing (built from the first columns and lengths read once). Row ``r``'s
    real tokens are its columns ``firsts[r] .. firsts[r] + lengths[r] - 1``."""

    def __init__(self, firsts: list[int], lengths: list[int], seq: int) -> None:
        starts = [0]
        for n in lengths[:-1]:
            starts.append(starts[-1] + n)
        spans = list(zip(range(len(lengths)), firsts, lengths, starts))
        self.max_length = max(lengths)
        self.left_padded = max(firsts) > 0
        self._on: dict[torch.device, dict[str, torch.Tensor]] = {}
        # packed position t <- padded flat position r * seq + column
        self.take_t = torch.cat([torch.arange(r * seq + f, r * seq + f + n) for r, f, n, _ in spans])
        self.position_ids_t = torch.cat([torch.arange(f, f + n) for _, f, n, _ in spans])  # each token's column
        self.starts_t = torch.tensor(starts)
        self.cu_t = torch.tensor([*starts, starts[-1] + lengths[-1]], dtype=torch.int32)
        # shifted fields (position t predicts t + 1): padded (r, column) <- packed (start + column - first), for the
        # columns first .. first + n - 2 (the last real token predicts nothing of its own row)
        self.src_t = torch.cat([torch.arange(s, s + n - 1) for _, _, n, s in spans])
        self.dst_t = torch.cat([torch.arange(r * (seq - 1) + f, r * (seq - 1) + f + n - 1) for r, f, n, _ in spans])

    def on(self, device: torch.device) -> dict[str, torch.Tensor]:
        """The indices on ``device``, copied once per layout (the policy's and the reference's forwards share them)."""
        if device not in self._on:
            self._on[device] = {
                "take": self.take_t.to(device), "position_ids": self.position_ids_t.to(device),
                "starts": self.starts_t.to(device), "cu": self.cu_t.to(device), "src": self.src_t.to(device),
                "dst": self.dst_t.to(device)}
        return self._on[device]


def _unpack_output(out: Any, idx: dict[str, torch.Tensor], batch: int, seq: int) -> Any:
    """Every ``(1, T - 1)`` per-token field of TRL's ``FusedCausalLMOutput`` at its ``(B, S - 1)`` place."""
    src, dst = idx["src"], idx["dst"]
    for name in ("log_probs", "entropy", "log_sum_sq_probs", "mean_logits", "is_top1", "label_mask"):
        packed = getattr(out, name, None)
        if packed is None:
            continue
        flat = packed.reshape(-1).index_select(0, src)
        padded = flat.new_zeros(batch * (seq - 1)).index_copy(0, dst, flat)
        setattr(out, name, padded.view(batch, seq - 1))
    return out
