"""Reward role backends: function, model (stages/reward/), http and zmq services."""
