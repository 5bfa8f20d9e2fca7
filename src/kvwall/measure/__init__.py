"""Measure: calibrate this machine (calibrate.py), time the engine and hold predictions against it."""
