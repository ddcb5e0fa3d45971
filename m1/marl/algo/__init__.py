"""The algorithm's rules, each a registry a config names: credit rules (who is credited with what, dynamic sampling),
advantage estimators, policy objectives, and the loss reductions and old-log-prob modes they reduce with. Pure rules
over rewards and log-probs: they read a step's episodes (m1/marl/rollout) and never a learner, an engine or a plan."""
