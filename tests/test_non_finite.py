"""A run that goes non-finite says so (issue 68a): ``hf_accel.Trainer`` raises ``NonFiniteLoss`` naming the step where
the loss first stopped being finite (the step stock transformers logs nan at, same seed and settings), saves nothing
of that step or later, and leaves the model unsaved; ``non_finite="skip"`` drops exactly that step's update and counts
it; the plot marks non-finite points; the command exits 1 with one line and no saved model."""
from __future__ import annotations

import math
import os

import pytest
import torch
import transformers
from safetensors.torch import load_file

from hf_accel.errors import NonFiniteLoss
from hf_accel.training.trainer import AccelArguments, Trainer
from tests.checkpoint_runs import args, data, model

DIVERGING_LR = 1e9  # Adam moves every weight by about the learning rate: the loss overflows within a few steps


def stock_first_nan_step(tmp_path) -> int:
    """The first step whose logged loss is not finite in stock transformers, same model, data and settings."""
    stock = transformers.Trainer(model=model(), args=args(tmp_path / "stock", learning_rate=DIVERGING_LR,
                                                          save_strategy="no", logging_nan_inf_filter=False,
                                                          max_steps=8),
                                 train_dataset=data(), data_collator=transformers.DataCollatorForLanguageModeling(
                                     pad_token_id_only_collator(), mlm=False))
    stock.train()
    return next(log["step"] for log in stock.state.log_history if "loss" in log and not math.isfinite(log["loss"]))


def pad_token_id_only_collator():
    class Tok:  # DataCollatorForLanguageModeling reads pad_token_id and pad() from its tokenizer
        pad_token_id = 0
        padding_side = "right"

        def pad(self, features, return_tensors="pt", **_):
            width = max(len(f["input_ids"]) for f in features)
            ids = torch.tensor([f["input_ids"] + [0] * (width - len(f["input_ids"])) for f in features])
            mask = torch.tensor([[1] * len(f["input_ids"]) + [0] * (width - len(f["input_ids"])) for f in features])
            return {"input_ids": ids, "attention_mask": mask}

        def __len__(self):
            return 96

    return Tok()


def test_a_diverging_run_stops_at_the_first_non_finite_step_and_saves_nothing_of_it(tmp_path):
    expected = stock_first_nan_step(tmp_path)
    out = tmp_path / "run"
    trainer = Trainer(model=model(), args=args(out, learning_rate=DIVERGING_LR, max_steps=8, save_steps=1,
                                               logging_steps=4),
                      train_dataset=data(), accel=AccelArguments(backend="reference", packing=False,
                                                                 print_summary=False))
    with pytest.raises(NonFiniteLoss) as exc:
        trainer.train()
    error = exc.value
    assert error.step == expected and error.what in ("loss", "gradient norm"), str(error)
    assert f"at step {expected}" in str(error) and "\n" not in str(error)
    saved = sorted(int(d.split("-")[1]) for d in os.listdir(out) if d.startswith("checkpoint-"))
    assert saved and max(saved) < expected, saved  # nothing of the non-finite step or later
    assert error.checkpoint == str(out / f"checkpoint-{max(saved)}") and error.checkpoint in str(error)
    for step in saved:
        weights = load_file(out / f"checkpoint-{step}" / "model.safetensors")
        assert all(torch.isfinite(w).all() for w in weights.values()), step
    assert not (out / "model.safetensors").exists()


class NanAtStep(Trainer):
    """A Trainer whose loss is nan for one step's micro-batches (data that breaks the loss, made deterministic)."""

    nan_step = 3

    def compute_loss(self, model, inputs, *a, **kw):
        loss = super().compute_loss(model, inputs, *a, **kw)
        if self.state.global_step + 1 == self.nan_step:
            loss = loss * float("nan")
        return loss


class Weights(transformers.TrainerCallback):
    def __init__(self):
        self.after = {}

    def on_step_end(self, args, state, control, model=None, **kwargs):
        self.after[state.global_step] = {k: v.detach().clone() for k, v in model.state_dict().items()}


def test_skip_mode_drops_exactly_that_steps_update_and_counts_it(tmp_path):
    weights = Weights()
    trainer = NanAtStep(model=model(), args=args(tmp_path / "run", max_steps=5, save_strategy="no"),
                        train_dataset=data(), callbacks=[weights],
                        accel=AccelArguments(backend="reference", print_summary=False, non_finite="skip"))
    trainer.train()
    assert trainer.skipped_steps == 1
    for name, before in weights.after[2].items():  # step 3's update was dropped, steps 2 and 4 moved the weights
        assert torch.equal(weights.after[3][name], before), name
    assert any(not torch.equal(weights.after[4][n], weights.after[3][n]) for n in weights.after[3])
    logged = [log for log in trainer.state.log_history if "loss" in log]
    assert all(math.isfinite(log["loss"]) for log in logged)
    assert logged[-1]["skipped_steps"] == 1
    assert all(torch.isfinite(p).all() for p in trainer.model.parameters())


def test_stop_mode_names_the_injected_step(tmp_path):
    trainer = NanAtStep(model=model(), args=args(tmp_path / "run", max_steps=5, save_steps=2, logging_steps=5),
                        train_dataset=data(), accel=AccelArguments(backend="reference", print_summary=False))
    with pytest.raises(NonFiniteLoss, match=r"the training loss was nan at step 3 \(noticed at step 4\)"):
        trainer.train()  # the save of step 4 looked first
    assert sorted(os.listdir(tmp_path / "run")) == ["checkpoint-2"]


def test_the_plot_marks_non_finite_losses(tmp_path, monkeypatch):
    """Every logged step appears at a finite place on the loss axis (a line through the finite points alone hid
    that the loss went nan)."""
    pytest.importorskip("matplotlib")
    from matplotlib.figure import Figure

    from hf_accel.training.progress import plot_training

    figures = []
    monkeypatch.setattr(Figure, "savefig", lambda self, *a, **kw: figures.append(self))
    history = [{"step": s, "loss": v, "tokens_per_s": 100.0} for s, v in
               ((1, 3.8), (2, 3.7), (3, float("nan")), (4, float("inf")), (5, float("nan")))]
    plot_training(history, str(tmp_path / "training.png"))
    loss_axis = figures[0].axes[0]
    drawn = {int(x) for line in loss_axis.get_lines() for x, y in zip(line.get_xdata(), line.get_ydata())
             if math.isfinite(float(y))}
    assert drawn >= {1, 2, 3, 4, 5}, drawn
    assert any("nan" in text.get_text() for text in loss_axis.get_legend().get_texts())


def test_watching_reads_nothing_back_per_step(tmp_path, monkeypatch):
    """The default ("stop") notes each loss and gradient norm without reading a value back to the host (a host
    sync per step on a GPU); the record is read at logs, saves and the end only."""
    import contextlib

    from hf_accel.training.non_finite import NonFiniteGuard

    @contextlib.contextmanager
    def no_host_reads():
        def refuse(*a, **kw):
            raise AssertionError("a host read while noting a step's values")

        saved = {name: getattr(torch.Tensor, name) for name in ("item", "tolist", "__bool__", "__float__")}
        for name in saved:
            setattr(torch.Tensor, name, refuse)
        try:
            yield
        finally:
            for name, method in saved.items():
                setattr(torch.Tensor, name, method)

    reads = []
    for name in ("note_loss", "note_grad_norm"):
        real = getattr(NonFiniteGuard, name)

        def noted(self, *a, _real=real, **kw):
            with no_host_reads():
                return _real(self, *a, **kw)

        monkeypatch.setattr(NonFiniteGuard, name, noted)
    real_first = NonFiniteGuard.first
    monkeypatch.setattr(NonFiniteGuard, "first", lambda self, *a, **kw: reads.append(1) or real_first(self, *a, **kw))
    trainer = NanAtStep(model=model(), args=args(tmp_path / "run", max_steps=6, save_steps=3, logging_steps=6),
                        train_dataset=data(), accel=AccelArguments(backend="reference", print_summary=False))
    trainer.nan_step = 99  # no nan: a whole run
    trainer.train()
    assert len(reads) == 4  # the saves of steps 3 and 6, the log of step 6, the end


def test_transformers_nan_filter_reads_no_loss_back(tmp_path, monkeypatch):
    """transformers' ``logging_nan_inf_filter`` (on by default) tests every step's loss with ``torch.isnan`` in an
    ``if``: a host sync per step. Under hf_accel's Trainer the guard covers it on the device, so that check never
    runs during training, and the user's setting is back when ``train()`` returns. Stock, same settings: it runs."""
    import sys

    checked = []
    real_isnan = torch.isnan

    def isnan(x, *a, **kw):
        if sys._getframe(1).f_code.co_filename.endswith(os.path.join("transformers", "trainer.py")):
            checked.append(x)
        return real_isnan(x, *a, **kw)

    monkeypatch.setattr(torch, "isnan", isnan)
    settings = dict(max_steps=3, save_strategy="no", logging_steps=3)
    stock = transformers.Trainer(model=model(), args=args(tmp_path / "stock", **settings), train_dataset=data(),
                                 data_collator=transformers.DataCollatorForLanguageModeling(
                                     pad_token_id_only_collator(), mlm=False))
    stock.train()
    assert len(checked) == 3 and stock.args.logging_nan_inf_filter  # what the test would see without the change
    checked.clear()
    ours = Trainer(model=model(), args=args(tmp_path / "ours", **settings), train_dataset=data(),
                   accel=AccelArguments(backend="reference", print_summary=False))
    ours.train()
    assert checked == [] and ours.args.logging_nan_inf_filter
