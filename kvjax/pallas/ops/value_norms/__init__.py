"""CriticalKV's projected value norms ||V_i W_O^h||_1, mean over a KV head's query heads."""
