"""Measurement: timing plans side by side, which rounds count, the machine's pace and the run's self-check."""
