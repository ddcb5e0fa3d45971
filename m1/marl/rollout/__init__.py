"""What a step samples: its questions (the seeded, checkpointed cursor, and the metrics log beside it) and its K
episodes per question through the team, turned into per-agent samples. The records the rest of training reads,
so they import nothing else of m1/marl; the engines that serve the samplers and the asynchronous producer sit
above the config (m1/marl/rollout_engines.py, m1/marl/producer.py)."""
