"""Attention of one new query per head over a masked, fixed-shape KV cache."""
