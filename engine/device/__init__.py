"""Where tensors live: device and dtype resolution, and host-to-device uploads."""
