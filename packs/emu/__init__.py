"""The emu pack (software FP8); see :mod:`hal.kernelpacks.emu.pack`."""
