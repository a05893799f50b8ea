"""model-router plugin `tensorrt`: TensorRT engines built by `model-router export --format tensorrt`.

Importing this package does not import `tensorrt`; the plugin checks for it (and a GPU) at load.
"""

from model_router_tensorrt.limits import BatchLimits, limits_from_profile, plan_chunks, startup_problems
from model_router_tensorrt.plugin import TensorRTOptions, TensorRTPlugin

__all__ = ["BatchLimits", "TensorRTOptions", "TensorRTPlugin", "limits_from_profile", "plan_chunks", "startup_problems"]
