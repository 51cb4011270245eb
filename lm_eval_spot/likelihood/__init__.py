"""Likelihood scoring for lm-eval's `loglikelihood` / `loglikelihood_rolling` requests (multiple choice,
perplexity): the masked-diffusion evidence lower bound, enumerated exactly where the mask patterns are few and
estimated by stratified Monte Carlo otherwise, with its standard error.

- `masks`: which tokens each row masks and how its log-probabilities are weighted (pure; randomness passed in);
- `scorer`: the target forwards that score a (context, continuation) pair (block-wise on block-causal targets, the
  whole sequence on fully bidirectional ones), requests batched into shared forwards;
- `harness`: lm-eval's side (tokenisation of pairs, rolling windows, the greedy flag) and the run's statistics.
"""
