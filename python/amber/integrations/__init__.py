"""amber.integrations - amber as the checkpointing of training frameworks.

  amber.integrations.hf          the Hugging Face Trainer (AmberTrainer, AmberTrainerMixin)
                                 and export() to a folder that from_pretrained loads
  amber.integrations.accelerate  Accelerate's save_state/load_state through amber
                                 (AcceleratorCheckpointer)
  amber.integrations.lightning   PyTorch Lightning's CheckpointIO (AmberCheckpointIO)

Each submodule imports its framework, so import the one you use; this package
imports none of them.
"""

import importlib
import importlib.util


def __getattr__(name):
    """`amber.integrations.hf` and its kin without an explicit import: the submodule
    (and its framework) is imported on first use."""
    if name.startswith("_") or importlib.util.find_spec(f"{__name__}.{name}") is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return importlib.import_module(f"{__name__}.{name}")
