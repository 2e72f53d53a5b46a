"""Chunked linear CE vs plain F.cross_entropy over full logits (fp32, CPU): loss, gradients, saved memory."""
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from hf_accel.errors import ConfigurationError, InvalidBatch
from hf_accel.fused.ce_functions import _scale_, ce_grad_
from hf_accel.fused.cross_entropy import auto_chunk_size, causal_lm_loss_from_hidden, linear_cross_entropy

# fp32 on CPU: chunking only reorders sums, so differences are a few ulps of the accumulated values
RTOL, ATOL = 1e-5, 1e-6
N, H, V = 37, 16, 53


def _data(seed: int = 0, ignore_frac: float = 0.3):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(N, H, generator=g)
    labels = torch.randint(0, V, (N,), generator=g)
    labels[torch.rand(N, generator=g) < ignore_frac] = -100
    return hidden, labels


def _reference(hidden, head, labels, reduction, num_items):
    loss = F.cross_entropy(head(hidden).float(), labels, ignore_index=-100, reduction="sum")
    if num_items is not None:
        return loss / num_items
    return loss if reduction == "sum" else loss / (labels != -100).sum()


def _grads(loss, tensors):
    return torch.autograd.grad(loss, tensors)


@pytest.mark.parametrize("method", ["inline", "recompute"])
@pytest.mark.parametrize("chunk_size", [1, 5, 16, 1000, None])
@pytest.mark.parametrize("reduction,num_items", [("sum", None), ("mean", None), ("mean", 23)])
@pytest.mark.parametrize("bias", [False, True])
def test_plain_linear_matches_full_logits(method, chunk_size, reduction, num_items, bias):
    hidden, labels = _data()
    head = nn.Linear(H, V, bias=bias)
    hidden.requires_grad_(True)
    params = [hidden, *head.parameters()]
    want = _reference(hidden, head, labels, reduction, num_items)
    got = linear_cross_entropy(
        hidden, head, labels, reduction=reduction, num_items_in_batch=num_items, chunk_size=chunk_size,
        method=method,
    )
    torch.testing.assert_close(got, want, rtol=RTOL, atol=ATOL)
    for g_got, g_want in zip(_grads(got, params), _grads(want, params)):
        torch.testing.assert_close(g_got, g_want, rtol=RTOL, atol=ATOL)


class _NotPlainLinear(nn.Linear):
    """A head the fused loss must call as a module (its "module" path), as it calls a LoRA-wrapped head."""


@pytest.mark.parametrize("method", ["inline", "recompute", "module"])
def test_final_logit_softcap_matches_capped_full_logits(method):
    """Gemma 2's final soft-cap inside the fused loss: loss and gradients as F.cross_entropy over
    cap * tanh(logits / cap) of the full logits. Scores of several times the cap, so the cap matters."""
    hidden, labels = _data(3)
    hidden = (hidden * 4).requires_grad_(True)
    head = (_NotPlainLinear if method == "module" else nn.Linear)(H, V, bias=False)
    cap = 2.0
    params = [hidden, *head.parameters()]
    logits = head(hidden)
    assert logits.abs().max() > 3 * cap
    want = F.cross_entropy(torch.tanh(logits / cap) * cap, labels, ignore_index=-100)
    got = linear_cross_entropy(hidden, head, labels, chunk_size=8, method="auto" if method == "module" else method,
                               softcap=cap)
    uncapped = linear_cross_entropy(hidden, head, labels, chunk_size=8)
    assert (uncapped - want).abs() > 0.1  # the test can fail: capping changes the loss
    torch.testing.assert_close(got, want, rtol=RTOL, atol=ATOL)
    for g_got, g_want in zip(_grads(got, params), _grads(want, params)):
        torch.testing.assert_close(g_got, g_want, rtol=RTOL, atol=ATOL)


def test_frozen_head_only_hidden_grad():
    hidden, labels = _data(1)
    head = nn.Linear(H, V).requires_grad_(False)
    hidden.requires_grad_(True)
    got = linear_cross_entropy(hidden, head, labels, chunk_size=7)
    want = _reference(hidden, head, labels, "mean", None)
    torch.testing.assert_close(_grads(got, [hidden])[0], _grads(want, [hidden])[0], rtol=RTOL, atol=ATOL)


def test_lora_head_gets_gradients_through_module_path():
    peft = pytest.importorskip("peft")

    class Tiny(nn.Module):
        def __init__(self):
            super().__init__()
            self.lm_head = nn.Linear(H, V, bias=False)

    model = peft.get_peft_model(Tiny(), peft.LoraConfig(r=4, target_modules=["lm_head"], init_lora_weights=False))
    head = model.base_model.model.lm_head
    hidden, labels = _data(2)
    hidden.requires_grad_(True)
    lora = [p for n, p in model.named_parameters() if p.requires_grad]
    assert len(lora) == 2  # lora_A and lora_B
    want = _reference(hidden, head, labels, "mean", None)
    got = linear_cross_entropy(hidden, head, labels, chunk_size=6)
    torch.testing.assert_close(got, want, rtol=RTOL, atol=ATOL)
    for g_got, g_want in zip(_grads(got, [hidden, *lora]), _grads(want, [hidden, *lora])):
        assert g_want.abs().sum() > 0
        torch.testing.assert_close(g_got, g_want, rtol=RTOL, atol=ATOL)


def _saved_numel(fn) -> int:
    saved = []

    def pack(t):
        saved.append(t.numel())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return sum(saved)


def test_saved_tensors_much_smaller_than_full_logits():
    n, h, v = 2048, 32, 4096
    hidden = torch.randn(n, h, requires_grad=True)
    head = nn.Linear(h, v, bias=False)
    labels = torch.randint(0, v, (n,))
    chunked = _saved_numel(lambda: linear_cross_entropy(hidden, head, labels, chunk_size=256))
    full = _saved_numel(lambda: F.cross_entropy(head(hidden), labels))
    # hidden (n*h) + weight (v*h) + labels + lse: ~n*(h+2) + v*h, vs the reference keeping >= n*v logits
    assert full >= n * v
    assert chunked < n * v / 10, (chunked, n * v)


def test_causal_lm_loss_matches_hf_model_loss():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)
    model = LlamaForCausalLM(cfg)
    input_ids = torch.randint(0, 128, (2, 11))
    labels = input_ids.clone()
    labels[0, :3] = -100
    out = model(input_ids=input_ids, labels=labels, use_cache=False, output_hidden_states=True)
    hidden = out.hidden_states[-1]  # after the final norm: what lm_head sees
    for num_items in (None, 7):
        want = out.loss if num_items is None else model.loss_function(out.logits, labels, 128, num_items_in_batch=7)
        got = causal_lm_loss_from_hidden(model, hidden, labels, num_items_in_batch=num_items)
        torch.testing.assert_close(got, want, rtol=RTOL, atol=ATOL)
    params = [p for p in model.parameters()]
    g_got = _grads(causal_lm_loss_from_hidden(model, model.model(input_ids).last_hidden_state, labels), params)
    g_want = _grads(model(input_ids=input_ids, labels=labels, use_cache=False).loss, params)
    for a, b in zip(g_got, g_want):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


def test_bad_inputs_raise_typed_errors():
    hidden, labels = _data()
    head = nn.Linear(H, V)
    with pytest.raises(InvalidBatch, match="flatten"):
        linear_cross_entropy(hidden[None], head, labels)
    with pytest.raises(ConfigurationError, match="reduction"):
        linear_cross_entropy(hidden, head, labels, reduction="none")
    with pytest.raises(ConfigurationError, match="chunk_size"):
        linear_cross_entropy(hidden, head, labels, chunk_size=0)


def test_all_ignored_mean_is_zero_not_nan():
    hidden, _ = _data()
    labels = torch.full((N,), -100)
    assert linear_cross_entropy(hidden, nn.Linear(H, V), labels).item() == 0.0


# ---- patch(fused_ce=True): the loss inside the model's own forward ------------------------------------------------
@pytest.mark.parametrize("variant", ["llama-gqa", "neox-parallel", "falcon-40b-newarch", "gemma2-softcap"])
def test_patch_fused_ce_equals_stock_loss_and_grads(variant):
    """gemma2-softcap: the final logit soft-cap (2.0 in the tiny config) applied inside the fused loss."""
    import copy
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parent))
    import hf_accel
    from tiny_models import VOCAB, make

    stock = make(variant).train()
    fused = copy.deepcopy(stock)
    hf_accel.patch(stock)  # the reference: the model's own loss over full logits (patched: stock Falcon<5.24 leaks)
    hf_accel.patch(fused, fused_ce=True)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, VOCAB, (1, 17), generator=g)
    pos = torch.tensor([[0, 1, 2, 3, 4, 5, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10]])
    labels = ids.masked_fill(pos == 0, -100)
    results = []
    for model in (stock, fused):
        out = model(input_ids=ids, position_ids=pos, labels=labels, num_items_in_batch=torch.tensor(40))
        out.loss.backward()
        results.append((out, {n: p.grad for n, p in model.named_parameters()}))
    (stock_out, stock_grads), (fused_out, fused_grads) = results
    assert fused_out.logits is None  # never materialised
    torch.testing.assert_close(fused_out.loss, stock_out.loss, rtol=1e-5, atol=1e-6)
    for name, grad in stock_grads.items():
        torch.testing.assert_close(fused_grads[name], grad, rtol=1e-4, atol=1e-6, msg=name)
    fused.eval()  # evaluation takes the stock path: logits as before
    assert fused(input_ids=ids, labels=labels).logits is not None
    import inspect

    assert list(inspect.signature(fused.forward).parameters) == list(inspect.signature(stock.forward).parameters)
    hf_accel.unpatch(fused)
    assert "forward" not in fused.__dict__


def _stock_and_fused(variant="llama-gqa"):
    import copy
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parent))
    import hf_accel
    from tiny_models import VOCAB, make

    stock = make(variant).train()
    fused = copy.deepcopy(stock)
    hf_accel.patch(stock)
    hf_accel.patch(fused, fused_ce=True)
    ids = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(1))
    return stock, fused, ids


def test_fused_training_calls_return_what_the_stock_forward_returns():
    """A training call with labels returns the stock forward's hidden states and attentions when asked (they were
    dropped), and a call asking for a tuple (return_dict=False) gets the stock forward's tuple (it crashed)."""
    stock, fused, ids = _stock_and_fused()
    outs = [model(input_ids=ids, labels=ids, output_hidden_states=True) for model in (stock, fused)]
    assert len(outs[1].hidden_states) == len(outs[0].hidden_states) == 3
    for ours, theirs in zip(outs[1].hidden_states, outs[0].hidden_states):
        torch.testing.assert_close(ours, theirs)
    torch.testing.assert_close(outs[1].loss, outs[0].loss, rtol=1e-5, atol=1e-6)
    tuples = [model(input_ids=ids, labels=ids, return_dict=False) for model in (stock, fused)]
    assert isinstance(tuples[1], tuple) and len(tuples[1]) == len(tuples[0])
    for ours, theirs in zip(tuples[1], tuples[0]):
        torch.testing.assert_close(ours, theirs)


@pytest.mark.parametrize("how", ["retain_graph", "create_graph"])
def test_a_second_backward_through_the_fused_loss_is_a_typed_error(how):
    """The fused loss hands out gradients it computed in the forward, scaled in place: a second backward through the
    same loss failed with torch's in-place error (retain_graph) or silently missed second-order terms (create_graph);
    both now say what to do."""
    _, fused, ids = _stock_and_fused()
    loss = fused(input_ids=ids, labels=ids).loss
    with pytest.raises(ConfigurationError, match="hands them out once.*fused_ce=False"):
        if how == "retain_graph":
            loss.backward(retain_graph=True)
            loss.backward()
        else:
            torch.autograd.grad(loss, [p for p in fused.parameters() if p.requires_grad], create_graph=True)


def test_a_forward_already_wrapped_on_the_instance_keeps_its_wrapper():
    """A model whose forward is already wrapped on the instance (accelerate's autocast from accelerator.prepare, its
    device hooks): the fused loss's training path would bypass the wrapper, so "auto" leaves it off and True is
    refused; unpatch leaves the wrapper in place (it removed it)."""
    import types

    import hf_accel
    from hf_accel.attention.kernels.base import DeviceInfo
    from hf_accel.patch_options import resolve_speedups
    from tiny_models import make

    model = make("llama-gqa").train()
    calls = []

    def wrapper(self, *args, **kwargs):
        calls.append(1)
        return type(self).forward(self, *args, **kwargs)

    model.forward = types.MethodType(wrapper, model)
    assert not resolve_speedups(model, DeviceInfo("cuda", (9, 0)), liger_installed=False)["fused_ce"].on
    with pytest.raises(ConfigurationError, match="already wrapped on the instance"):
        hf_accel.patch(model, fused_ce=True)
    hf_accel.patch(model)
    hf_accel.unpatch(model)
    model(input_ids=torch.zeros(1, 4, dtype=torch.long))
    assert calls == [1]


@pytest.mark.parametrize("variant", ["llama-gqa", "neox-parallel", "falcon-40b-newarch"])
def test_patch_fused_ce_honours_shift_labels(variant):
    """transformers' causal-LM loss takes pre-shifted ``shift_labels`` (what sequence parallelism's data loader
    hands the model: labels sharded after the shift); it then scores position t against shift_labels[t] and uses
    ``labels`` only as the switch that turns the loss on. The fused loss must do the same, not shift again."""
    import copy
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parent))
    import hf_accel
    from tiny_models import VOCAB, make

    stock = make(variant).train()
    fused = copy.deepcopy(stock)
    hf_accel.patch(stock)
    hf_accel.patch(fused, fused_ce=True)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (1, 17), generator=g)
    shifted = torch.randint(0, VOCAB, (1, 17), generator=g)  # not ids shifted: the loss must follow this tensor
    shifted[0, -1] = -100
    shifted[0, 3] = -100
    results = []
    for model in (stock, fused):
        out = model(input_ids=ids, labels=shifted, shift_labels=shifted)
        out.loss.backward()
        results.append((out.loss, {n: p.grad for n, p in model.named_parameters()}))
    (stock_loss, stock_grads), (fused_loss, fused_grads) = results
    torch.testing.assert_close(fused_loss, stock_loss, rtol=1e-5, atol=1e-6)
    for name, grad in stock_grads.items():
        torch.testing.assert_close(fused_grads[name], grad, rtol=1e-4, atol=1e-6, msg=name)


def test_inline_without_grad_mode_is_the_plain_loss():
    """Evaluation with labels (no_grad) takes the loss-only pass: same value, and no gradient is computed."""
    hidden, labels = _data(3)
    head = nn.Linear(H, V)
    with torch.no_grad():
        got = linear_cross_entropy(hidden, head, labels, chunk_size=8, method="inline")
    assert not got.requires_grad
    torch.testing.assert_close(got, _reference(hidden, head, labels, "mean", None), rtol=RTOL, atol=ATOL)


def test_inline_device_scalar_num_items_and_bf16_weights():
    """A device-tensor num_items_in_batch (what the Trainer passes; no host sync needed) and bf16 weights: the
    weight gradient accumulates in bf16 across chunks, within bf16 rounding of the fp32 reference."""
    hidden, labels = _data(4)
    head = nn.Linear(H, V, bias=False)
    n_items = (labels != -100).sum()
    h16 = hidden.bfloat16().requires_grad_(True)
    head16 = nn.Linear(H, V, bias=False).bfloat16()
    head16.weight.data.copy_(head.weight.data)
    got = linear_cross_entropy(h16, head16, labels, num_items_in_batch=n_items, chunk_size=8, method="inline")
    hidden32 = h16.detach().float().requires_grad_(True)
    head.weight.data.copy_(head16.weight.data.float())
    want = _reference(hidden32, head, labels, "sum", None) / n_items
    torch.testing.assert_close(got, want, rtol=1e-3, atol=1e-3)
    for g_got, g_want in zip(_grads(got, [h16, head16.weight]), _grads(want, [hidden32, head.weight])):
        assert g_got.dtype == torch.bfloat16
        assert ((g_got.float() - g_want).norm() / g_want.norm()).item() < 2e-2


def test_ce_grad_overwrites_logits_with_their_gradient():
    """The in-place chunk step (the Triton kernel's CPU twin) vs autograd through F.cross_entropy."""
    logits = torch.randn(9, V, dtype=torch.float64) * 3
    labels = torch.randint(0, V, (9,))
    labels[::4] = -100
    x = logits.clone().requires_grad_(True)
    want = F.cross_entropy(x, labels, ignore_index=-100, reduction="sum")
    (want_grad,) = torch.autograd.grad(want, x)
    work = logits.clone()
    got = ce_grad_(work, labels)
    torch.testing.assert_close(got, want.detach())
    torch.testing.assert_close(work, want_grad)
    assert work[::4].abs().sum() == 0


def test_scale_multiplies_low_precision_grads_in_fp32():
    """1/N rounded to bf16 first would bias every gradient; _scale_ takes the product in fp32 and rounds once."""
    grad = torch.randn(5000, dtype=torch.float32).bfloat16()
    scale = torch.tensor(1 / 11000)  # 2^-14 x 1.4895: bf16 would round it by 0.2%
    want = (grad.float() * scale).bfloat16()
    naive = grad * scale.bfloat16()
    got = _scale_(grad.clone(), scale, block=1000)
    assert torch.equal(got, want)
    assert not torch.equal(naive, want)  # the bf16 product differs: the test can tell them apart


def test_auto_chunk_size_targets_512_mib_of_logits():
    assert auto_chunk_size(16384, 128256, 2) == 2048  # Llama-3 vocab, bf16: 2048 x 128256 x 2 B = 501 MiB
    assert auto_chunk_size(16384, 50304, 2) == 4096
    assert auto_chunk_size(16384, 128256, 4) == 1024  # the recompute path upcasts to fp32
    assert auto_chunk_size(100, 128256, 2) == 100  # never more than the tokens there are
    assert auto_chunk_size(10**6, 10**9, 4) == 128  # a floor, however large the vocabulary


def test_method_choice_and_bad_method(caplog):
    hidden, labels = _data(5)
    head = nn.Linear(H, V)
    with pytest.raises(ConfigurationError, match="method="):
        linear_cross_entropy(hidden, head, labels, method="fast")
    want = _reference(hidden, head, labels, "mean", None)
    with caplog.at_level("WARNING"):
        got = linear_cross_entropy(hidden, head, labels, method="liger")  # CPU: falls back, says so
    torch.testing.assert_close(got, want, rtol=RTOL, atol=ATOL)
    if not torch.cuda.is_available():
        assert any("Liger fused CE requested" in r.message for r in caplog.records)


@pytest.mark.parametrize("method", ["inline", "recompute"])
def test_fp32_head_under_bf16_autocast(method):
    """Mixed precision with fp32 weights (Trainer bf16=True on an fp32 model): the head computes in bf16 as the unfused
    F.linear would, and gradients come back fp32, within bf16 error of the same computation done unfused."""
    hidden, labels = _data(6)
    head = nn.Linear(H, V)
    hidden.requires_grad_(True)
    params = [hidden, head.weight, head.bias]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = linear_cross_entropy(hidden, head, labels, chunk_size=8, method=method)
        want = _reference(hidden, head, labels, "mean", None)
    torch.testing.assert_close(got, want, rtol=1e-2, atol=1e-2)
    for g_got, g_want in zip(_grads(got, params), _grads(want, params)):
        assert g_got.dtype == torch.float32
        assert ((g_got - g_want).norm() / g_want.norm()).item() < 2e-2


@pytest.mark.parametrize("bad", [V, -1])
def test_labels_outside_the_vocabulary_are_a_typed_error(bad):
    hidden, labels = _data(7)
    labels[4] = bad
    with pytest.raises(InvalidBatch, match=r"labels must be token ids in \[0, 53\)"):
        linear_cross_entropy(hidden, nn.Linear(H, V), labels)


class _SubclassedLinear(nn.Linear):
    """Not exactly nn.Linear: takes the "module" path (as a PEFT LoRA head does)."""


@pytest.mark.parametrize("method", ["inline", "recompute", "module"])
def test_the_loss_is_one_call_of_the_head(method):
    """The whole chunked loss runs as one call of the head's __call__, so a wrapper's hooks on the head (FSDP2 gathers
    the weight in its forward pre-hook and reduces the gradient once after the backward; ZeRO-3 likewise) fire once,
    see what the loss consumes (a pre-hook's replacement input) and produces; the head is left as it was. Before,
    "inline" / "recompute" read head.weight without calling the head (zero calls) and "module" called it once per
    chunk plus once per chunk recompute."""
    hidden, labels = _data(8)
    head = (_SubclassedLinear if method == "module" else nn.Linear)(H, V)
    calls, outputs = [], []
    head.register_forward_pre_hook(lambda module, args: calls.append(args) or (args[0] * 2, *args[1:]))
    head.register_forward_hook(lambda module, args, out: outputs.append(out))
    hidden.requires_grad_(True)
    got = linear_cross_entropy(hidden, head, labels, chunk_size=8, method=method if method != "module" else "auto")
    got.backward()
    assert len(calls) == 1 and len(outputs) == 1 and outputs[0].dim() == 0
    assert "forward" not in head.__dict__
    hidden_grad = hidden.grad.clone()
    reference = nn.Linear(H, V)
    reference.load_state_dict(head.state_dict())
    want = _reference(hidden.detach() * 2, reference, labels, "mean", None)
    torch.testing.assert_close(got, want, rtol=RTOL, atol=ATOL)
    hidden.grad = None
    torch.autograd.backward(_reference(hidden * 2, reference, labels, "mean", None))
    torch.testing.assert_close(hidden_grad, hidden.grad, rtol=RTOL, atol=ATOL)


def test_a_head_with_its_own_bound_forward_keeps_it():
    hidden, labels = _data(9)
    head = _SubclassedLinear(H, V)
    own = head.forward  # e.g. a forward bound by a patch, on the instance
    head.forward = lambda x: F.linear(x, head.weight, head.bias)
    bound = head.forward
    got = linear_cross_entropy(hidden, head, labels, chunk_size=8)
    assert head.__dict__["forward"] is bound and own is not bound
    torch.testing.assert_close(got, _reference(hidden, head, labels, "mean", None), rtol=RTOL, atol=ATOL)


def test_inline_loss_holds_one_chunk_and_no_hidden_copy_at_its_peak():
    """QLoRA's case (PEFT keeps the head and the residual stream fp32, the head computes in bf16 under autocast): the
    inline loss's own peak is the head's bf16 copy, the hidden gradient and one chunk, or the hidden gradient while it
    widens to fp32, whichever is more. It held a bf16 copy of every hidden row and two chunks' logits at once, and
    the head's copy while the gradient widened: on Llama-3-8B QLoRA ~0.4 GiB at the step's memory peak."""
    from torch.multiprocessing.reductions import StorageWeakRef

    from hf_accel.memory.plan import _LiveBytes

    n, h, v, chunk = 4096, 256, 1024, 128
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(n, h, generator=g, requires_grad=True)
    head = nn.Linear(h, v, bias=False).requires_grad_(False)
    labels = torch.randint(0, v, (n,), generator=g)
    inputs = {hidden.untyped_storage().data_ptr(): (StorageWeakRef(hidden.untyped_storage()), n * h * 4)}
    with torch.autocast("cpu", dtype=torch.bfloat16), _LiveBytes(credit=inputs) as live:
        loss = linear_cross_entropy(hidden, head, labels, chunk_size=chunk, method="inline")
    weight_copy, grad_bf16, grad_fp32 = v * h * 2, n * h * 2, n * h * 4
    one_chunk = 6 * chunk * v * 4  # the chunk's logits and the fp32 temporaries of the CPU CE
    assert live.peak <= max(weight_copy + grad_bf16 + one_chunk, grad_bf16 + grad_fp32) + 64 * 2**10, live.peak
    (grad,) = torch.autograd.grad(loss, hidden)  # still the gradient of the unfused loss
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want = _reference(hidden, head, labels, "mean", None)
    (grad_want,) = torch.autograd.grad(want, hidden)
    assert ((grad - grad_want).norm() / grad_want.norm()).item() < 2e-2
