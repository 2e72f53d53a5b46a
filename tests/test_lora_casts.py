"""PEFT LoRA under autocast without the input's fp32 round trip (hf_accel.fused.lora_casts): bit-identical losses and
gradients to PEFT's own casting, on a bf16 model with fp32 adapters under bf16 autocast (CPU autocast here, CUDA in
the benchmark), with fewer fp32 copies; PEFT's path wherever the cast is not a pure round trip."""
from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import hf_accel
from hf_accel.fused import lora_casts
from tiny_models import VOCAB, make

peft = pytest.importorskip("peft")


class Fp32Copies(TorchDispatchMode):
    """Counts bf16 -> fp32 copies (what PEFT's input cast dispatches to)."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.ops.aten._to_copy.default and kwargs.get("dtype") == torch.float32 \
                and args[0].dtype == torch.bfloat16:
            self.count += 1
        return func(*args, **kwargs)


def lora_model(name: str, dropout: float = 0.0, use_dora: bool = False):
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(0)
    model = make(name).to(torch.bfloat16).train()
    targets = ["q_proj", "v_proj", "down_proj"] if name.startswith("llama") else ["query_key_value", "dense"]
    config = LoraConfig(r=4, lora_alpha=8, target_modules=targets, init_lora_weights=False, lora_dropout=dropout,
                        use_dora=use_dora)
    return get_peft_model(model, config)  # adapters in fp32 (PEFT's autocast_adapter_dtype default)


def step(model, seed: int = 3):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (2, 13), generator=g)
    model.zero_grad(set_to_none=True)
    counter = Fp32Copies()
    with torch.autocast("cpu", dtype=torch.bfloat16), counter:
        loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return loss.detach(), grads, counter.count


@pytest.mark.parametrize("name", ["llama-gqa", "neox-parallel", "falcon-7b-mqa"])
def test_skipping_the_round_trip_is_bit_identical(name):
    model = lora_model(name)
    assert next(p for n, p in model.named_parameters() if "lora_A" in n).dtype == torch.float32
    hf_accel.patch(model, backend="reference")
    loss, grads, copies = step(model)
    lora_casts.unbind(model.get_base_model())  # PEFT's own cast, same attention kernel
    ref_loss, ref_grads, ref_copies = step(model)
    assert torch.equal(loss, ref_loss)
    assert grads.keys() == ref_grads.keys() and any("lora_A" in n for n in grads)
    for n in ref_grads:
        assert torch.equal(grads[n], ref_grads[n]), n
    assert copies < ref_copies  # the skip happened


def test_lora_added_after_patch_is_bound_and_unpatch_removes_it():
    from peft import LoraConfig, get_peft_model

    base = make("llama-gqa").to(torch.bfloat16).train()
    hf_accel.patch(base, backend="reference")
    model = get_peft_model(base, LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False))
    _, _, copies = step(model)
    layers = [m for m in model.modules() if isinstance(m, peft.tuners.lora.layer.Linear)]
    assert layers and all("_cast_input_dtype" in m.__dict__ for m in layers)
    lora_casts.unbind(base)
    _, _, peft_copies = step(model)
    assert copies < peft_copies
    lora_casts.bind(base)
    hf_accel.unpatch(model)
    assert not any("_cast_input_dtype" in m.__dict__ for m in layers)


@pytest.mark.parametrize("kind", ["dropout", "dora", "no-autocast-dtype-match"])
def test_cast_kept_where_it_is_not_a_pure_round_trip(kind):
    model = lora_model("llama-gqa", dropout=0.1 if kind == "dropout" else 0.0, use_dora=kind == "dora")
    if kind == "no-autocast-dtype-match":
        model = model.to(torch.float16)  # fp16 inputs under bf16 autocast: the cast is not undone exactly
        for n, p in model.named_parameters():
            if "lora_" in n:
                p.data = p.data.float()
    layer = next(m for m in model.modules() if isinstance(m, peft.tuners.lora.layer.Linear))
    x = torch.randn(3, layer.in_features, dtype=next(layer.base_layer.parameters()).dtype)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert not lora_casts.round_trip_only(layer, x, torch.float32)
    assert not lora_casts.round_trip_only(layer, x.bfloat16(), torch.float32)  # autocast off


def test_round_trip_detected_for_plain_lora():
    model = lora_model("llama-gqa")
    layer = next(m for m in model.modules() if isinstance(m, peft.tuners.lora.layer.Linear))
    x = torch.randn(3, layer.in_features, dtype=torch.bfloat16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert lora_casts.round_trip_only(layer, x, torch.float32)
        assert not lora_casts.round_trip_only(layer, x, torch.bfloat16)
        assert not lora_casts.round_trip_only(layer, x.float(), torch.float32)


def test_any_adapter_with_dropout_keeps_the_cast():
    """A second adapter with dropout on the same layer (usable in a mixed-adapter batch) keeps PEFT's cast."""
    from peft import LoraConfig

    model = lora_model("llama-gqa")
    model.add_adapter("drop", LoraConfig(r=4, target_modules=["q_proj", "v_proj", "down_proj"], lora_dropout=0.1))
    layer = next(m for m in model.modules() if isinstance(m, peft.tuners.lora.layer.Linear))
    x = torch.randn(3, layer.in_features, dtype=torch.bfloat16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert not lora_casts.round_trip_only(layer, x, torch.float32)


def _stand_in_quantized_lora(name: str):
    """A stand-in for ``peft.tuners.lora.bnb.<name>`` (PEFT defines them only when bitsandbytes imports): the same
    bases, constructor, module and name, and PEFT's forward for them (the input cast only when autocast is off)."""
    from peft.tuners.lora.layer import LoraLayer

    class Stand(torch.nn.Module, LoraLayer):
        def __init__(self, base_layer, adapter_name, config, r=0, lora_alpha=1, **kwargs):
            super().__init__()
            LoraLayer.__init__(self, base_layer)
            self.fan_in_fan_out = False
            self._active_adapter = adapter_name
            self.update_layer(adapter_name, r, lora_alpha=lora_alpha, config=config)

        def forward(self, x, *args, **kwargs):
            result = self.base_layer(x, *args, **kwargs)
            for name in self.active_adapters:
                if name not in self.lora_A:
                    continue
                lora_a, lora_b = self.lora_A[name], self.lora_B[name]
                convert = not torch.is_autocast_enabled()
                if convert:
                    expected = result.dtype
                    x = self._cast_input_dtype(x, lora_a.weight.dtype)
                out = lora_b(lora_a(self.lora_dropout[name](x))) * self.scaling[name]
                result = result + (out.to(expected) if convert else out)
            return result

    Stand.__module__, Stand.__name__, Stand.__qualname__ = "peft.tuners.lora.bnb", name, name
    return Stand


@pytest.mark.parametrize("kind", ["Linear4bit", "Linear8bitLt"])
@pytest.mark.parametrize("order", ["patch-then-lora", "lora-then-patch"])
def test_quantized_base_lora_layers_bound_where_checked_and_left_to_peft_elsewhere(order, kind):
    """bitsandbytes 4-bit LoRA layers get the skip (their forward casts as PEFT's Linear does; tests/test_qlora.py
    checks it on the real layers); other quantized LoRA layers are left to PEFT and the report says so."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(0)
    base = make("llama-gqa").train()
    config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    config._register_custom_module({torch.nn.Linear: _stand_in_quantized_lora(kind)})  # PEFT builds the stand-ins
    if order == "patch-then-lora":
        report = hf_accel.patch(base, backend="reference")
        model = get_peft_model(base, config)
    else:
        model = get_peft_model(base, config)
        report = hf_accel.patch(model, backend="reference")
    stand_ins = [m for m in model.modules() if type(m).__name__ == kind]
    assert len(stand_ins) == 2 * 2  # q_proj and v_proj of both layers
    ids = torch.randint(0, VOCAB, (2, 9), generator=torch.Generator().manual_seed(1))
    loss = model(input_ids=ids, labels=ids).loss  # the pre-forward hook binds / notes adapters added after patch()
    loss.backward()
    assert all(m.lora_A["default"].weight.grad.abs().sum() > 0 for m in stand_ins)
    notes = [n for n in report.notes if n.startswith("LoRA cast skip")]
    if kind == "Linear4bit":
        assert all("_cast_input_dtype" in m.__dict__ for m in stand_ins) and not notes, report.notes
    else:
        assert not any("_cast_input_dtype" in m.__dict__ for m in stand_ins)  # PEFT's own forward and cast
        assert len(notes) == 1 and f"4 bnb.{kind} LoRA layers" in notes[0], report.notes
        assert "LoRA cast skip" in str(report)


def test_plain_lora_layers_get_no_stand_down_note():
    model = lora_model("llama-gqa")
    report = hf_accel.patch(model, backend="reference")
    assert lora_casts.left_to_peft(model) == {}
    assert not any(n.startswith("LoRA cast skip") for n in report.notes)


def test_patching_a_model_without_adapters_imports_neither_peft_nor_bitsandbytes():
    """A model holds PEFT's LoRA layers only once PEFT is imported, so patch() looks for them only then: importing
    PEFT for every patch cost its import and, where bitsandbytes is installed, bitsandbytes' (which PEFT pulls in),
    whose first CPU kernel lookup tries the hub and logs an exception holding the caller's frames (a handler that
    keeps records then kept the patched model alive). In a fresh interpreter. LoRA added after patch() is bound at
    its first forward (PEFT imported by then): test_lora_added_after_patch_is_bound_and_unpatch_removes_it."""
    import os
    import subprocess
    import sys

    code = """
import sys, transformers, hf_accel
config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                  num_attention_heads=2, num_key_value_heads=1)
model = transformers.LlamaForCausalLM(config).train()
hf_accel.patch(model, backend="reference")
print(sorted(name for name in ("peft", "bitsandbytes") if name in sys.modules))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                         env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "[]", out.stdout
