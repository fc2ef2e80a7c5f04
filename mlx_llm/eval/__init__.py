"""Evaluation of saved runs, above the run layer: ``val`` (validation loss, perplexity and bits per byte of a
checkpoint), ``replies`` (a model's replies through the chat template, held-out task accuracy, the chat loop) and
``harness`` (the lm-evaluation-harness model class). Import the modules themselves.
"""
