"""CriticalKV's selection rule (`rule.Critical`, wrapping a base method), its projected
value norms, and HeadKV (a base of its third integration) with the offline head scores
HeadKV's budgets come from."""

from kvjax.methods.critical.headkv import HeadKV  # noqa: F401
from kvjax.methods.critical.rule import Critical  # noqa: F401
