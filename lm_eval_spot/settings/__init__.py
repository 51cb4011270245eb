"""The run's configuration: model arguments, the decoding modes, the model cards' defaults, the proposer factory, CPU threads."""
