"""`python -m lm_eval_spot.training ...`: the drafter training command (`training.train`)."""

from lm_eval_spot.training.train import main

main()
