"""One declarative mapping table per model family; importing this package registers them all."""

from megatron_bridge.models import llama, mixtral, qwen  # noqa: F401  (registration side effect)
