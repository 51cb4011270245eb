"""budget=auto: size each round's draft tree to maximise expected committed tokens per second.

At start-up the verification cost curve (target forward time vs number of replicas) and the order model's cost
are measured on the current hardware. Each round the tree grows best first, and stops where an optimistic bound
says no larger tree could raise the round's rate; it is then cut to the D (the top-D nodes by prefix mass) that
maximises (1 + sum of their calibrated masses) / (round time(1 + D) + drafting time). The search goes node by
node over every order source (`_RoundSize` prices each expansion).
Learned online, from the rounds themselves: the round time by row count (`RoundCosts`: the start-up curve
rescaled to what rounds really cost, verification and a long prefix included), the tree bookkeeping per expanded
node, how often the verifier accepts nodes of each depth against their prefix masses (over all requests), and
each request's own acceptances against its calibrated predictions. Tree sizes, and hence NFE, can therefore vary
from run to run. Any tree is verified exactly, so the output does not depend on these choices.
"""

from lm_eval_spot.budget.costs import (MAX_BUDGET, CostModel, RoundCosts, best_cut, convex_fit,
                                       measure_costs, monotone_fit)
from lm_eval_spot.budget.proposer import PRIOR_MASS, AutoBudgetProposer

__all__ = ["MAX_BUDGET", "PRIOR_MASS", "AutoBudgetProposer", "CostModel", "RoundCosts", "best_cut", "convex_fit",
           "measure_costs", "monotone_fit"]
