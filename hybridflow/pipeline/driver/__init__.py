"""Ops the coordinator runs itself between stage ops (advantages, KL penalties, expressions):
the registry of driver ops and the RL ones.
"""
