"""The emu pack (software FP8); see :mod:`hal.packs.emu.pack`."""
