"""Running the rocm pack's kernels on the CPU: the HIP sources compiled for the host against
``csrc/wave64_host.h`` (see docs/rocm.md, "Emulation"), driven by the same :mod:`ops` code and the same
argument packing (:func:`kernels.pack`) as the HIP launcher."""

from __future__ import annotations

import ctypes
import functools
import pathlib

import torch

from . import kernels


class EmulationError(RuntimeError):
    """A kernel did something the hardware would not allow or that the emulation catches: an
    out-of-bounds or misaligned access, a wave-wide instruction under divergence, a deadlock."""


class Emulator:
    """One compiled emulation library (``build.emulation_library``): gfx942 or gfx90a flavour."""

    def __init__(self, path):
        self.path = pathlib.Path(path)
        lib = ctypes.CDLL(str(self.path))
        lib.hal_wave64_target.restype = ctypes.c_char_p
        lib.hal_wave64_error.restype = ctypes.c_char_p
        lib.hal_wave64_lds_bytes.restype = ctypes.c_size_t
        lib.hal_wave64_num_kernels.restype = ctypes.c_int
        lib.hal_wave64_kernel_name.restype = ctypes.c_char_p
        lib.hal_wave64_kernel_name.argtypes = [ctypes.c_int]
        lib.hal_wave64_kernarg_size.restype = ctypes.c_long
        lib.hal_wave64_kernarg_size.argtypes = [ctypes.c_char_p]
        lib.hal_wave64_launch.restype = ctypes.c_int
        lib.hal_wave64_launch.argtypes = [ctypes.c_char_p, ctypes.POINTER(ctypes.c_uint), ctypes.c_uint, ctypes.c_char_p,
                                       ctypes.c_size_t, ctypes.POINTER(ctypes.c_uint64), ctypes.c_int, ctypes.c_int,
                                       ctypes.c_uint]
        self._lib = lib
        self.arch = lib.hal_wave64_target().decode()

    def kernel_names(self) -> list[str]:
        return sorted(self._lib.hal_wave64_kernel_name(i).decode() for i in range(self._lib.hal_wave64_num_kernels()))

    @functools.cached_property
    def kernel_set(self) -> frozenset[str]:
        return frozenset(self.kernel_names())

    def kernarg_size(self, name: str) -> int:
        return self._lib.hal_wave64_kernarg_size(name.encode())

    def lds_bytes(self) -> int:
        """LDS the last launch's workgroups allocated (the emulation's count of __shared__ bytes)."""
        return self._lib.hal_wave64_lds_bytes()

    def launch(self, name: str, grid, kernarg: bytes, ranges, schedule: int = 0, seed: int = 0) -> None:
        g = (ctypes.c_uint * 3)(*grid)
        flat = [v for r in ranges for v in r]
        rng = (ctypes.c_uint64 * max(1, len(flat)))(*flat)
        rc = self._lib.hal_wave64_launch(name.encode(), g, kernels.THREADS, kernarg, len(kernarg), rng, len(ranges),
                                      schedule, seed)
        if rc != 0:
            raise EmulationError(self._lib.hal_wave64_error().decode())


def _range(t: torch.Tensor) -> tuple[int, int]:
    s = t.untyped_storage()
    return s.data_ptr(), s.nbytes()


class EmulatorBackend:
    """An :mod:`ops` backend over CPU tensors. ``schedule``: 0 work-items in order, 1 reversed,
    2 shuffled with ``seed`` (different interleavings expose missing barriers). ``more``: emulations of
    the arch's other code objects (a mixed batch launches kernels of two); each kernel runs in the one
    that defines it."""

    def __init__(self, emulator: Emulator, schedule: int = 0, seed: int = 0, more: tuple[Emulator, ...] = ()):
        self.emulator, self.schedule, self.seed = emulator, schedule, seed
        self.emulators = (emulator, *more)
        if any(e.arch != emulator.arch for e in more):
            raise ValueError(f"emulations of different archs: {[e.arch for e in self.emulators]}")
        self.launches: list[tuple[str, tuple[int, int, int]]] = []

    def arch(self, device) -> str:
        return self.emulator.arch

    def _for(self, kernel: str) -> Emulator:
        for e in self.emulators:
            if kernel in e.kernel_set:
                return e
        raise EmulationError(f"no emulation library here defines {kernel} (libraries: "
                             f"{', '.join(e.path.name for e in self.emulators)})")

    def launch(self, kernel: str, grid, values: dict, tensors) -> None:
        buf = kernels.pack(kernels.family(kernel), values)
        ranges = [_range(t) for t in tensors if t.numel() > 0]
        self.launches.append((kernel, tuple(grid)))
        self._for(kernel).launch(kernel, grid, buf, ranges, self.schedule, self.seed)
