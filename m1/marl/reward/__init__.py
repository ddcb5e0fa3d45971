"""What an episode earns: R_res, R_format, R_col and the seed kinds' own rewards, and the judges that grade plans and
open answers (what a judge is given and returns, the LLM judge, the offline rubric judge). It reads episodes only,
so the SFT keep rule, the team kinds and the config can all stand on it."""
