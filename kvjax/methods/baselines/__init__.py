"""The SnapKV family and the classic eviction baselines the five papers compare against:
SnapKV, PyramidKV, AdaKV (Ada-SnapKV, Ada-PyramidKV), HeadKV (with its offline head
scores, `head_scores`), StreamingLLM, TOVA, H2O and kvpress's observed attention. All are `kvjax.compression.eviction` methods."""

from kvjax.methods.baselines.adakv import AdaPyramidKV, AdaSnapKV  # noqa: F401
from kvjax.methods.baselines.h2o import H2O  # noqa: F401
from kvjax.methods.baselines.headkv import HeadKV  # noqa: F401
from kvjax.methods.baselines.observed_attention import ObservedAttention  # noqa: F401
from kvjax.methods.baselines.pyramidkv import PyramidKV  # noqa: F401
from kvjax.methods.baselines.snapkv import SnapKV  # noqa: F401
from kvjax.methods.baselines.streaming_llm import StreamingLLM  # noqa: F401
from kvjax.methods.baselines.tova import TOVA  # noqa: F401
