/* Copies of __slots__ objects, made in C (attnpool.update.host, lane.h): a view rebound with
 * new host bounds (attnpool.phases._views.rebound's fields), and an object made once per step
 * from a template with some slots set. */
#include "lane.h"
#include <structmember.h>

/* slot_offset(member_descriptor) -> the byte offset of a __slots__ field in its objects. */
PyObject *lane_slot_offset(PyObject *self, PyObject *descr) {
    (void)self;
    if (!PyObject_TypeCheck(descr, &PyMemberDescr_Type)) {
        PyErr_SetString(PyExc_TypeError, "slot_offset takes a __slots__ member descriptor");
        return NULL;
    }
    return PyLong_FromSsize_t(((PyMemberDescrObject *)descr)->d_member->offset);
}

/* Whether every byte of tp's objects past the object header is a __slots__ object pointer:
 * each class from tp up to (not including) object is a Python class (a heap type) that adds
 * exactly its own object slots, and none has a __dict__, a __weakref__ or items. A built-in
 * such as float, or a slotted subclass of one, holds raw C fields there, which a copy must
 * never treat as references. */
static int plain_layout(PyTypeObject *tp) {
    if (tp->tp_dictoffset != 0 || tp->tp_weaklistoffset != 0 || tp->tp_itemsize != 0
        || tp->tp_basicsize <= (Py_ssize_t)sizeof(PyObject))
        return 0;
    for (PyTypeObject *t = tp; t != &PyBaseObject_Type; t = t->tp_base) {
        PyTypeObject *base = t->tp_base;
        if (base == NULL || !(t->tp_flags & Py_TPFLAGS_HEAPTYPE) || t->tp_itemsize != 0)
            return 0;
        Py_ssize_t members = 0;
        for (PyMemberDef *m = t->tp_members; m != NULL && m->name != NULL; m++) {
            if ((m->type != T_OBJECT_EX && m->type != T_OBJECT)
                || m->offset < base->tp_basicsize
                || m->offset + (Py_ssize_t)sizeof(PyObject *) > t->tp_basicsize)
                return 0;
            members++;
        }
        if (t->tp_basicsize - base->tp_basicsize != members * (Py_ssize_t)sizeof(PyObject *))
            return 0;
    }
    return 1;
}

/* plain_layout, remembered: the classes found plain are kept (a strong reference each, so that
 * no other class can take one's address), and a step's check of its view's class is then a
 * few pointer compares, not a walk of its bases on a cold cache. */
#define PLAIN_KEPT 8
static PyTypeObject *plain_kept[PLAIN_KEPT];
static int plain_next;

static int is_plain(PyTypeObject *tp) {
    for (int i = 0; i < PLAIN_KEPT; i++)
        if (plain_kept[i] == tp) return 1;
    if (!plain_layout(tp)) return 0;
    PyTypeObject *old = plain_kept[plain_next];
    plain_kept[plain_next] = (PyTypeObject *)Py_NewRef((PyObject *)tp);
    plain_next = (plain_next + 1) % PLAIN_KEPT;
    Py_XDECREF(old);
    return 1;
}

static PyObject *set_slot(PyObject *obj, Py_ssize_t off, PyObject *value) {
    PyObject **at = (PyObject **)((char *)obj + off);
    Py_XSETREF(*at, value);
    return obj;
}

/* A copy of a frozen, slotted view whose only new fields are its host bounds (and its window
 * part's, rebound the same way): what attnpool.phases._views.rebound makes field by field. */
PyObject *lane_rebind_view(PyObject *view, const Py_ssize_t *off, PyObject *q, PyObject *k,
                             long long window_k) {
    /* (the callers checked the class, is_plain: lane_view_offsets for rebind and step_tensors,
     * and phase_step's class is the one HostLane.first checked through rebind; a window part
     * must be of the same class) */
    PyTypeObject *tp = Py_TYPE(view);
    PyObject *new = tp->tp_alloc(tp, 0);
    if (new == NULL) return NULL;
    PyObject **from = (PyObject **)((char *)view + sizeof(PyObject));
    PyObject **to = (PyObject **)((char *)new + sizeof(PyObject));
    Py_ssize_t fields = (tp->tp_basicsize - (Py_ssize_t)sizeof(PyObject)) / sizeof(PyObject *);
    for (Py_ssize_t i = 0; i < fields; i++) to[i] = Py_XNewRef(from[i]);
    set_slot(new, off[0], Py_NewRef(q));
    set_slot(new, off[1], Py_NewRef(k));
    PyObject *w = *(PyObject **)((char *)view + off[2]);
    if (w != NULL && w != Py_None) {
        if (Py_TYPE(w) != tp) {
            Py_DECREF(new);
            PyErr_SetString(PyExc_TypeError, "rebind: a window part of another class");
            return NULL;
        }
        long long kk = PyLong_AsLongLong(k);
        if (kk == -1 && PyErr_Occurred()) { Py_DECREF(new); return NULL; }
        PyObject *wk = PyLong_FromLongLong(kk < window_k ? kk : window_k);
        if (wk == NULL) { Py_DECREF(new); return NULL; }
        PyObject *part = lane_rebind_view(w, off, q, wk, window_k);
        Py_DECREF(wk);
        if (part == NULL) { Py_DECREF(new); return NULL; }
        set_slot(new, off[2], part);
    }
    return new;
}

/* with_slots(obj, offsets, *values): a copy of obj, a plain __slots__ object, with the slots
 * at offsets (a bytes of one int64 per value, slot_offset's) set to values. For an object made
 * once per step from a template, where a Python __init__ (a frame, a dozen stores) costs a few
 * microseconds on the caches a forward leaves. */
PyObject *lane_with_slots(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (nargs < 2 || !PyBytes_Check(args[1])
        || PyBytes_GET_SIZE(args[1]) != (Py_ssize_t)((nargs - 2) * sizeof(int64_t))) {
        PyErr_SetString(PyExc_TypeError, "with_slots(obj, offsets, *values): offsets a bytes "
                                         "of one int64 per value");
        return NULL;
    }
    PyTypeObject *tp = Py_TYPE(args[0]);
    if (!is_plain(tp)) {
        PyErr_SetString(PyExc_TypeError, "with_slots takes an object of __slots__ fields only");
        return NULL;
    }
    const int64_t *o = (const int64_t *)PyBytes_AS_STRING(args[1]);
    for (Py_ssize_t i = 0; i < nargs - 2; i++) {
        if (o[i] < (int64_t)sizeof(PyObject)
            || o[i] + (int64_t)sizeof(PyObject *) > tp->tp_basicsize
            || (o[i] - (int64_t)sizeof(PyObject)) % (int64_t)sizeof(PyObject *) != 0) {
            PyErr_SetString(PyExc_ValueError, "a slot offset outside the object");
            return NULL;
        }
    }
    PyObject *new = tp->tp_alloc(tp, 0);
    if (new == NULL) return NULL;
    PyObject **from = (PyObject **)((char *)args[0] + sizeof(PyObject));
    PyObject **to = (PyObject **)((char *)new + sizeof(PyObject));
    Py_ssize_t fields = (tp->tp_basicsize - (Py_ssize_t)sizeof(PyObject)) / sizeof(PyObject *);
    for (Py_ssize_t i = 0; i < fields; i++) to[i] = Py_XNewRef(from[i]);
    for (Py_ssize_t i = 0; i < nargs - 2; i++)
        set_slot(new, (Py_ssize_t)o[i], Py_NewRef(args[i + 2]));
    return new;
}

/* The base view's slot offsets (offsets: a bytes of three int64, see rebind) checked against
 * its class; 0, or -1 with an error set. */
int lane_view_offsets(PyObject *base, PyObject *offsets, PyObject *window_k_obj,
                        Py_ssize_t *off, long long *window_k) {
    off[0] = off[1] = off[2] = 0;
    *window_k = 0;
    if (base == Py_None) return 0;
    if (!PyBytes_Check(offsets) || PyBytes_GET_SIZE(offsets) != 3 * sizeof(int64_t)) {
        PyErr_SetString(PyExc_TypeError, "offsets must be a bytes of three int64");
        return -1;
    }
    if (!is_plain(Py_TYPE(base))) {
        PyErr_SetString(PyExc_TypeError, "rebind takes a view of __slots__ fields only");
        return -1;
    }
    const int64_t *o = (const int64_t *)PyBytes_AS_STRING(offsets);
    Py_ssize_t size = Py_TYPE(base)->tp_basicsize;
    for (int i = 0; i < 3; i++) {
        off[i] = (Py_ssize_t)o[i];
        if (off[i] < (Py_ssize_t)sizeof(PyObject) || off[i] + (Py_ssize_t)sizeof(PyObject *) > size
            || (off[i] - (Py_ssize_t)sizeof(PyObject)) % (Py_ssize_t)sizeof(PyObject *) != 0) {
            PyErr_SetString(PyExc_ValueError, "a slot offset outside the view");
            return -1;
        }
    }
    *window_k = PyLong_AsLongLong(window_k_obj);
    return (*window_k == -1 && PyErr_Occurred()) ? -1 : 0;
}

/* rebind(view, offsets, max_q, max_k, window_k): offsets a bytes of three int64 slot offsets
 * (max_seqlen_q, max_seqlen_k, window; slot_offset). */
PyObject *lane_rebind(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (nargs != 5 || args[0] == Py_None || !PyLong_Check(args[2]) || !PyLong_Check(args[3])) {
        PyErr_SetString(PyExc_TypeError, "rebind(view, offsets, max_q, max_k, window_k)");
        return NULL;
    }
    Py_ssize_t off[3];
    long long window_k;
    if (lane_view_offsets(args[0], args[1], args[4], off, &window_k) < 0) return NULL;
    return lane_rebind_view(args[0], off, args[2], args[3], window_k);
}

