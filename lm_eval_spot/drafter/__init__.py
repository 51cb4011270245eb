"""The SPOT drafter: a small commit-order model over stale target distributions, and the draft trees it grows."""
