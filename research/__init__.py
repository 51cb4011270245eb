"""Research command lines: the benchmark (`bench`), the batching benchmark (`batch_bench`), the real-width probe
(`scale_probe`), the decoding analysis (`analysis`) and tiny-target training (`train_target`). The `spot-dlm`
model never imports them; each runs as `python -m research.<name>`."""
