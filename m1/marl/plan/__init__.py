"""Placement: GPU memory estimates, the plan as data (which learner rank, engine and rollout chunk goes on which GPU),
building it from a config, and what the cluster has. Read by the learner groups and `m1 train --plan`; it never
loads a model."""
