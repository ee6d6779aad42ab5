"""Calibration: fits TaSQ codebooks for a model and writes one artifact."""
