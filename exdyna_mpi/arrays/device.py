"""Arrays layer: the ONE place that decides between a real CUDA device (CuPy) and the simulator.

``exdyna_mpi/kernels/cuda/config.py`` reads Numba's ``NUMBA_ENABLE_CUDASIM`` (set before numba is imported) to
choose its launch shapes; everything above the kernels asks ``BACKEND`` instead of branching on it:

- ``SimulatedBackend``: the Numba CUDA simulator. CuPy cannot allocate there, so device buffers are
  NumPy arrays that the simulator runs the CUDA kernels on; copies are plain NumPy copies. CI runs the
  whole device path (kernels, ``CudaOps``, ``DeviceExchange`` staging) this way without a GPU.
- ``CupyBackend``: CuPy buffers on CuPy's current stream, pinned host buffers for staging.

Like ``numba.cuda``'s own switch (``numba/cuda/__init__.py`` imports either the simulator or the
driver API), the choice is made once, at import. Imported only when a CUDA device is used, so a CPU
run never loads ``numba.cuda``.
"""
import numpy as np

from ..kernels import cuda as _k

#: True when the Numba CUDA simulator runs the CUDA kernels (``NUMBA_ENABLE_CUDASIM=1``).
SIMULATOR = _k.SIMULATOR


class SimulatedBackend:
    """Device buffers are NumPy arrays; the CUDA kernels run in the Numba simulator."""

    simulated = True
    xp = np

    def stream(self):
        """The stream kernels are launched on (Numba's default under the simulator)."""
        return 0

    def device_key(self):
        return -1

    def stream_key(self):
        return 0

    def fill_zero(self, x):
        x.fill(0)

    def read_words(self, w):
        """A small device int64 array as a host int64 array (one device->host copy on a GPU)."""
        return np.array(w, dtype=np.int64)

    def read_words_async(self, w):
        """Queue the copy of a small device int64 array to the host; ``wait_words`` hands it back."""
        return np.array(w, dtype=np.int64)

    def wait_words(self, handle):
        return handle

    def to_host(self, x):
        return np.asarray(x)

    def from_host(self, a):
        return np.array(a, copy=True)

    def synchronize(self):
        pass

    def pinned_empty(self, n, dtype):
        return np.empty(n, dtype=dtype)

    def to_host_async(self, dev, host):
        np.copyto(host, dev)

    def to_device_async(self, host, dev):
        np.copyto(dev, host)


class CupyBackend:  # pragma: no cover - real GPU only
    """CuPy buffers; every copy and launch on CuPy's current stream."""

    simulated = False

    def __init__(self):
        try:
            import cupy
        except ImportError:  # ops_for("cuda") is only reached when gpu_available() said yes
            cupy = None
        self.xp = cupy
        self._streams = {}  # (device id, CuPy stream pointer) -> Numba external stream
        self._words = {}    # (device id, stream pointer) -> (pinned int64 buffer, event): read_words_async

    def stream(self):
        """The Numba view of CuPy's current stream (on the current device)."""
        key = (self.device_key(), self.stream_key())
        s = self._streams.get(key)
        if s is None:
            from numba import cuda

            if len(self._streams) > 256:  # streams come and go: keep the table small
                self._streams.clear()
            s = self._streams[key] = cuda.external_stream(key[1])
        return s

    def stream_key(self):
        return self.xp.cuda.get_current_stream().ptr

    def device_key(self):
        return self.xp.cuda.Device().id

    def fill_zero(self, x):
        """``x[:] = 0`` as ``cudaMemsetAsync`` on the current stream when ``x`` is contiguous."""
        if x.flags.c_contiguous:
            x.data.memset_async(0, x.nbytes)
        else:
            x.fill(0)

    def read_words(self, w):
        return w.get(stream=self.xp.cuda.get_current_stream()).astype(np.int64, copy=False)

    def read_words_async(self, w):
        """Queue ``w``'s copy into a pinned buffer of this stream and an event behind it: the host
        can wait for those words while the device goes on with what is queued after them."""
        stream = self.xp.cuda.get_current_stream()
        key = (self.device_key(), stream.ptr)
        got = self._words.get(key)
        if got is None or got[0].shape[0] < w.shape[0]:
            if len(self._words) > 256:
                self._words.clear()
            got = self._words[key] = (self.pinned_empty(max(w.shape[0], 64), np.int64),
                                      self.xp.cuda.Event(block=False, disable_timing=True))
        buf, ev = got
        host = buf[:w.shape[0]]
        w.get(out=host, stream=stream, blocking=False)
        ev.record(stream)
        return host, ev

    def wait_words(self, handle):
        host, ev = handle
        ev.synchronize()
        return host.astype(np.int64, copy=True)

    def to_host(self, x):
        return self.xp.asnumpy(x)

    def from_host(self, a):
        return self.xp.asarray(a)

    def synchronize(self):
        """Wait for CuPy's current stream: once before a device buffer goes to MPI. A stream with
        nothing queued since the last wait (e.g. right after the count words were read) is not
        waited on again: ``cudaStreamQuery`` answers without blocking."""
        s = self.xp.cuda.get_current_stream()
        if not s.done:
            s.synchronize()

    def pinned_empty(self, n, dtype):
        import cupyx

        return cupyx.empty_pinned(n, dtype=dtype)

    def to_host_async(self, dev, host):
        """Queue ``host[:] = dev`` on the current stream (host is pinned: truly asynchronous)."""
        dev.get(out=host, stream=self.xp.cuda.get_current_stream(), blocking=False)

    def to_device_async(self, host, dev):
        """Queue ``dev[:] = host`` on the current stream."""
        dev.set(host, stream=self.xp.cuda.get_current_stream())


#: The backend of this process, chosen once.
BACKEND = SimulatedBackend() if SIMULATOR else CupyBackend()
