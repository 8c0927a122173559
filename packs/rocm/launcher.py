"""Launching the rocm pack's code objects through the HIP module API of the HIP runtime that the ROCm
build of torch already ships (``libamdhip64``), with ctypes: no ROCm SDK at install time, no compiled
extension. The code object for the device's arch is loaded once per device with ``hipModuleLoadData``;
kernels are launched with ``hipModuleLaunchKernel`` on torch's current stream, their arguments given
as ``kernelParams`` (pointers to each value, laid out by the runtime from the code object's metadata).
Every HIP error becomes a :class:`HipError` carrying HIP's own name and description of it.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import glob
import os
import pathlib
import threading

import torch

from . import kernels


class HipError(RuntimeError):
    """A HIP runtime call failed; the message has the call, HIP's error name, code and description."""

    def __init__(self, call: str, code: int, name: str, text: str):
        super().__init__(f"{call} failed: {name} ({code}): {text}")
        self.call, self.code, self.name, self.text = call, code, name, text


def _loaded_hip() -> str | None:
    """The libamdhip64 this process has already loaded (torch's), so launches share its runtime."""
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                path = line.rsplit(" ", 1)[-1].strip()
                if "libamdhip64.so" in os.path.basename(path):
                    return path
    except OSError:
        pass
    return None


def find_library() -> tuple[str | None, str]:
    """(path, how it was found) of the HIP runtime, or (None, why none was found)."""
    path = _loaded_hip()
    if path:
        return path, "already loaded by torch"
    torch_lib = pathlib.Path(torch.__file__).parent / "lib"
    found = sorted(glob.glob(str(torch_lib / "libamdhip64.so*")))
    if found:
        return found[0], f"next to torch ({torch_lib})"
    for cand in filter(None, [ctypes.util.find_library("amdhip64"), "/opt/rocm/lib/libamdhip64.so"]):
        if os.path.exists(cand) or "/" not in cand:
            return cand, "system"
    return None, f"no libamdhip64 loaded, next to torch ({torch_lib}) or in /opt/rocm/lib"


class HipRuntime:
    """The handful of HIP module-API calls the pack needs."""

    def __init__(self, path: str):
        lib = ctypes.CDLL(path)
        vp, u = ctypes.c_void_p, ctypes.c_uint
        lib.hipGetErrorString.restype = ctypes.c_char_p
        lib.hipGetErrorString.argtypes = [ctypes.c_int]
        lib.hipGetErrorName.restype = ctypes.c_char_p
        lib.hipGetErrorName.argtypes = [ctypes.c_int]
        lib.hipModuleLoadData.restype = ctypes.c_int
        lib.hipModuleLoadData.argtypes = [ctypes.POINTER(vp), ctypes.c_char_p]
        lib.hipModuleGetFunction.restype = ctypes.c_int
        lib.hipModuleGetFunction.argtypes = [ctypes.POINTER(vp), vp, ctypes.c_char_p]
        lib.hipModuleLaunchKernel.restype = ctypes.c_int
        lib.hipModuleLaunchKernel.argtypes = [vp, u, u, u, u, u, u, u, vp, ctypes.POINTER(vp), ctypes.POINTER(vp)]
        self.path, self._lib = path, lib

    def check(self, err: int, call: str) -> None:
        if err != 0:
            name = self._lib.hipGetErrorName(err)
            text = self._lib.hipGetErrorString(err)
            raise HipError(call, err, name.decode() if name else "unknown", text.decode() if text else "unknown")

    def load_module(self, image: bytes) -> int:
        mod = ctypes.c_void_p()
        self.check(self._lib.hipModuleLoadData(ctypes.byref(mod), image), "hipModuleLoadData")
        return mod.value

    def get_function(self, module: int, name: str) -> int:
        fn = ctypes.c_void_p()
        self.check(self._lib.hipModuleGetFunction(ctypes.byref(fn), ctypes.c_void_p(module), name.encode()),
                   f"hipModuleGetFunction({name})")
        return fn.value

    def launch(self, function: int, grid, block, params, stream: int, name: str = "kernel") -> None:
        self.check(self._lib.hipModuleLaunchKernel(ctypes.c_void_p(function), *grid, *block, 0, ctypes.c_void_p(stream),
                                                   params, None), f"hipModuleLaunchKernel({name})")


def device_arch(device: torch.device) -> str:
    """gfx name of a torch device (``gcnArchName`` without its feature flags)."""
    return torch.cuda.get_device_properties(device).gcnArchName.split(":")[0]


class HipBackend:
    """An :mod:`ops` backend on AMD GPUs: each code object loaded once per device (the kernel's
    :func:`kernels.code_object` names which; it lies next to ``code_objects[arch]``), functions cached
    by name."""

    def __init__(self, runtime: HipRuntime, code_objects: dict[str, pathlib.Path]):
        self.runtime, self.code_objects = runtime, code_objects
        self._functions: dict[tuple[int, str], int] = {}
        self._modules: dict[tuple[int, str], int] = {}
        self._lock = threading.Lock()

    def arch(self, device: torch.device) -> str:
        return device_arch(device)

    def compute_units(self, device: torch.device) -> int:
        """CUs of the device (a host query: no device work), for the MLA split-K plan."""
        return torch.cuda.get_device_properties(device).multi_processor_count

    def _function(self, device: torch.device, name: str) -> int:
        index = device.index if device.index is not None else torch.cuda.current_device()
        key = (index, name)
        fn = self._functions.get(key)
        if fn is not None:
            return fn
        file = kernels.code_object(name)
        with self._lock, torch.cuda.device(index):
            if (index, file) not in self._modules:
                arch = self.arch(torch.device("cuda", index))
                if arch not in self.code_objects:
                    raise RuntimeError(f"rocm pack: no code object for {arch} (built for "
                                       f"{', '.join(sorted(self.code_objects)) or 'nothing'})")
                path = self.code_objects[arch].with_name(file)
                if not path.exists():
                    raise RuntimeError(f"rocm pack: {path} is missing (this build predates it; rebuild the pack)")
                self._modules[(index, file)] = self.runtime.load_module(path.read_bytes())
            fn = self.runtime.get_function(self._modules[(index, file)], name)
            self._functions[key] = fn
        return fn

    def launch(self, kernel: str, grid, values: dict, tensors) -> None:
        device = tensors[0].device
        fn = self._function(device, kernel)
        params, keep = kernels.kernel_params(kernels.family(kernel), values)
        stream = torch.cuda.current_stream(device).cuda_stream
        self.runtime.launch(fn, tuple(int(g) for g in grid), (kernels.THREADS, 1, 1), params, stream, kernel)
        del keep  # hipModuleLaunchKernel copied the argument values
