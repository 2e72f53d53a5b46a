"""``python -m hf_accel.cli COMMAND ...`` (what ``accelerate launch -m hf_accel.cli sft ...`` runs)."""
import sys

from . import main

sys.exit(main())
