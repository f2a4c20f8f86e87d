"""The launch without Numba's per-call work: the one module that relies on numba-cuda internals.

numba-cuda's ``kernel[grid, block, stream](*args)`` types every argument, wraps every array
(``to_device``) and builds a launch config on every call: about 100 us of host time per launch on
an H100 node, which made the step host-bound (docs/gpu.md). numba-cuda has no public API that hands
out a compiled overload's loaded function or launches it with arguments marshalled once, so this
module does both itself, and it is the only place in the package that knows how:

- the overload: ``Dispatcher.overloads[argtypes]`` for ``Dispatcher.typeof_pyval`` of each argument
  (the same look-up the dispatcher makes), then ``.library.get_cufunc().kernel``, the cuda.core
  ``Kernel`` that numba-cuda loaded (the compiled library and its cufunc are internal objects);
- the parameter layout of ``_Kernel._prepare_args``: a 1-D array is 7 words (meminfo, parent,
  size, itemsize, data, shape, strides), a scalar a ctypes value of its Numba type. Numba's data
  model for arrays, not a documented ABI.

A numba-cuda whose internals moved makes ``_FastLaunch`` raise; ``launch.launch_kernel`` then warns
and keeps Numba's own launch for that kernel (slower, same results). cuda.core's ``LaunchConfig`` and
``launch`` and libcuda's ``cuLaunchKernel`` are public APIs.
"""
import ctypes
import warnings

import numpy as np

_CTYPES = {"int64": ctypes.c_int64, "int32": ctypes.c_int32, "uint32": ctypes.c_uint32,
           "uint64": ctypes.c_uint64, "float32": ctypes.c_float, "float64": ctypes.c_double}

# ``cuLaunchKernel`` called through ctypes with a parameter block built once per launch shape: only
# the values change between calls. cuda.core's ``launch`` converts every argument on every call:
# 13-17 us (2 arguments) and 37-38 us (the 21-argument pass) of host time per launch on the H100 node
# against 9-12 and 20-25 us this way (bench_gpu.py's launch_costs; 8-11 launches per step).
# ``CONFIG.launch`` (env EXDYNA_CUDA_LAUNCH) = "core" keeps cuda.core's launch, "numba" Numba's own.
_cu = None


class _FastLaunch:
    """One compiled overload, one stream: the arguments marshalled by hand; ``driver``: through
    ``cuLaunchKernel`` (else cuda.core's launch, also where the driver's entry points are missing)."""

    def __init__(self, kernel, args, nb, bd, stream, driver):
        from numba.cuda import types as nt

        argtypes = tuple(kernel.typeof_pyval(a) for a in args)
        kern = kernel.overloads[argtypes]
        self.fn = kern.library.get_cufunc().kernel
        self.plan = []
        for ty in kern.argument_types:
            if isinstance(ty, nt.Array) and ty.ndim == 1:
                self.plan.append(ty.layout)   # "C": the code assumes unit stride
            elif isinstance(ty, nt.Integer) or ty in (nt.float32, nt.float64):
                self.plan.append(_CTYPES[str(ty)])
            elif ty == nt.boolean:
                self.plan.append(bool)
            else:
                raise NotImplementedError(f"fast launch: argument type {ty}")
        self.stream = stream
        self.driver = None
        if driver:
            try:
                self.driver = _DriverLaunch(self.fn, self.plan, stream)
            except Exception as e:  # pragma: no cover - a driver or cuda.core without these entry points
                warnings.warn(f"exdyna_mpi: no raw driver launch ({e!r}); cuda.core's launch for {kernel.__name__}",
                              RuntimeWarning)
        if self.driver is None:
            from cuda.core import LaunchConfig, launch

            # not cooperative: LaunchConfig's default (the keyword's name changed in cuda.core 1.0)
            self.config = LaunchConfig(grid=nb, block=bd, shmem_size=0)
            self.shape = (nb, bd)
            self.launch = launch

    def __call__(self, args, nb, bd):
        """Launch; False (nothing launched) for a strided array where the overload wants unit stride.
        ``nb``, ``bd``: the driver path takes any shape; cuda.core's keeps the one it was made with."""
        if self.driver is not None:
            return self.driver(args, nb, bd)
        if (nb, bd) != self.shape:
            return False
        ka = []
        for how, v in zip(self.plan, args):
            if how.__class__ is str:
                ptr, n, stride, item = _array_fields(v)
                if stride != item and how == "C" and n > 1:
                    return False
                ka += (0, 0, n, item, ptr, n, stride)
            elif how is bool:
                ka.append(bool(v))
            else:
                ka.append(how(v))
        self.launch(self.stream, self.config, self.fn, *ka)
        return True


def _driver():
    """libcuda's ``cuLaunchKernel`` and ``cuKernelGetFunction`` with their C signatures."""
    global _cu
    if _cu is None:
        lib = ctypes.CDLL("libcuda.so.1")
        launch = lib.cuLaunchKernel
        launch.argtypes = [ctypes.c_void_p] + [ctypes.c_uint] * 7 + [ctypes.c_void_p] * 3
        launch.restype = ctypes.c_int
        get = lib.cuKernelGetFunction
        get.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_void_p]
        get.restype = ctypes.c_int
        _cu = (launch, get)
    return _cu


def _handle(h):
    h = getattr(h, "handle", h)
    v = getattr(h, "value", None)   # a ctypes handle
    return int(v if v is not None else h)


class _DriverLaunch:
    """The parameter block of one kernel (Numba's layout: an array is meminfo, parent, size,
    itemsize, data, shape, strides; a scalar its C type) and a raw ``cuLaunchKernel``."""

    def __init__(self, kernel, plan, stream):
        launch, get = _driver()
        func = ctypes.c_void_p()
        rc = get(ctypes.byref(func), _handle(kernel))   # cuda.core loads kernels as CUkernel (a library's)
        if rc != 0:
            raise RuntimeError(f"cuKernelGetFunction failed ({rc})")
        self.func, self.launch = func, launch
        self.stream = ctypes.c_void_p(int(stream.__cuda_stream__()[1]) if stream else 0)
        self.slots, self.plan = [], []
        for how in plan:
            if how.__class__ is str:
                vals = [ctypes.c_void_p(0), ctypes.c_void_p(0), ctypes.c_int64(), ctypes.c_int64(),
                        ctypes.c_void_p(), ctypes.c_int64(), ctypes.c_int64()]
                self.plan.append((how, vals[2], vals[3], vals[4], vals[5], vals[6]))
            else:
                vals = [ctypes.c_bool() if how is bool else how()]
                self.plan.append((how, vals[0]))
            self.slots += vals
        self.params = (ctypes.c_void_p * len(self.slots))(*[ctypes.addressof(v) for v in self.slots])

    def __call__(self, args, nb, bd):
        for p, v in zip(self.plan, args):
            if p[0].__class__ is str:
                ptr, n, stride, item = _array_fields(v)
                if stride != item and p[0] == "C" and n > 1:
                    return False
                p[1].value, p[2].value, p[3].value, p[4].value, p[5].value = n, item, ptr, n, stride
            else:
                p[1].value = v
        rc = self.launch(self.func, nb, 1, 1, bd, 1, 1, 0, self.stream, self.params, None)
        if rc != 0:
            raise RuntimeError(f"exdyna_mpi: cuLaunchKernel failed with CUDA error {rc}")
        return True


def _array_fields(a):
    """(device pointer, length, stride in bytes, itemsize) of a 1-D device array."""
    data = getattr(a, "data", None)
    ptr = getattr(data, "ptr", None)
    if ptr is not None:  # CuPy
        return ptr, a.shape[0], a.strides[0], a.itemsize
    cai = a.__cuda_array_interface__
    item = np.dtype(cai["typestr"]).itemsize
    strides = cai.get("strides")
    return cai["data"][0], cai["shape"][0], strides[0] if strides else item, item
