"""Pooled window attention scores of the prefix (SnapKV family, ASL, LAVa, CriticalKV)."""
