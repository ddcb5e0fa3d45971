"""The trained agents: one learner per agent (its update, loading its model, policy and reference, scoring tokens,
its state on disk) with the sampler the team generates with on its weights, the local and Ray groups that hold
them, and the process-group plumbing (ZeRO-2, Ray). Here because they change weights; what they train on (samples, losses) comes from m1/marl/rollout and m1/marl/algo."""
