"""lm-eval-spot: SPOT speculative decoding for diffusion language models, as an lm-evaluation-harness plugin.

Importing this package is cheap: torch, transformers and lm_eval are imported only by the modules that need them.
"""

__version__ = "0.1.0"
