"""Experiments as commands: stages (SFT -> MARL -> eval) x arms x seeds, each an ordinary run, then a report."""
