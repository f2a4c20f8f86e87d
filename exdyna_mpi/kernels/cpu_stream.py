"""CPU kernels: ``acc = residual + grad`` written with nontemporal (streaming) stores.

A plain store of a line that is not in cache first reads it (write-allocate), so the step's add
moves 16 bytes per float32 element, not 12: 4 of them are a read of the old ``acc`` that is
overwritten at once. A nontemporal store writes the line without reading it. On this project's
2-core AMD EPYC VM an add of 10M float32 took 0.62x the time of ``np.add`` that way (one process;
``jobs/bench_select.py`` measures the whole step). The added values are then not in cache, so a
caller that reads them back gets them another way: a copy into a small chunk buffer that stays in
L1 (``stream_add_copy``), the largest bit pattern in registers (``stream_add_max``), or the compare
of the measuring pass done in registers, a 64-bit word per group of 64 elements
(``add_mask_groups``).

The vector part is LLVM IR written here (a Numba ``@intrinsic``): Numba offers no nontemporal
store, and LLVM's loop vectoriser refuses to vectorise a loop of scalar nontemporal stores. Vectors
of 64 bytes, aligned stores; the unaligned head and the tail are scalar. The ``stream_*`` functions
end with ``sfence``, and ``add_mask_groups``' caller calls ``store_fence`` after its last call, so
the stores are ordered before whatever reads ``acc`` next (another thread after a join, MPI).
x86-64 only: elsewhere the ``stream_*`` functions are plain loops and ``group_aligned`` is False.
The values are the same bits either way: only the kind of store differs.

Editing this file: Numba's cache keys a cached function on its own source file only, so the
cached kernels of ``cpu_controller.py`` that call these keep the old code until their file changes
or ``exdyna_mpi/kernels/__pycache__/*.nb[ic]`` is removed (a fresh clone has no cache).
"""
import platform

from llvmlite import ir
from numba import njit, types
from numba.extending import intrinsic

#: nontemporal stores in use (x86-64). No switch: Numba's cache keeps a caller's compiled code
#: whatever a switch said when it was built, and its key already includes the machine's CPU.
ENABLED = platform.machine().lower() in ("x86_64", "amd64")

_VEC_BYTES = 64


def _vector_loop(context, builder, sig, args, copy, with_max):
    """The IR of ``a[i0 + j] = r[i0 + j] + g[i0 + j]`` for ``j < nvec * W`` (W elements of 64 bytes per
    step; ``a + i0`` 64-byte aligned), nontemporal; ``copy``: also ``c[i0 + j] =`` the same (plain
    stores); ``with_max``: returns the largest ``bits & sign_off`` of the sums."""
    arrays = [context.make_array(sig.args[k])(context, builder, args[k]) for k in range(3 + copy)]
    i0, nvec = args[3 + copy], args[4 + copy]
    dt = sig.args[0].dtype
    bits = 32 if dt == types.float32 else 64
    width = _VEC_BYTES * 8 // bits
    fty = ir.FloatType() if bits == 32 else ir.DoubleType()
    ity = ir.IntType(bits)
    vf, vi = ir.VectorType(fty, width), ir.VectorType(ity, width)
    nt = builder.module.add_metadata([ir.Constant(ir.IntType(32), 1)])
    fn = builder.function
    entry = builder.block
    loop = fn.append_basic_block("stream.loop")
    done = fn.append_basic_block("stream.done")
    zero = ir.Constant(nvec.type, 0)
    vzero = ir.Constant(vi, [0] * width)
    if with_max:   # sign_off in every lane
        off_mask = builder.insert_element(ir.Constant(vi, ir.Undefined), args[5 + copy], ir.Constant(ir.IntType(32), 0))
        off_mask = builder.shuffle_vector(off_mask, ir.Constant(vi, ir.Undefined),
                                          ir.Constant(ir.VectorType(ir.IntType(32), width), [0] * width))
    builder.cbranch(builder.icmp_signed(">", nvec, zero), loop, done)
    builder.position_at_end(loop)
    j = builder.phi(nvec.type)
    j.add_incoming(zero, entry)
    if with_max:
        vmax = builder.phi(vi)
        vmax.add_incoming(vzero, entry)
    at = builder.add(i0, builder.mul(j, ir.Constant(nvec.type, width)))
    ptr = [builder.bitcast(builder.gep(a.data, [at]), vf.as_pointer()) for a in arrays]
    s = builder.fadd(builder.load(ptr[0], align=bits // 8), builder.load(ptr[1], align=bits // 8))
    builder.store(s, ptr[2], align=_VEC_BYTES).set_metadata("nontemporal", nt)
    if copy:
        builder.store(s, ptr[3], align=bits // 8)
    if with_max:
        b = builder.and_(builder.bitcast(s, vi), off_mask)
        nmax = builder.select(builder.icmp_signed(">", b, vmax), b, vmax)
        vmax.add_incoming(nmax, loop)
    jn = builder.add(j, ir.Constant(nvec.type, 1))
    j.add_incoming(jn, loop)
    builder.cbranch(builder.icmp_signed("<", jn, nvec), loop, done)
    builder.position_at_end(done)
    if not with_max:
        return context.get_dummy_value()
    got = builder.phi(vi)
    got.add_incoming(vzero, entry)
    got.add_incoming(nmax, loop)
    red = builder.module.declare_intrinsic(f"llvm.vector.reduce.smax.v{width}i{bits}",
                                           fnty=ir.FunctionType(ity, [vi]))
    return builder.call(red, [got])


@intrinsic
def _add_copy_block(typingctx, r, g, a, c, i0, nvec):
    return (types.void(r, g, a, c, types.intp, types.intp),
            lambda c_, b, s, a_: _vector_loop(c_, b, s, a_, 1, False))


@intrinsic
def _add_max_block(typingctx, r, g, a, i0, nvec, sign_off):
    ity = types.int32 if a.dtype == types.float32 else types.int64
    return (ity(r, g, a, types.intp, types.intp, ity),
            lambda c, b, s, a_: _vector_loop(c, b, s, a_, 0, True))


def _splat(builder, value, vty):
    v = builder.insert_element(ir.Constant(vty, ir.Undefined), value, ir.Constant(ir.IntType(32), 0))
    return builder.shuffle_vector(v, ir.Constant(vty, ir.Undefined),
                                  ir.Constant(ir.VectorType(ir.IntType(32), vty.count), [0] * vty.count))


def _mask_loop(context, builder, sig, args):
    """The IR of ``add_mask_groups``: per group of 64 elements from ``i0`` (``a + i0`` 64-byte
    aligned), ``a = r + g`` nontemporal, and ``masks[j]`` = bit e set where ``(bits(a) & sign_off)
    >= low`` for element e of group j (the compare on the sums in registers, four or eight vector
    compares joined into one 64-bit word)."""
    arrays = [context.make_array(sig.args[k])(context, builder, args[k]) for k in range(4)]
    i0, ngroups, sign_off, low = args[4:8]
    dt = sig.args[0].dtype
    bits = 32 if dt == types.float32 else 64
    width = _VEC_BYTES * 8 // bits
    nvec = 64 // width
    fty = ir.FloatType() if bits == 32 else ir.DoubleType()
    ity = ir.IntType(bits)
    vf, vi = ir.VectorType(fty, width), ir.VectorType(ity, width)
    nt = builder.module.add_metadata([ir.Constant(ir.IntType(32), 1)])
    off_v, low_v = _splat(builder, sign_off, vi), _splat(builder, low, vi)
    fn = builder.function
    entry = builder.block
    loop = fn.append_basic_block("mask.loop")
    done = fn.append_basic_block("mask.done")
    zero = ir.Constant(ngroups.type, 0)
    builder.cbranch(builder.icmp_signed(">", ngroups, zero), loop, done)
    builder.position_at_end(loop)
    j = builder.phi(ngroups.type)
    j.add_incoming(zero, entry)
    start = builder.add(i0, builder.mul(j, ir.Constant(ngroups.type, 64)))
    parts = []
    for v in range(nvec):
        at = builder.add(start, ir.Constant(ngroups.type, v * width))
        ptr = [builder.bitcast(builder.gep(a.data, [at]), vf.as_pointer()) for a in arrays[:3]]
        s = builder.fadd(builder.load(ptr[0], align=bits // 8), builder.load(ptr[1], align=bits // 8))
        builder.store(s, ptr[2], align=_VEC_BYTES).set_metadata("nontemporal", nt)
        parts.append(builder.icmp_signed(">=", builder.and_(builder.bitcast(s, vi), off_v), low_v))
    while len(parts) > 1:   # join the compare masks pairwise: element e of the group is bit e
        n = parts[0].type.count
        idx = ir.Constant(ir.VectorType(ir.IntType(32), 2 * n), list(range(2 * n)))
        parts = [builder.shuffle_vector(parts[q], parts[q + 1], idx) for q in range(0, len(parts), 2)]
    word = builder.bitcast(parts[0], ir.IntType(64))
    builder.store(word, builder.gep(arrays[3].data, [j]), align=8)
    jn = builder.add(j, ir.Constant(ngroups.type, 1))
    j.add_incoming(jn, loop)
    builder.cbranch(builder.icmp_signed("<", jn, ngroups), loop, done)
    builder.position_at_end(done)
    return context.get_dummy_value()


@intrinsic
def _add_mask_block(typingctx, r, g, a, masks, i0, ngroups, sign_off, low):
    ity = types.int32 if a.dtype == types.float32 else types.int64
    return types.void(r, g, a, masks, types.intp, types.intp, ity, ity), _mask_loop


@intrinsic
def _sfence(typingctx):
    def codegen(context, builder, sig, args):
        f = builder.module.declare_intrinsic("llvm.x86.sse.sfence", fnty=ir.FunctionType(ir.VoidType(), []))
        builder.call(f, [])
        return context.get_dummy_value()
    return types.void(), codegen


@njit(cache=True, nogil=True, inline="always")
def _split(r, g, a):
    """(head, vector blocks): ``a[head:]`` starts on 64 bytes; blocks of 64 bytes after it. Arrays
    that are not unit-stride, or an ``a`` not aligned to its own item size, take the scalar loop
    only (the vector loop reads and writes through the data pointers)."""
    n = a.shape[0]
    item = a.itemsize
    addr = a.ctypes.data
    if addr % item != 0 or a.strides[0] != item or r.strides[0] != item or g.strides[0] != item:
        return n, 0
    head = min(((_VEC_BYTES - addr % _VEC_BYTES) % _VEC_BYTES) // item, n)
    return head, (n - head) // (_VEC_BYTES // item)


@njit(cache=True, nogil=True, inline="always")
def group_aligned(r, g, a, at):
    """True when ``add_mask_groups`` may start at element ``at``: unit strides, ``a + at`` on 64 bytes."""
    item = a.itemsize
    return (ENABLED and (a.ctypes.data + at * item) % _VEC_BYTES == 0 and a.strides[0] == item
            and r.strides[0] == item and g.strides[0] == item)


if ENABLED:
    @njit(cache=True, nogil=True)
    def add_mask_groups(r, g, a, masks, at, ngroups, sign_off, low):
        """``a[at:at + 64 ngroups] = r + g`` streamed past the cache, and per group of 64 elements a
        64-bit word in ``masks`` (uint64): bit e set where ``(bits & sign_off) >= low`` for the
        group's element e (``bits``: the sum's IEEE pattern as a signed integer of its width).
        Only where ``group_aligned(r, g, a, at)``; no fence (``store_fence`` after the last call)."""
        _add_mask_block(r, g, a, masks, at, ngroups, sign_off, low)

    @njit(cache=True, nogil=True)
    def store_fence():
        """Order the streaming stores before what follows (another thread after a join, MPI)."""
        _sfence()

    @njit(cache=True, nogil=True)
    def stream_add_copy(r, g, a, c):
        """``a[:] = c[:n] = r + g``: ``a`` streamed past the cache, ``c`` (a small buffer, read back
        at once) stored plainly."""
        head, nvec = _split(r, g, a)
        if c.strides[0] != c.itemsize:
            head, nvec = a.shape[0], 0
        for i in range(head):
            c[i] = a[i] = r[i] + g[i]
        _add_copy_block(r, g, a, c, head, nvec)
        for i in range(head + nvec * (_VEC_BYTES // a.itemsize), a.shape[0]):
            c[i] = a[i] = r[i] + g[i]
        _sfence()

    @njit(cache=True, nogil=True)
    def stream_add_max(r, g, a, bits, sign_off):
        """``a[:] = r + g``; returns the largest ``bits & sign_off`` of the sums (``bits``: ``a``
        viewed as integers of its width: the scalar parts read it back)."""
        head, nvec = _split(r, g, a)
        mx = sign_off & 0
        for i in range(head):
            a[i] = r[i] + g[i]
            b = bits[i] & sign_off
            mx = b if b > mx else mx
        m = _add_max_block(r, g, a, head, nvec, sign_off)
        mx = m if m > mx else mx
        for i in range(head + nvec * (_VEC_BYTES // a.itemsize), a.shape[0]):
            a[i] = r[i] + g[i]
            b = bits[i] & sign_off
            mx = b if b > mx else mx
        _sfence()
        return mx
else:
    @njit(cache=True, nogil=True)
    def add_mask_groups(r, g, a, masks, at, ngroups, sign_off, low):   # never called: not group_aligned
        raise RuntimeError("add_mask_groups needs x86-64")

    @njit(cache=True, nogil=True)
    def store_fence():
        pass

    @njit(cache=True, nogil=True)
    def stream_add_copy(r, g, a, c):
        for i in range(a.shape[0]):
            c[i] = a[i] = r[i] + g[i]

    @njit(cache=True, nogil=True)
    def stream_add_max(r, g, a, bits, sign_off):
        mx = sign_off & 0
        for i in range(a.shape[0]):
            a[i] = r[i] + g[i]
            b = bits[i] & sign_off
            mx = b if b > mx else mx
        return mx
