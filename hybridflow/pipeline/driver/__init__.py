"""Ops the coordinator runs itself between stage ops (advantages, KL penalties, expressions):
the registry of driver ops, the RL ones (rl_ops) and the step logic's arithmetic and
score-advantages (expr).
"""
