"""The cuda pack: native CUDA paged decode attention for NVIDIA sm89+; see :mod:`hal.kernelpacks.cuda.pack`."""
