/* What the host route's C files share (attnpool.update.host): the module is host_lane.c (the
 * step), slots.c (copies of __slots__ objects: a view rebound, a template with slots set) and
 * tensors.c (what a torch tensor is, read through torch.Tensor's own descriptors). */
#ifndef ATTNPOOL_LANE_H
#define ATTNPOOL_LANE_H
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>

/* slots.c */
PyObject *lane_slot_offset(PyObject *self, PyObject *descr);
PyObject *lane_rebind_view(PyObject *view, const Py_ssize_t *off, PyObject *q, PyObject *k,
                           long long window_k);
int lane_view_offsets(PyObject *base, PyObject *offsets, PyObject *window_k_obj,
                      Py_ssize_t *off, long long *window_k);
PyObject *lane_rebind(PyObject *self, PyObject *const *args, Py_ssize_t nargs);
PyObject *lane_with_slots(PyObject *self, PyObject *const *args, Py_ssize_t nargs);

/* tensors.c */
PyObject *lane_setup(PyObject *self, PyObject *const *args, Py_ssize_t nargs);
int lane_host_tensor(PyObject *t, int rank, int64_t *ptr, int64_t *rows, int64_t *cols,
                     int64_t *row_stride);

#endif
