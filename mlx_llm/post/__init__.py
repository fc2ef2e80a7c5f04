"""Post-training runs from a base run: supervised fine-tuning (``sft``), a Bradley–Terry reward model
(``reward``), DPO (``dpo``), KL-leashed RL (``rl``, with PPO in ``ppo``), preference pairs (``pairs``) and the
prologue every fine-tuning run shares (``prologue``)."""
