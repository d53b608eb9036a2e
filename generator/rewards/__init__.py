"""Rewards: how a generator turns a completion into a score.

functions.py (the reward functions: the user's, the built-ins by data_source, weighted combinations, DAPO's overlong
shaping), scorer.py (`RewardScorer`: runs them off the generator's event loop, in a pool of worker processes),
builtin/ (the built-in scorers), client.py (the reward server's client; the server itself is
generator/reward_server/, a process of its own) and errors.py (`RewardError`, which all of them raise).
"""
