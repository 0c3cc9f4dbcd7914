"""CriticalKV's selection rule (`rule.Critical`, wrapping a base method) and its projected
value norms. HeadKV, the base of its third integration, is a baseline
(`kvjax.methods.baselines.headkv`)."""

from kvjax.methods.critical.rule import Critical  # noqa: F401
