"""Post-training: chat format, LoRA adapters and built-in fine-tuning tasks."""
