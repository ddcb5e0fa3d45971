"""The trained agents: one learner per agent, a pair on the same weights (the Sampler the team generates with and
the Actor that scores and updates them), with what each leans on (loading, scoring, the optimizer step, state on
disk), the local and Ray groups that hold them, and the process-group plumbing (ZeRO-2, Ray). Here because they
change weights; what they train on (samples, losses) comes from m1/marl/rollout and m1/marl/algo."""
