"""The face for training runs: ``Trainer`` / ``SFTTrainer`` (transformers' and TRL's, wired to the stages below),
throughput metrics, loss normalisation and atomic checkpoint files.

May import every other stage. Nothing but ``hf_accel/__init__.py`` and scripts imports this package.
"""
