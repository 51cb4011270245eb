"""budget=auto, the default: the start-up measurement of the target's cost by rows and of drafting's host work
(`costs`); the per-step choice of drafted rows that uses it is `decoding.step_policy.StepPolicy`."""

from lm_eval_spot.budget.costs import MAX_BUDGET, CanvasCheck, build_policy, measure_startup, row_grid

__all__ = ["MAX_BUDGET", "CanvasCheck", "build_policy", "measure_startup", "row_grid"]
