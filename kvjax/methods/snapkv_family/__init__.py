"""The SnapKV family and the classic eviction baselines the five papers compare against:
SnapKV, PyramidKV, AdaKV (Ada-SnapKV, Ada-PyramidKV), StreamingLLM, TOVA, H2O and
kvpress's observed attention. All are `kvjax.compression.eviction` methods."""

from kvjax.methods.snapkv_family.adakv import AdaPyramidKV, AdaSnapKV  # noqa: F401
from kvjax.methods.snapkv_family.h2o import H2O  # noqa: F401
from kvjax.methods.snapkv_family.observed_attention import ObservedAttention  # noqa: F401
from kvjax.methods.snapkv_family.pyramidkv import PyramidKV  # noqa: F401
from kvjax.methods.snapkv_family.snapkv import SnapKV  # noqa: F401
from kvjax.methods.snapkv_family.streaming_llm import StreamingLLM  # noqa: F401
from kvjax.methods.snapkv_family.tova import TOVA  # noqa: F401
