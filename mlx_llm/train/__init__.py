"""The training pipeline: tokenizer, data, optimizer, the jitted step, checkpoints, the run loop."""
