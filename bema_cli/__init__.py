"""bema: stabilize fine-tuned LLM checkpoints after training (BEMA, EMA, DEMA, OUEMA) and evaluate them."""

__version__ = "0.9.0"
