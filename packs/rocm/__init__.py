"""The rocm pack (native HIP for AMD Instinct gfx90a / gfx942); see :mod:`hal.kernelpacks.rocm.pack`."""
