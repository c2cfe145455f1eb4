"""What fits: model resolution, devices, KV cache bytes, the memory plan, admission control."""
