/*
 * kvpoold.alloc._ledger: the hot loop of IdPool (take ids off the free stack, validate and give
 * them back) in one C call instead of ~9 numpy calls. Optional: without a C compiler the
 * package installs without it and kvpoold.alloc.ledger.NumpyLedger does the same job.
 *
 * A Ledger works on two int32 arrays the Python side owns (numpy arrays, via the buffer
 * protocol; this file needs no numpy headers):
 *
 *   stack  int32[N]      ids 1..N; stack[head:] are free, stack[:head] stale. take() hands out
 *                        stack[head:head+k]; give() writes the ids back just below head, so a
 *                        freed id is the next one handed out (LIFO).
 *   owners int32[N + 2]  the lease holding each id, 0 when free; slots 0 and N + 1 are
 *                        sentinels (-1) and never touched here.
 *
 * Every call is O(k) in the ids it is given, never O(N). It runs with the GIL held and does not
 * release it: the caller's lock (PoolAllocator) and the GIL both serialise calls.
 *
 * Validation of a give (free) of k ids, in one pass: for each position in order, the id must be
 * in 1..N and owners[id] == owner; it is then marked PENDING (-2), so a repeat of the same id
 * later in the call no longer matches the owner and is refused. A refusal writes the owner back
 * over the marks it made and returns the position: nothing has changed. Diagnosing *why* (out
 * of range, repeated, free, other lease) is left to the Python side, which only runs it on
 * refusal.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#define PENDING ((int32_t)-2)

typedef struct {
    PyObject_HEAD
    Py_buffer stack_buf;
    Py_buffer owners_buf;
    int32_t *stack;
    int32_t *owners;
    Py_ssize_t capacity;
    Py_ssize_t head;
    int ready;
} Ledger;

/* A view of a 1-D C-contiguous array of native int32 or int64: the ids of one call. */
typedef struct {
    Py_buffer buf;
    Py_ssize_t count;
    int wide; /* 1: int64, 0: int32 */
} IdsView;

static int
format_is(const char *fmt, int *wide)
{
    /* numpy writes native-order formats as "i"/"l"/"q"; "@", "=" and, on a little-endian
     * machine, "<" mean the same byte order. */
    if (fmt == NULL) {
        return 0;
    }
    if (fmt[0] == '@' || fmt[0] == '=') {
        fmt++;
    }
#if PY_LITTLE_ENDIAN
    else if (fmt[0] == '<') {
        fmt++;
    }
#endif
    if (fmt[0] == '\0' || fmt[1] != '\0') {
        return 0;
    }
    switch (fmt[0]) {
    case 'i':
        if (sizeof(int) == 4) { *wide = 0; return 1; }
        return 0;
    case 'l':
        if (sizeof(long) == 4) { *wide = 0; return 1; }
        if (sizeof(long) == 8) { *wide = 1; return 1; }
        return 0;
    case 'q':
        if (sizeof(long long) == 8) { *wide = 1; return 1; }
        return 0;
    default:
        return 0;
    }
}

/* Fill `view` from `obj`; TypeError (the Python side converts and retries) unless it is a 1-D
 * C-contiguous signed 32- or 64-bit integer buffer. */
static int
ids_view(PyObject *obj, IdsView *view)
{
    if (PyObject_GetBuffer(obj, &view->buf, PyBUF_FORMAT | PyBUF_C_CONTIGUOUS) < 0) {
        PyErr_Clear(); /* e.g. a strided view: one error type for "convert and retry" */
        PyErr_SetString(PyExc_TypeError, "ids must be a contiguous buffer");
        return -1;
    }
    int wide = 0;
    if (view->buf.ndim != 1 || !format_is(view->buf.format, &wide) ||
        view->buf.itemsize != (wide ? 8 : 4)) {
        PyBuffer_Release(&view->buf);
        PyErr_Format(PyExc_TypeError,
                     "ids must be a 1-D contiguous int32 or int64 array in native byte order");
        return -1;
    }
    view->wide = wide;
    view->count = view->buf.len / view->buf.itemsize;
    return 0;
}

/* The loops over one call's ids, once per id width (the width is tested once per call, not
 * per id). `(U)id - 1 >= cap` refuses 0, negatives and ids past N in one compare. */
#define ID_LOOPS(W, T, U)                                                                    \
    static Py_ssize_t mark_##W(int32_t *owners, U cap, int32_t owner, const T *ids,            \
                               Py_ssize_t n)                                                   \
    {                                                                                          \
        Py_ssize_t i;                                                                          \
        for (i = 0; i < n; i++) {                                                              \
            T id = ids[i];                                                                     \
            if ((U)id - 1u >= cap || owners[id] != owner) {                                    \
                break;                                                                         \
            }                                                                                  \
            owners[id] = PENDING;                                                              \
        }                                                                                      \
        return i;                                                                              \
    }                                                                                          \
    static void set_##W(int32_t *owners, const T *ids, Py_ssize_t n, int32_t value)            \
    {                                                                                          \
        for (Py_ssize_t i = 0; i < n; i++) {                                                   \
            owners[ids[i]] = value;                                                            \
        }                                                                                      \
    }                                                                                          \
    static void push_##W(int32_t *owners, int32_t *stack, const T *ids, Py_ssize_t n)          \
    {                                                                                          \
        for (Py_ssize_t i = 0; i < n; i++) {                                                   \
            owners[ids[i]] = 0;                                                                \
            stack[i] = (int32_t)ids[i];                                                        \
        }                                                                                      \
    }                                                                                          \
    static Py_ssize_t gather_##W(int32_t *owners, U cap, int32_t owner, const T *ids,          \
                                 Py_ssize_t n, int32_t *dst, Py_ssize_t found, Py_ssize_t room) \
    {                                                                                          \
        for (Py_ssize_t i = 0; i < n; i++) {                                                   \
            T id = ids[i];                                                                     \
            if ((U)id - 1u >= cap || owners[id] != owner) {                                    \
                continue;                                                                      \
            }                                                                                  \
            if (found == room) {                                                               \
                return room + 1;                                                               \
            }                                                                                  \
            owners[id] = PENDING;                                                              \
            dst[found++] = (int32_t)id;                                                        \
        }                                                                                      \
        return found;                                                                          \
    }

ID_LOOPS(32, int32_t, uint32_t)
ID_LOOPS(64, int64_t, uint64_t)

static int
owner_arg(PyObject *obj, int32_t *owner)
{
    long value = PyLong_AsLong(obj);
    if (value == -1 && PyErr_Occurred()) {
        return -1;
    }
    if (value < 1 || value > INT32_MAX) {
        PyErr_Format(PyExc_ValueError, "owner must be in 1..%d, got %ld", INT32_MAX, value);
        return -1;
    }
    *owner = (int32_t)value;
    return 0;
}

/* Mark ids[0..k) PENDING if every one is in range, held by owner and not repeated; return -1.
 * Otherwise write the owner back over the marks made so far and return the first bad position. */
static Py_ssize_t
mark_pending(Ledger *self, int32_t owner, const IdsView *ids)
{
    Py_ssize_t n = ids->count, i;
    if (ids->wide) {
        i = mark_64(self->owners, (uint64_t)self->capacity, owner, ids->buf.buf, n);
        if (i < n) {
            set_64(self->owners, ids->buf.buf, i, owner); /* a repeat is written twice */
        }
    } else {
        i = mark_32(self->owners, (uint32_t)self->capacity, owner, ids->buf.buf, n);
        if (i < n) {
            set_32(self->owners, ids->buf.buf, i, owner);
        }
    }
    return i == n ? -1 : i;
}

static int
check_ready(Ledger *self)
{
    if (!self->ready) {
        PyErr_SetString(PyExc_RuntimeError, "Ledger used before __init__");
        return -1;
    }
    return 0;
}

PyDoc_STRVAR(take_doc,
"take(owner, out) -> None\n--\n\n"
"Hand len(out) free ids to owner, writing them into `out` (a writable int32 array).\n"
"ValueError when fewer are free (nothing changes): the caller checks first.");

static PyObject *
Ledger_take(Ledger *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "take(owner, out) takes 2 arguments");
        return NULL;
    }
    int32_t owner;
    if (check_ready(self) < 0 || owner_arg(args[0], &owner) < 0) {
        return NULL;
    }
    Py_buffer out;
    if (PyObject_GetBuffer(args[1], &out, PyBUF_FORMAT | PyBUF_C_CONTIGUOUS | PyBUF_WRITABLE) < 0) {
        return NULL;
    }
    int wide = 0;
    if (out.ndim != 1 || !format_is(out.format, &wide) || wide || out.itemsize != 4) {
        PyBuffer_Release(&out);
        PyErr_SetString(PyExc_TypeError, "out must be a writable 1-D contiguous int32 array");
        return NULL;
    }
    Py_ssize_t count = out.len / 4;
    if (count > self->capacity - self->head) {
        PyBuffer_Release(&out);
        PyErr_Format(PyExc_ValueError, "take %zd ids: only %zd free", count,
                     self->capacity - self->head);
        return NULL;
    }
    int32_t *dst = (int32_t *)out.buf;
    const int32_t *src = self->stack + self->head;
    int32_t *owners = self->owners;
    memcpy(dst, src, (size_t)count * sizeof(int32_t));
    for (Py_ssize_t i = 0; i < count; i++) {
        owners[src[i]] = owner;
    }
    self->head += count;
    PyBuffer_Release(&out);
    Py_RETURN_NONE;
}

PyDoc_STRVAR(give_doc,
"give(owner, ids) -> int\n--\n\n"
"Free `ids` (1-D int32 or int64) held by owner: -1 when done, else the first position that is\n"
"out of range, repeated or not held by owner, and nothing has changed.\n"
"TypeError for any other dtype or layout (convert and call again).");

static PyObject *
Ledger_give(Ledger *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "give(owner, ids) takes 2 arguments");
        return NULL;
    }
    int32_t owner;
    IdsView ids;
    if (check_ready(self) < 0 || owner_arg(args[0], &owner) < 0 || ids_view(args[1], &ids) < 0) {
        return NULL;
    }
    Py_ssize_t bad = mark_pending(self, owner, &ids);
    if (bad < 0) {
        /* Every id was held by owner and they are distinct, so count <= head. */
        Py_ssize_t head = self->head - ids.count;
        if (ids.wide) {
            push_64(self->owners, self->stack + head, ids.buf.buf, ids.count);
        } else {
            push_32(self->owners, self->stack + head, ids.buf.buf, ids.count);
        }
        self->head = head;
    }
    PyBuffer_Release(&ids.buf);
    return PyLong_FromSsize_t(bad);
}

PyDoc_STRVAR(check_doc,
"check(owner, ids) -> int\n--\n\n"
"What give(owner, ids) would return, changing nothing.");

static PyObject *
Ledger_check(Ledger *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "check(owner, ids) takes 2 arguments");
        return NULL;
    }
    int32_t owner;
    IdsView ids;
    if (check_ready(self) < 0 || owner_arg(args[0], &owner) < 0 || ids_view(args[1], &ids) < 0) {
        return NULL;
    }
    Py_ssize_t bad = mark_pending(self, owner, &ids);
    if (bad < 0) {
        if (ids.wide) {
            set_64(self->owners, ids.buf.buf, ids.count, owner);
        } else {
            set_32(self->owners, ids.buf.buf, ids.count, owner);
        }
    }
    PyBuffer_Release(&ids.buf);
    return PyLong_FromSsize_t(bad);
}

static int
int32_buffer(PyObject *obj, Py_buffer *buf, const char *name)
{
    if (PyObject_GetBuffer(obj, buf, PyBUF_FORMAT | PyBUF_C_CONTIGUOUS | PyBUF_WRITABLE) < 0) {
        return -1;
    }
    int wide = 0;
    if (buf->ndim != 1 || !format_is(buf->format, &wide) || wide ||
        buf->itemsize != 4) {
        PyBuffer_Release(buf);
        PyErr_Format(PyExc_TypeError, "%s must be a writable 1-D contiguous int32 array", name);
        return -1;
    }
    return 0;
}

PyDoc_STRVAR(collect_doc,
"collect(owner, log, out) -> int\n--\n\n"
"The distinct ids of `log` (a list of int32 arrays) that owner holds now, written into `out`\n"
"(a writable int32 array of the owner's held count) in log order; returns how many were found,\n"
"len(out) + 1 when there are more. O(total log length); owners is left as it was.");

static PyObject *
Ledger_collect(Ledger *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "collect(owner, log, out) takes 3 arguments");
        return NULL;
    }
    int32_t owner;
    if (check_ready(self) < 0 || owner_arg(args[0], &owner) < 0) {
        return NULL;
    }
    if (!PyList_Check(args[1])) {
        PyErr_SetString(PyExc_TypeError, "log must be a list of int32 arrays");
        return NULL;
    }
    Py_buffer out;
    if (int32_buffer(args[2], &out, "out") < 0) {
        return NULL;
    }
    int32_t *dst = (int32_t *)out.buf;
    const Py_ssize_t room = out.len / 4;
    int32_t *owners = self->owners;
    const Py_ssize_t cap = self->capacity;
    Py_ssize_t found = 0;
    int failed = 0;
    /* Each id found is marked PENDING so a second copy of it in the log is skipped; the marks
     * are undone below, before any return. A list item is borrowed: nothing here runs Python
     * code, so the list cannot change under us. */
    for (Py_ssize_t a = 0; a < PyList_GET_SIZE(args[1]) && found <= room; a++) {
        IdsView ids;
        if (ids_view(PyList_GET_ITEM(args[1], a), &ids) < 0) {
            failed = 1;
            break;
        }
        /* found == room + 1 means more than the held count: the caller scans instead */
        found = ids.wide ? gather_64(owners, (uint64_t)cap, owner, ids.buf.buf, ids.count, dst,
                                     found, room)
                         : gather_32(owners, (uint32_t)cap, owner, ids.buf.buf, ids.count, dst,
                                     found, room);
        PyBuffer_Release(&ids.buf);
    }
    Py_ssize_t marked = found <= room ? found : room;
    for (Py_ssize_t i = 0; i < marked; i++) {
        owners[dst[i]] = owner;
    }
    PyBuffer_Release(&out);
    if (failed) {
        return NULL;
    }
    return PyLong_FromSsize_t(found);
}

static int
Ledger_init(Ledger *self, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"stack", "owners", "head", NULL};
    PyObject *stack_obj, *owners_obj;
    Py_ssize_t head = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "OO|n:Ledger", kwlist, &stack_obj, &owners_obj,
                                     &head)) {
        return -1;
    }
    if (self->ready) {
        PyErr_SetString(PyExc_RuntimeError, "Ledger is already initialised");
        return -1;
    }
    if (int32_buffer(stack_obj, &self->stack_buf, "stack") < 0) {
        return -1;
    }
    if (int32_buffer(owners_obj, &self->owners_buf, "owners") < 0) {
        PyBuffer_Release(&self->stack_buf);
        return -1;
    }
    Py_ssize_t cap = self->stack_buf.len / 4;
    Py_ssize_t owners_len = self->owners_buf.len / 4;
    if (cap < 1 || cap > INT32_MAX - 1 || owners_len != cap + 2 || head < 0 || head > cap) {
        PyBuffer_Release(&self->stack_buf);
        PyBuffer_Release(&self->owners_buf);
        PyErr_Format(PyExc_ValueError,
                     "Ledger needs stack of N in 1..%d ids, owners of N + 2 and head in 0..N; "
                     "got N=%zd, owners %zd, head %zd",
                     INT32_MAX - 1, cap, owners_len, head);
        return -1;
    }
    self->stack = (int32_t *)self->stack_buf.buf;
    self->owners = (int32_t *)self->owners_buf.buf;
    self->capacity = cap;
    self->head = head;
    self->ready = 1;
    return 0;
}

static void
Ledger_dealloc(Ledger *self)
{
    if (self->ready) {
        PyBuffer_Release(&self->stack_buf);
        PyBuffer_Release(&self->owners_buf);
        self->ready = 0;
    }
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyObject *
Ledger_get_head(Ledger *self, void *closure)
{
    (void)closure;
    return PyLong_FromSsize_t(self->head);
}

static PyObject *
Ledger_get_capacity(Ledger *self, void *closure)
{
    (void)closure;
    return PyLong_FromSsize_t(self->capacity);
}

static PyMethodDef Ledger_methods[] = {
    {"take", (PyCFunction)(void (*)(void))Ledger_take, METH_FASTCALL, take_doc},
    {"give", (PyCFunction)(void (*)(void))Ledger_give, METH_FASTCALL, give_doc},
    {"check", (PyCFunction)(void (*)(void))Ledger_check, METH_FASTCALL, check_doc},
    {"collect", (PyCFunction)(void (*)(void))Ledger_collect, METH_FASTCALL, collect_doc},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef Ledger_getset[] = {
    {"head", (getter)Ledger_get_head, NULL, "Ids in use: stack[head:] are free.", NULL},
    {"capacity", (getter)Ledger_get_capacity, NULL, "N: ids are 1..N.", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

PyDoc_STRVAR(Ledger_doc,
"Ledger(stack, owners, head=0)\n--\n\n"
"The free stack and owner array of one id space 1..N (see kvpoold/alloc/ledger.py).\n"
"stack: int32[N], owners: int32[N + 2]; both are used in place and kept alive.");

static PyTypeObject LedgerType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "kvpoold.alloc._ledger.Ledger",
    .tp_basicsize = sizeof(Ledger),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = Ledger_doc,
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)Ledger_init,
    .tp_dealloc = (destructor)Ledger_dealloc,
    .tp_methods = Ledger_methods,
    .tp_getset = Ledger_getset,
};

static struct PyModuleDef ledger_module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "kvpoold.alloc._ledger",
    .m_doc = "The C core of kvpoold's id allocator (optional; see kvpoold/alloc/ledger.py).",
    .m_size = -1,
};

PyMODINIT_FUNC
PyInit__ledger(void)
{
    if (PyType_Ready(&LedgerType) < 0) {
        return NULL;
    }
    PyObject *module = PyModule_Create(&ledger_module);
    if (module == NULL) {
        return NULL;
    }
    Py_INCREF(&LedgerType);
    if (PyModule_AddObject(module, "Ledger", (PyObject *)&LedgerType) < 0) {
        Py_DECREF(&LedgerType);
        Py_DECREF(module);
        return NULL;
    }
    return module;
}
