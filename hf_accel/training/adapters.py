"""Saving a PEFT adapter from a model whose layers sit inside wrappers: FSDP's activation checkpointing
(``CheckpointWrapper``), FSDP1 units, or ``torch.compile``.

peft picks an adapter's entries out of a state dict by the names of the model's modules (``named_modules``), and those
names keep the wrappers' segments (``layers.0._checkpoint_wrapped_module.self_attn.q_proj.lora_A``). The state dicts
that a save starts from drop them: accelerate's full state dict under FSDP2 (torch DCP's ``get_model_state_dict``) and
``CheckpointWrapper``'s own ``state_dict`` hook. Then no key matched and ``PeftModel.save_pretrained`` wrote an empty
adapter (a 40-byte ``adapter_model.safetensors``). Here the state dict is keyed by the names peft sees, peft selects the
adapter, and the segments are dropped again, so the file's keys are those a fresh ``PeftModel.from_pretrained`` loads.
"""
from __future__ import annotations

import os

import torch

from ..errors import CheckpointError

ADAPTER_WEIGHTS_NAME = "adapter_model.safetensors"
# what wrappers add to a module's name and what state dicts leave out
WRAPPER_SEGMENTS = ("_checkpoint_wrapped_module.", "_fsdp_wrapped_module.", "_orig_mod.")


def is_peft_model(model: torch.nn.Module) -> bool:
    return hasattr(model, "peft_config") and hasattr(model, "save_pretrained")


def plain_name(name: str) -> str:
    """``name`` without the wrappers' segments (the name a state dict gives the same tensor)."""
    for segment in WRAPPER_SEGMENTS:
        name = name.replace(segment, "")
    return name


def _names_peft_sees(model: torch.nn.Module) -> dict[str, str]:
    """plain name -> the name peft derives from ``named_modules`` (it drops one leading ``_fsdp_wrapped_module.``).
    Read from each module's own parameters and buffers: ``CheckpointWrapper.named_parameters`` drops its segment."""
    names = {}
    for module_name, module in model.named_modules(remove_duplicate=False):
        for attr in (*module._parameters, *module._buffers):
            name = f"{module_name}.{attr}" if module_name else attr
            names[plain_name(name)] = name.removeprefix("_fsdp_wrapped_module.")
    return names


def _keyed_as_peft_reads(model: torch.nn.Module, state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``state_dict`` keyed as ``get_peft_model_state_dict`` matches keys: PEFT 0.22 drops torch's FSDP and
    checkpoint-wrapper segments from the names it derives itself (``remove_torch_wrapper_names``) and reads plain keys;
    0.21 derives them from ``named_modules`` with the wrappers' segments in (``_names_peft_sees``)."""
    try:
        from peft.utils.integrations import remove_torch_wrapper_names  # noqa: F401 - present from PEFT 0.22
    except ImportError:
        names = _names_peft_sees(model)
        return {names.get(key, key): value for key, value in state_dict.items()}
    return {plain_name(key): value for key, value in state_dict.items()}


def adapter_state_dict(model: torch.nn.Module, state_dict: dict[str, torch.Tensor],
                       adapter_name: str = "default") -> dict[str, torch.Tensor]:
    """The entries of ``adapter_name`` in ``state_dict`` (the whole model's, e.g. gathered from FSDP shards), keyed as
    ``PeftModel.save_pretrained`` keys them for an unwrapped model (``...q_proj.lora_A.weight``)."""
    from peft import get_peft_model_state_dict

    keyed = _keyed_as_peft_reads(model, state_dict)
    selected = get_peft_model_state_dict(model, state_dict=keyed, adapter_name=adapter_name,
                                         save_embedding_layers=_embedding_layers(model, adapter_name))
    return {plain_name(key): value for key, value in selected.items()}


def _embedding_layers(model: torch.nn.Module, adapter_name: str) -> bool | str:
    """PEFT's ``save_embedding_layers``: "auto", except where its check can only end in a warning and False: the base
    model is a local folder without config.json (a GGUF checkpoint's), so it can compare no vocabulary size and
    "assumes that the vocabulary was not modified". Embedding layers among the targets are saved either way."""
    from peft.utils.constants import EMBEDDING_LAYER_NAMES

    config = model.peft_config[adapter_name]
    base = getattr(config, "base_model_name_or_path", None)
    targets = getattr(config, "target_modules", None) or ()
    if isinstance(targets, str) or any(name in targets for name in EMBEDDING_LAYER_NAMES):
        return "auto"
    if base and os.path.isdir(base) and not os.path.exists(os.path.join(base, "config.json")):
        return False
    return "auto"


def save_adapter(model: torch.nn.Module, output_dir: str, state_dict: dict[str, torch.Tensor]) -> None:
    """Write every adapter of PEFT ``model`` as ``save_pretrained`` lays it out (``default`` in ``output_dir``, another
    adapter in ``output_dir/<name>``), its tensors taken from ``state_dict``. Call on the process that writes.

    Raises CheckpointError, before writing anything, if an adapter would be saved with no tensors."""
    from safetensors.torch import save_file

    adapters = {name: adapter_state_dict(model, state_dict, name) for name in model.peft_config}
    for name, tensors in adapters.items():
        if not any(torch.is_tensor(t) for t in tensors.values()):
            sample = ", ".join(list(state_dict)[:3]) or "none"
            raise CheckpointError(
                f"PEFT adapter {name!r} would be saved to {output_dir} with no tensors: none of the {len(state_dict)} "
                f"state-dict keys (first: {sample}) is one of its parameters. The state dict must be the whole "
                "model's, gathered on this process (under FSDP: accelerate's get_state_dict with FULL_STATE_DICT, "
                "called on every rank). Nothing was written.")
    # peft writes the config (inference mode, base model, auto-mapping) and the model card; the weights follow
    embeddings = "auto" if any(_embedding_layers(model, name) == "auto" for name in model.peft_config) else False
    model.save_pretrained(output_dir, state_dict={}, safe_serialization=True, save_embedding_layers=embeddings)
    for name, tensors in adapters.items():
        folder = output_dir if name == "default" else os.path.join(output_dir, name)
        tensors = {k: v.detach().to("cpu", copy=True).contiguous() for k, v in tensors.items() if torch.is_tensor(v)}
        save_file(tensors, os.path.join(folder, ADAPTER_WEIGHTS_NAME), metadata={"format": "pt"})
