/* What a torch tensor is, for the host route's step (attnpool.update.host, lane.h). */
#include "lane.h"

/* What a tensor is, read through its Python attributes (this file needs no torch headers: it
 * builds with the interpreter's own compiler settings alone, at install time). Set once by
 * setup(). */
static PyObject *tensor_type, *int32_dtype;
static PyObject *s_dtype, *s_is_cpu, *s_stride, *s_shape, *s_data_ptr;
/* torch.Tensor's own descriptors of those five (getset: dtype, is_cpu, shape; method: stride,
 * data_ptr), looked up once by lane_setup(): a read then calls the descriptor itself. The generic
 * attribute read finds the same descriptor through the type's attribute lookup (and, for a
 * method, makes a bound method) on every call: after a forward has evicted the caches, that
 * lookup is a good part of the read. NULL: not the expected kind of descriptor (another
 * torch), and the generic read instead. */
static PyObject *d_dtype, *d_is_cpu, *d_stride, *d_shape, *d_data_ptr;

/* t.name (call: t.name()), through its descriptor when lane_setup() found it. */
static PyObject *read_attr(PyObject *t, PyObject *name, PyObject *descr, int call) {
    if (descr == NULL) return call ? PyObject_CallMethodNoArgs(t, name) : PyObject_GetAttr(t, name);
    if (call) return PyObject_Vectorcall(descr, &t, 1, NULL);
    return Py_TYPE(descr)->tp_descr_get(descr, t, (PyObject *)Py_TYPE(t));
}

/* The descriptor of name on type, when it is of kind (a new reference), else NULL. */
static PyObject *descriptor(PyObject *type, PyObject *name, PyTypeObject *kind) {
    PyObject *d = PyObject_GetAttr(type, name);
    if (d == NULL) {
        PyErr_Clear();
        return NULL;
    }
    if (Py_TYPE(d) != kind) Py_CLEAR(d);
    return d;
}

/* setup(torch.Tensor, torch.int32) */
PyObject *lane_setup(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (nargs != 2 || !PyType_Check(args[0])) {
        PyErr_SetString(PyExc_TypeError, "setup(torch.Tensor, torch.int32)");
        return NULL;
    }
    if (s_dtype == NULL) {
        s_dtype = PyUnicode_InternFromString("dtype");
        s_is_cpu = PyUnicode_InternFromString("is_cpu");
        s_stride = PyUnicode_InternFromString("stride");
        s_shape = PyUnicode_InternFromString("shape");
        s_data_ptr = PyUnicode_InternFromString("data_ptr");
        if (!s_dtype || !s_is_cpu || !s_stride || !s_shape || !s_data_ptr) return NULL;
    }
    Py_XSETREF(tensor_type, Py_NewRef(args[0]));
    Py_XSETREF(int32_dtype, Py_NewRef(args[1]));
    Py_XSETREF(d_dtype, descriptor(args[0], s_dtype, &PyGetSetDescr_Type));
    Py_XSETREF(d_is_cpu, descriptor(args[0], s_is_cpu, &PyGetSetDescr_Type));
    Py_XSETREF(d_shape, descriptor(args[0], s_shape, &PyGetSetDescr_Type));
    Py_XSETREF(d_stride, descriptor(args[0], s_stride, &PyMethodDescr_Type));
    Py_XSETREF(d_data_ptr, descriptor(args[0], s_data_ptr, &PyMethodDescr_Type));
    Py_RETURN_NONE;
}

/* An attribute read that raised: cleared, and the tensor declined. */
static int declined(void) {
    PyErr_Clear();
    return 0;
}

/* An int32 CPU tensor of `rank` dimensions (1 or 2), its last dimension contiguous: its
 * address, rows, columns and row stride. 1 taken, 0 not the route's (another type, dtype,
 * device or layout, or an attribute that raised: a sparse tensor's strides, say; the general
 * path then takes the call and its input pass names what is wrong). */
int lane_host_tensor(PyObject *t, int rank, int64_t *ptr, int64_t *rows, int64_t *cols,
                       int64_t *row_stride) {
    if (tensor_type == NULL || (PyObject *)Py_TYPE(t) != tensor_type) return 0;
    PyObject *a = read_attr(t, s_dtype, d_dtype, 0);
    if (a == NULL) return declined();
    int ok = a == int32_dtype;
    Py_DECREF(a);
    if (!ok) return 0;
    a = read_attr(t, s_is_cpu, d_is_cpu, 0);
    if (a == NULL) return declined();
    ok = a == Py_True;
    Py_DECREF(a);
    if (!ok) return 0;
    int64_t st[2] = {0, 0}, sh[2] = {0, 1};
    for (int which = 0; which < 2; which++) {
        a = which ? read_attr(t, s_shape, d_shape, 0) : read_attr(t, s_stride, d_stride, 1);
        if (a == NULL) return declined();
        ok = PyTuple_Check(a) && PyTuple_GET_SIZE(a) == rank;
        for (int d = 0; ok && d < rank; d++) {
            int64_t x = PyLong_AsLongLong(PyTuple_GET_ITEM(a, d));
            if (x == -1 && PyErr_Occurred()) { Py_DECREF(a); return declined(); }
            (which ? sh : st)[d] = x;
        }
        Py_DECREF(a);
        if (!ok) return 0;
    }
    if (st[rank - 1] != 1 && sh[rank - 1] > 1) return 0;
    a = read_attr(t, s_data_ptr, d_data_ptr, 1);
    if (a == NULL) return declined();
    *ptr = PyLong_AsLongLong(a);
    Py_DECREF(a);
    if (*ptr == -1 && PyErr_Occurred()) return declined();
    *rows = sh[0];
    *cols = rank == 2 ? sh[1] : 1;
    *row_stride = rank == 2 ? st[0] : 1;
    return 1;
}

