"""What a run reports: its statistics and the results' `spot` block."""
