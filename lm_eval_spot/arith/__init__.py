"""A tiny, CPU-learnable arithmetic task (spot_arith) and its number-aware tokenizer.

Used to train and evaluate the embedded block-diffusion target shipped in lm_eval_spot/assets/spot-arith-target.
"""
