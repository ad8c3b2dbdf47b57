"""Islands: train diffusion and flow-matching models on one machine, many GPUs, or isolated islands."""

__version__ = "0.1.0"
