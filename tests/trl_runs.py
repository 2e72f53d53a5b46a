"""What the tests comparing hf_accel's TRL trainers with TRL's own share: the first step's gradients, and TRL configs
for a short, deterministic CPU run (fp32: TRL defaults to bf16 autocast, on the CPU too)."""
from __future__ import annotations

import torch
import transformers

# every run: no checkpointing, no sampler shuffle, one process, constant learning rate, no weight decay
CPU_RUN = dict(save_strategy="no", report_to="none", use_cpu=True, seed=0, disable_tqdm=True,
               dataloader_num_workers=0, lr_scheduler_type="constant", weight_decay=0.0, gradient_checkpointing=False,
               bf16=False, logging_steps=1)


class FirstGrads(transformers.TrainerCallback):
    """Every parameter's gradient just before the first optimizer step."""

    def __init__(self):
        self.grads: dict[str, torch.Tensor] = {}

    def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
        if not self.grads:
            self.grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def trl_config(config_cls, tmp_path, defaults: dict, **kw):
    """``config_cls`` (SFTConfig, DPOConfig, GRPOConfig) for a short CPU run in ``tmp_path``: CPU_RUN, then the
    test file's ``defaults``, then ``kw``."""
    return config_cls(**{"output_dir": str(tmp_path), **CPU_RUN, **defaults, **kw})


def in_backward() -> bool:
    """Whether this runs inside autograd's backward (a checkpointed layer's recompute), not a forward of the step."""
    return torch._C._current_graph_task_id() != -1


def lora_policy():
    """A tiny Llama policy under PEFT LoRA r=4 on q/v/down with non-zero B factors (seeded): it differs from its
    adapter-disabled reference at the first step, so the rewards, margins and KL mean something. A fresh one each
    call (the same weights)."""
    import peft

    from tests.tiny_models import make

    lora = peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj", "down_proj"],
                           init_lora_weights=False)
    torch.manual_seed(3)
    return peft.get_peft_model(make("llama-gqa", seed=0), lora).train()


def lora_policy_recording_checkpointing():
    """A tiny Llama policy under PEFT LoRA (non-zero B: it differs from its adapter-disabled reference) and the list
    that gets, at every training forward of its first decoder layer (not a checkpoint's recompute), every layer's
    ``gradient_checkpointing`` flag: (model, seen, number of layers)."""
    import peft

    from hf_accel.memory.checkpointing import decoder_layers
    from tests.tiny_models import make

    lora = peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj"],
                           init_lora_weights=False)
    torch.manual_seed(3)
    model = peft.get_peft_model(make("llama-gqa", seed=0), lora).train()
    layers = decoder_layers(model.get_base_model())
    seen: list[tuple[bool, ...]] = []

    def record(module, args):
        if torch.is_grad_enabled() and not in_backward():  # a forward, not a recompute
            seen.append(tuple(bool(layer.gradient_checkpointing) for layer in layers))

    layers[0].register_forward_pre_hook(record)
    return model, seen, len(layers)
