"""User commands beside lm_eval: the device self-check (`check`) and run comparison (`compare`)."""
