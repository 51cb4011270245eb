"""Drafting baselines that share SPOT's decoder and verifier: only the proposer differs."""
