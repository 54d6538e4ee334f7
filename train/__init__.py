"""Corrected asynchronous RL on top of the engines and the monitors (see README.md)."""
