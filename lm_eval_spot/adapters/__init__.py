"""Target adapters: one small interface (`base.TargetAdapter`) per target family."""
