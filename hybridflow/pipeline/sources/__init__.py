"""Data sources: what feeds each step's micro-batches (prompts for RL, pairs for SFT,
datasets given to the Python API).
"""
