"""What a run shows: the progress bar (ETA, tokens/s, loss; training and evaluation), the loss / tokens/s plot, and
no false alarm about a tied weight on resume."""
from __future__ import annotations

import io
import logging
import sys

import pytest
from transformers import TrainingArguments

from hf_accel.data.default_task import build_tokenizer, make_examples, tiny_llama
from hf_accel.data.prepare import tokenize_example
from hf_accel.training.progress import ProgressBar, plot_training
from hf_accel.training.trainer import AccelArguments, Trainer


def tiny_run(tmp_path, max_steps: int, **kwargs):
    tok = build_tokenizer()
    rows = [tokenize_example(x, tok) for x in make_examples(32, seed=0)]
    model = tiny_llama(len(tok), hidden_size=32, layers=1)
    args = TrainingArguments(output_dir=str(tmp_path), max_steps=max_steps, per_device_train_batch_size=4,
                             logging_steps=1, use_cpu=True, report_to="none", disable_tqdm=True, seed=0,
                             per_device_eval_batch_size=8, **kwargs)
    return Trainer(model=model, args=args, train_dataset=rows, eval_dataset=rows[:16], processing_class=tok,
                   accel=AccelArguments(print_summary=False))


def test_progress_bar_shows_steps_loss_and_tokens_per_second(tmp_path):
    trainer = tiny_run(tmp_path, max_steps=3)
    out = io.StringIO()
    trainer.add_callback(ProgressBar(file=out, tty=True))
    trainer.train()
    trainer.evaluate()
    text = out.getvalue()
    assert "train" in text and "3/3" in text, text
    assert "loss=" in text and "tok/s=" in text  # from the logs (hf_accel's meter adds tokens_per_s)
    assert "eval" in text and "2/2" in text  # 16 examples / 8 per eval batch


def test_progress_lines_off_a_terminal_carry_eta(tmp_path):
    trainer = tiny_run(tmp_path, max_steps=2)
    out = io.StringIO()
    trainer.add_callback(ProgressBar(file=out, tty=False))
    trainer.train()
    lines = out.getvalue().splitlines()
    assert len(lines) == 2 and lines[-1].startswith("step 2/2 (100%) | loss "), lines
    assert " | tok/s " in lines[-1] and "elapsed, ETA 0:00" in lines[-1]


def test_plot_is_written_or_skipped_without_matplotlib(tmp_path, monkeypatch):
    history = [{"step": s, "loss": 3.0 / s, "tokens_per_s": 1000.0 + s} for s in range(1, 6)]
    history.append({"step": 5, "eval_loss": 0.9})
    pytest.importorskip("matplotlib")
    path = tmp_path / "training.png"
    assert plot_training(history, str(path)) == str(path)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert plot_training([{"step": 1, "learning_rate": 0.1}], str(tmp_path / "empty.png")) is None
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as if not installed
    monkeypatch.delitem(sys.modules, "matplotlib.figure", raising=False)
    monkeypatch.delitem(sys.modules, "matplotlib.backends.backend_agg", raising=False)
    assert plot_training(history, str(tmp_path / "none.png")) is None
    assert not (tmp_path / "none.png").exists()


@pytest.fixture
def transformers_warnings():
    """Messages transformers logs at WARNING or above (its loggers do not propagate to pytest's capture)."""
    records: list[str] = []

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record.getMessage())

    handler, logger = Collect(level=logging.WARNING), logging.getLogger("transformers")
    logger.addHandler(handler)
    yield records
    logger.removeHandler(handler)


def test_clean_resume_does_not_report_the_tied_lm_head_missing(tmp_path, transformers_warnings):
    first = tiny_run(tmp_path, max_steps=2, save_strategy="steps", save_steps=2)
    assert first.model.lm_head.weight is first.model.model.embed_tokens.weight  # tied: saved once
    first.train()
    resumed = tiny_run(tmp_path, max_steps=3, save_strategy="steps", save_steps=2)
    transformers_warnings.clear()
    resumed.train(resume_from_checkpoint=True)
    assert resumed.state.global_step == 3
    assert not [m for m in transformers_warnings if "missing keys" in m], transformers_warnings
    assert resumed.model.lm_head.weight is resumed.model.model.embed_tokens.weight
    # a key that really is missing is still reported
    from torch.nn.modules.module import _IncompatibleKeys

    resumed._issue_warnings_after_load(_IncompatibleKeys(["lm_head.weight", "model.norm.weight"], []))
    assert transformers_warnings[-1] == "There were missing keys in the checkpoint model loaded: ['model.norm.weight']."


def test_heldout_evaluation_shows_progress(capsys):
    from hf_accel.data.default_task import exact_match

    tok = build_tokenizer()
    examples = make_examples(4, seed=5)
    score = exact_match(tiny_llama(len(tok), hidden_size=32, layers=1), tok, examples, batch_size=2, progress=True)
    err = capsys.readouterr().err
    assert 0.0 <= score <= 1.0 and "held-out exact match" in err and "4/4" in err, err
    exact_match(tiny_llama(len(tok), hidden_size=32, layers=1), tok, examples, progress=False)
    assert capsys.readouterr().err == ""
