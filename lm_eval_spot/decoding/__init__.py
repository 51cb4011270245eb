"""Decoding: the target's exact transition, draft trees, verification, and the shared block loop."""
