"""amber.integrations - amber as the checkpointing of training frameworks.

Each integration is a submodule, imported on its own so that a framework is needed
only by the code that uses it:

    from amber.integrations.lightning import AmberCheckpointIO   # PyTorch Lightning
"""
