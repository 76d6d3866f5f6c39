// What the host lane's native step reads of a tensor, read from the C++ tensor itself.
//
// On a CPU an engine's metadata build runs on caches the forward has just evicted. Read
// through its Python attributes (dtype, is_cpu, stride(), shape, data_ptr()), a tensor costs
// the native step five trips through torch's Python bindings, about 2 us each on those caches
// (BENCHMARKS.md, "Refill per step"): more than the step's own writes. Here the same facts
// are a few field reads of the tensor's implementation.
//
// The module exports one C function through a capsule (attnpool.update.native hands it to
// host_lane.c): no Python call, and host_lane.c stays plain C with no torch headers. It is
// built with torch's headers against libc10 of the torch it runs with (the build is keyed by
// torch's version); where it cannot be built the step reads the attributes instead.
#include <Python.h>
#include <torch/csrc/autograd/python_variable.h>

#include <cstdint>

namespace {

// The caller (host_lane.c) has checked that obj's type is torch.Tensor itself. out: the
// address, rows, columns (1 for rank 1) and row stride (1 for rank 1). 1: an int32 CPU
// tensor of that rank, strided, with contiguous rows and data; 0: not the lane's (another
// dtype, device, layout or rank, no data, or anything that throws: nothing is assumed).
int facts(PyObject *obj, int rank, int64_t *out) noexcept {
    try {
        const at::Tensor &t = THPVariable_Unpack(obj);
        if (!t.defined() || t.layout() != c10::kStrided || t.scalar_type() != c10::kInt
            || !t.is_cpu() || t.dim() != rank || !t.has_storage())
            return 0;
        c10::IntArrayRef sizes = t.sizes(), strides = t.strides();
        if (strides[rank - 1] != 1 && sizes[rank - 1] > 1) return 0;
        const void *p = t.const_data_ptr();
        if (p == nullptr) return 0;
        out[0] = static_cast<int64_t>(reinterpret_cast<intptr_t>(p));
        out[1] = sizes[0];
        out[2] = rank == 2 ? sizes[1] : 1;
        out[3] = rank == 2 ? strides[0] : 1;
        return 1;
    } catch (...) {
        return 0;
    }
}

PyModuleDef module = {PyModuleDef_HEAD_INIT, "_attnpool_tensor", nullptr, -1, nullptr,
                      nullptr, nullptr, nullptr, nullptr};

}  // namespace

PyMODINIT_FUNC PyInit__attnpool_tensor(void) {
    PyObject *m = PyModule_Create(&module);
    if (m == nullptr) return nullptr;
    PyObject *cap = PyCapsule_New(reinterpret_cast<void *>(&facts), "attnpool.tensor_facts",
                                  nullptr);
    if (cap == nullptr || PyModule_AddObject(m, "facts", cap) < 0) {
        Py_XDECREF(cap);
        Py_DECREF(m);
        return nullptr;
    }
    return m;
}
