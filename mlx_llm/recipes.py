"""Recipes: the default configurations of the commands, shared by the CLI and the experiments.

The main job (``mlx-llm train`` with no flags) trains for about 4 minutes on 2 CPU cores (the README has the
measured time) and reaches ≤ 1.38 bits per byte on held-out stdlib files (docs/index.md, "The main job"): a small
model on many tokens — at this compute the loss-optimal model is small (U19 §8), and a 1024-token BPE spends little
of it on the vocabulary — with sandwich norms and value embeddings, trained by NorMuon.
``vocab_size`` follows the tokenizer. The recipes the main job grew out of stay, each a name the experiments whose
committed results were measured with it keep using, so their commands still reproduce their files: ``BASE_MODEL``
(the model without the knobs), ``ADAMW_TRAIN`` (the recipe before Muon) and ``MUON_TRAIN`` (the recipe before the
knobs). The fine-tuning and preference recipes are the defaults of ``sft`` / ``reward`` / ``dpo`` / ``rl``.
"""

from __future__ import annotations

import dataclasses

from mlx_llm.config import ModelConfig, TrainConfig

BASE_MODEL = ModelConfig(vocab_size=1024, d_model=128, n_layers=4, n_heads=4, n_kv_heads=2, d_head=32, d_ff=352,
                         max_seq_len=512, tie_embeddings=True)
# warmup-stable-decay (1-sqrt over the last 20 %) rather than cosine: 1.448 against 1.468 val bits/byte at the
# same 700 steps (experiments/results/wsd_branches.json: lower at every budget measured)
ADAMW_TRAIN = TrainConfig(batch_size=32, seq_len=128, steps=700, lr=5e-3, warmup_steps=30,
                          final_lr_fraction=0.1, eval_interval=350, eval_tokens=0, checkpoint_interval=100,
                          schedule="wsd")
# Muon (AdamW for the embedding and the gains) at peak lr 1e-2, its better of 5e-3 and 1e-2: over seeds 0-4 of the
# same 700 steps, Muon − AdamW = −0.059 [−0.081, −0.037] bits/byte, p = 0.002, paired
# (experiments/results/main_job_muon_seeds.json against main_job_adamw_seeds.json); its step costs 1.03× AdamW's
# (muon_step_time.json, timed interleaved), so the main job takes the AdamW recipe's time within 5 %
MUON_TRAIN = dataclasses.replace(ADAMW_TRAIN, optimizer="muon", lr=1e-2)
# Sandwich norms, value embeddings and NorMuon on top of it, the three knobs that gained alone at this length
# (experiments/results/knobs_main.json): over seeds 0-4 at equal wall time, − MUON_TRAIN = −0.066
# [−0.082, −0.051] bits/byte, p = 0.0003, paired (knobs_main_combos.json), and NorMuon − Muon with the two
# knobs = −0.007 [−0.012, −0.003], p = 0.013 (main_job_recipe_comparisons.json). Their step costs 1.094× MUON_TRAIN's, timed interleaved
# (knobs_main_step_time.json), so the main job trains round(700 / 1.094) = 640 steps, its warmup scaled alike
# (30 · 640 / 700 → 27), in the time of the recipe it replaced
MAIN_JOB_MODEL = dataclasses.replace(BASE_MODEL, sandwich_norm=True, value_embeds=True)
MAIN_JOB_TRAIN = dataclasses.replace(MUON_TRAIN, optimizer="normuon", steps=640, warmup_steps=27)
MAIN_JOB_VOCAB = 1024

SFT_TRAIN = TrainConfig(batch_size=16, seq_len=128, steps=300, lr=1e-3, warmup_steps=20, eval_interval=100,
                        checkpoint_interval=100, weight_decay=0.0)

PREF_TRAIN = {kind: TrainConfig(batch_size=16, seq_len=128, steps=200, lr=lr, warmup_steps=10, eval_interval=100,
                                 checkpoint_interval=50, weight_decay=0.0)
              for kind, lr in (("reward", 3e-4), ("dpo", 1e-5), ("rl", 2e-5))}
PREF_BETA = {"dpo": 0.1, "rl": 0.05}
