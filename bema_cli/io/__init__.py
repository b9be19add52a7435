"""Checkpoint I/O: discovery of checkpoints and base models, tensor readers, the streaming writer.

Nothing here does stabilizer math; `bema_cli.stabilize` imports from here, never the reverse.
"""
