"""Drafter training, a user command (`python -m lm_eval_spot.training`): data from a target's decodes, the trainer, task prompts. The runtime drafter is `drafter/`."""
