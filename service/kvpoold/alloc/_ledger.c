/*
 * kvpoold.alloc._ledger: the hot loops of IdPool (take ids off the free stack; validate ids and
 * give them back) in one C call each instead of ~10 numpy calls. Optional: without a C compiler
 * the package installs without it and kvpoold.alloc.ledger.NumpyLedger does the same job, with
 * the same results array for array (tests/unit/test_ledger.py runs one program on both).
 *
 * A Ledger works in place on three int32 arrays the Python side owns (numpy arrays, through
 * the buffer protocol; this file needs no numpy headers):
 *
 *   stack  int32[N]      ids 1..N; stack[head:] are free, stack[:head] stale. take() hands out
 *                        stack[head:head+k]; give() writes the ids back just below head, so a
 *                        freed id is the next one handed out (LIFO).
 *   owners int32[N + 2]  the lease holding each id, 0 when free; slots 0 and N + 1 are
 *                        sentinels (-1) and never touched here.
 *   slots  int32[N + 2]  for a held id, its position in its owner's HeldSet.
 *
 * and one HeldSet per owner (Ledger.new_set(owner)), which this file owns: the ids the owner
 * holds, ids[0..n), a sparse set. take() appends; give() fills the holes it leaves with the
 * set's last ids. So an owner's ids are known exactly at O(1) per id, and a reclaim reads them
 * in O(held). A set is bound to its ledger and owner, and only this file changes it or the
 * three arrays, so "owners[id] == owner" and "id is in owner's set" stay the same statement.
 *
 * Every call is O(k) in the ids it is given, never O(N). Calls hold the GIL throughout: the
 * caller's lock (PoolAllocator) and the GIL both serialise them.
 *
 * A give (free) of k ids is validated in one pass: at each position in order the id must be in
 * 1..N and owners[id] == owner; it is then marked PENDING (-2), so a repeat of it later in the
 * call no longer matches and is refused. A refusal writes the owner back over the marks made
 * and returns the position: nothing has changed. Why it was refused (out of range, repeated,
 * free, another lease) is worked out by the Python side, only on refusal.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stddef.h>
#include <stdint.h>
#include <structmember.h>
#include <string.h>

#define PENDING ((int32_t)-2)
/* The smallest HeldSet array, and the size up to which a set never shrinks: an owner that
 * cycles between a few and a few thousand ids must not pay a resize on every call. */
#define MIN_ROOM 16
#define SHRINK_ABOVE (1 << 16)

typedef struct {
    PyObject_HEAD
    Py_buffer stack_buf;
    Py_buffer owners_buf;
    Py_buffer slots_buf;
    int32_t *stack;
    int32_t *owners;
    int32_t *slots;
    Py_ssize_t capacity;
    Py_ssize_t head;
    int ready;
} Ledger;

typedef struct {
    PyObject_HEAD
    PyObject *ledger; /* strong: the Ledger whose ids these are */
    int32_t owner;
    Py_ssize_t n;
    Py_ssize_t room;
    int32_t *ids; /* PyMem, `room` entries */
} HeldSet;

static PyTypeObject LedgerType;
static PyTypeObject HeldSetType;

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
        /* e.g. a strided view: one error type for "convert and retry"; anything else (a
         * MemoryError) propagates as it is */
        if (PyErr_ExceptionMatches(PyExc_BufferError) || PyErr_ExceptionMatches(PyExc_TypeError) ||
            PyErr_ExceptionMatches(PyExc_ValueError)) {
            PyErr_Clear();
            PyErr_SetString(PyExc_TypeError, "ids must be a contiguous buffer");
        }
        return -1;
    }
    int wide = 0;
    if (view->buf.ndim != 1 || !format_is(view->buf.format, &wide) ||
        view->buf.itemsize != (wide ? 8 : 4)) {
        PyBuffer_Release(&view->buf);
        PyErr_SetString(PyExc_TypeError,
                        "ids must be a 1-D contiguous int32 or int64 array in native byte order");
        return -1;
    }
    view->wide = wide;
    view->count = view->buf.len / view->buf.itemsize;
    return 0;
}

static int
int32_buffer(PyObject *obj, Py_buffer *buf, const char *name)
{
    if (PyObject_GetBuffer(obj, buf, PyBUF_FORMAT | PyBUF_C_CONTIGUOUS | PyBUF_WRITABLE) < 0) {
        return -1;
    }
    int wide = 0;
    if (buf->ndim != 1 || !format_is(buf->format, &wide) || wide || buf->itemsize != 4) {
        PyBuffer_Release(buf);
        PyErr_Format(PyExc_TypeError, "%s must be a writable 1-D contiguous int32 array", name);
        return -1;
    }
    return 0;
}

/* The loops over one call's ids, once per id width (tested once per call, not per id).
 * `(U)id - 1 >= cap` refuses 0, negatives and ids past N in one compare. */
#define ID_LOOPS(W, T, U)                                                                      \
    static Py_ssize_t mark_##W(int32_t *owners, U cap, int32_t owner, const T *ids,            \
                               Py_ssize_t k)                                                   \
    {                                                                                          \
        Py_ssize_t i;                                                                          \
        for (i = 0; i < k; i++) {                                                              \
            T id = ids[i];                                                                     \
            if ((U)id - 1u >= cap || owners[id] != owner) {                                    \
                break;                                                                         \
            }                                                                                  \
            owners[id] = PENDING;                                                              \
        }                                                                                      \
        return i;                                                                              \
    }                                                                                          \
    /* mark_, also requiring each id in the owner's set held[0..n) (its slot points back at  \
     * it), so a free never removes more than the set holds; sets *missing when an id is the  \
     * owner's by the owner array but not in this set (an inconsistency, not a user error). */ \
    static Py_ssize_t mark_in_##W(int32_t *owners, const int32_t *slots, const int32_t *held,  \
                                  Py_ssize_t n, U cap, int32_t owner, const T *ids,            \
                                  Py_ssize_t k, int *missing, Py_ssize_t *holes)               \
    {                                                                                          \
        Py_ssize_t i, low = 0;                                                                 \
        const Py_ssize_t keep = n - k;                                                         \
        for (i = 0; i < k; i++) {                                                              \
            T id = ids[i];                                                                     \
            if ((U)id - 1u >= cap || owners[id] != owner) {                                    \
                break;                                                                         \
            }                                                                                  \
            int32_t s = slots[id];                                                             \
            if ((size_t)(uint32_t)s >= (size_t)n || held[s] != id) {                           \
                *missing = 1;                                                                  \
                break;                                                                         \
            }                                                                                  \
            low += s < keep; /* a hole the set's tail must fill */                             \
            owners[id] = PENDING;                                                              \
        }                                                                                      \
        *holes = low;                                                                          \
        return i;                                                                              \
    }                                                                                          \
    static void set_##W(int32_t *owners, const T *ids, Py_ssize_t k, int32_t value)            \
    {                                                                                          \
        for (Py_ssize_t i = 0; i < k; i++) {                                                   \
            owners[ids[i]] = value;                                                            \
        }                                                                                      \
    }                                                                                          \
    /* Free ids[0..k), all marked PENDING and all in the set's ids[0..n): the set's last k     \
     * entries that stay move into the holes the others leave below n - k (in order, as       \
     * numpy's `held[holes] = stay` does), then the ids go back on the stack. Two passes with \
     * no chain between iterations; freeing the ids allocated last moves nothing. */          \
    static void push_##W(int32_t *owners, int32_t *stack, int32_t *slots, int32_t *held,       \
                         Py_ssize_t n, const T *ids, Py_ssize_t k, Py_ssize_t holes)           \
    {                                                                                          \
        Py_ssize_t keep = n - k, hole = 0;                                                     \
        for (Py_ssize_t j = keep; holes > 0 && j < n; j++) {                                   \
            int32_t stay = held[j];                                                            \
            if (owners[stay] == PENDING) {                                                     \
                continue;                                                                      \
            }                                                                                  \
            while (hole < k && slots[ids[hole]] >= keep) {                                     \
                hole++;                                                                        \
            }                                                                                  \
            if (hole == k) {                                                                   \
                break; /* unreachable while the set and owners agree (audit() checks) */       \
            }                                                                                  \
            int32_t s = slots[ids[hole++]];                                                    \
            held[s] = stay;                                                                    \
            slots[stay] = s;                                                                   \
            holes--;                                                                           \
        }                                                                                      \
        for (Py_ssize_t i = 0; i < k; i++) {                                                   \
            owners[ids[i]] = 0;                                                                \
        }                                                                                      \
        if (sizeof(T) == 4) {                                                                  \
            memcpy(stack, ids, (size_t)k * 4);                                                 \
        } else {                                                                               \
            for (Py_ssize_t i = 0; i < k; i++) {                                               \
                stack[i] = (int32_t)ids[i];                                                    \
            }                                                                                  \
        }                                                                                      \
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

static int
check_ready(Ledger *self)
{
    if (!self->ready) {
        PyErr_SetString(PyExc_RuntimeError, "Ledger used before __init__");
        return -1;
    }
    return 0;
}

/* The HeldSet argument of a call: of this ledger and of `owner`. */
static HeldSet *
set_arg(Ledger *self, PyObject *obj, int32_t owner)
{
    if (Py_TYPE(obj) != &HeldSetType) {
        PyErr_Format(PyExc_TypeError, "held must be a HeldSet from Ledger.new_set, got %s",
                     Py_TYPE(obj)->tp_name);
        return NULL;
    }
    HeldSet *set = (HeldSet *)obj;
    if (set->ledger != (PyObject *)self || set->owner != owner) {
        PyErr_Format(PyExc_ValueError, "the held set of owner %d (of %s ledger) used for owner %d",
                     set->owner, set->ledger == (PyObject *)self ? "this" : "another", owner);
        return NULL;
    }
    return set;
}

/* Mark ids[0..k) PENDING if every one is in range, held by owner and not repeated; return -1.
 * Otherwise write the owner back over the marks made so far and return the first bad position. */
static Py_ssize_t
mark_pending(Ledger *self, int32_t owner, const IdsView *ids)
{
    Py_ssize_t k = ids->count, i;
    if (ids->wide) {
        i = mark_64(self->owners, (uint64_t)self->capacity, owner, ids->buf.buf, k);
        if (i < k) {
            set_64(self->owners, ids->buf.buf, i, owner); /* undo the marks of 0..i-1 */
        }
    } else {
        i = mark_32(self->owners, (uint32_t)self->capacity, owner, ids->buf.buf, k);
        if (i < k) {
            set_32(self->owners, ids->buf.buf, i, owner);
        }
    }
    return i == k ? -1 : i;
}

/* mark_pending for a give: the ids must also be in `set`, and no more than are in use. Returns
 * -1 (all marked), the first bad position, or k for ids the owner array gives to the owner but
 * the set does not hold (the caller reports an internal inconsistency). */
static Py_ssize_t
mark_for_give(Ledger *self, int32_t owner, const IdsView *ids, const HeldSet *set,
              Py_ssize_t *holes)
{
    Py_ssize_t k = ids->count, i;
    int missing = 0;
    if (ids->wide) {
        i = mark_in_64(self->owners, self->slots, set->ids, set->n, (uint64_t)self->capacity,
                       owner, ids->buf.buf, k, &missing, holes);
        if (i < k) {
            set_64(self->owners, ids->buf.buf, i, owner);
        }
    } else {
        i = mark_in_32(self->owners, self->slots, set->ids, set->n, (uint32_t)self->capacity,
                       owner, ids->buf.buf, k, &missing, holes);
        if (i < k) {
            set_32(self->owners, ids->buf.buf, i, owner);
        }
    }
    if (i == k && k > self->head) { /* cannot happen while the arrays agree; never underflow */
        if (ids->wide) {
            set_64(self->owners, ids->buf.buf, k, owner);
        } else {
            set_32(self->owners, ids->buf.buf, k, owner);
        }
        missing = 1;
    }
    if (missing) {
        return k;
    }
    return i == k ? -1 : i;
}

/* Whether [p, p + len) shares a byte with one of the ledger's arrays. */
static int
overlaps_ledger(const Ledger *self, const void *p, Py_ssize_t len)
{
    const Py_buffer *own[3] = {&self->stack_buf, &self->owners_buf, &self->slots_buf};
    const char *lo = (const char *)p, *hi = lo + len;
    for (int i = 0; i < 3; i++) {
        const char *a = (const char *)own[i]->buf, *b = a + own[i]->len;
        if (len > 0 && own[i]->len > 0 && lo < b && a < hi) {
            return 1;
        }
    }
    return 0;
}

static int
refuse_overlap(const Ledger *self, Py_buffer *buf, const char *name)
{
    if (!overlaps_ledger(self, buf->buf, buf->len)) {
        return 0;
    }
    PyBuffer_Release(buf);
    PyErr_Format(PyExc_ValueError, "%s shares memory with the ledger's own arrays; pass a copy",
                 name);
    return -1;
}

static int
resize_set(HeldSet *set, Py_ssize_t room)
{
    int32_t *ids = PyMem_Realloc(set->ids, (size_t)room * sizeof(int32_t));
    if (ids == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    set->ids = ids;
    set->room = room;
    return 0;
}

/* The (owner, _, held) arguments of take and give: the owner and its set, or NULL (error set). */
static HeldSet *
owner_and_set(Ledger *self, PyObject *const *args, Py_ssize_t nargs, const char *signature,
              int32_t *owner)
{
    if (nargs != 3) {
        PyErr_Format(PyExc_TypeError, "%s takes 3 arguments", signature);
        return NULL;
    }
    if (check_ready(self) < 0 || owner_arg(args[0], owner) < 0) {
        return NULL;
    }
    return set_arg(self, args[2], *owner);
}

PyDoc_STRVAR(take_doc,
"take(owner, out, held) -> int\n--\n\n"
"Hand len(out) free ids to owner: write them into `out` (a writable int32 array) and add them\n"
"to `held`, the owner's HeldSet; returns the new head (ids in use). ValueError when fewer ids\n"
"are free (nothing changes).");

static PyObject *
Ledger_take(Ledger *self, PyObject *const *args, Py_ssize_t nargs)
{
    int32_t owner;
    Py_buffer out;
    HeldSet *set = owner_and_set(self, args, nargs, "take(owner, out, held)", &owner);
    if (set == NULL || int32_buffer(args[1], &out, "out") < 0) {
        return NULL;
    }
    if (refuse_overlap(self, &out, "out") < 0) {
        return NULL;
    }
    Py_ssize_t count = out.len / 4;
    if (count > self->capacity - self->head) {
        PyErr_Format(PyExc_ValueError, "take %zd ids: only %zd free", count,
                     self->capacity - self->head);
        PyBuffer_Release(&out);
        return NULL;
    }
    Py_ssize_t n = set->n;
    if (n + count > set->room) {
        Py_ssize_t room = set->room;
        while (room < n + count) {
            room *= 2;
        }
        if (resize_set(set, room) < 0) {
            PyBuffer_Release(&out);
            return NULL;
        }
    }
    const int32_t *src = self->stack + self->head;
    int32_t *owners = self->owners, *slots = self->slots;
    const uint32_t cap = (uint32_t)self->capacity;
    for (Py_ssize_t i = 0; i < count; i++) {
        int32_t id = src[i];
        /* The stack is a numpy array Python could write: hand out only free ids in range. */
        if ((uint32_t)id - 1u >= cap || owners[id] != 0) {
            for (Py_ssize_t j = 0; j < i; j++) {
                owners[src[j]] = 0; /* nothing handed out (a free id's slot means nothing) */
            }
            PyErr_Format(PyExc_RuntimeError,
                         "free stack corrupted: entry %zd holds %d, not a free id in 1..%zd",
                         self->head + i, id, self->capacity);
            PyBuffer_Release(&out);
            return NULL;
        }
        owners[id] = owner;
        slots[id] = (int32_t)(n + i);
    }
    memcpy(out.buf, src, (size_t)count * sizeof(int32_t));
    memcpy(set->ids + n, src, (size_t)count * sizeof(int32_t));
    set->n = n + count;
    self->head += count;
    PyBuffer_Release(&out);
    return PyLong_FromSsize_t(self->head);
}

PyDoc_STRVAR(give_doc,
"give(owner, ids, held) -> int\n--\n\n"
"Free `ids` (1-D int32 or int64) held by owner and drop them from `held`, its HeldSet: -1 when\n"
"done, else the first position that is out of range, repeated or not held by owner, and\n"
"nothing has changed. TypeError for any other dtype or layout (convert and call again).");

static PyObject *
Ledger_give(Ledger *self, PyObject *const *args, Py_ssize_t nargs)
{
    int32_t owner;
    IdsView ids;
    HeldSet *set = owner_and_set(self, args, nargs, "give(owner, ids, held)", &owner);
    if (set == NULL || ids_view(args[1], &ids) < 0) {
        return NULL;
    }
    if (refuse_overlap(self, &ids.buf, "ids") < 0) {
        return NULL;
    }
    if (ids.count == 0) {
        PyBuffer_Release(&ids.buf);
        return PyLong_FromLong(-1);
    }
    Py_ssize_t holes = 0;
    Py_ssize_t bad = mark_for_give(self, owner, &ids, set, &holes);
    if (bad < 0) {
        /* Distinct ids, each in the set: k <= n, and k <= head was checked. */
        Py_ssize_t k = ids.count, head = self->head - k;
        if (ids.wide) {
            push_64(self->owners, self->stack + head, self->slots, set->ids, set->n, ids.buf.buf,
                    k, holes);
        } else {
            push_32(self->owners, self->stack + head, self->slots, set->ids, set->n, ids.buf.buf,
                    k, holes);
        }
        self->head = head;
        set->n -= k;
        if (set->room > SHRINK_ABOVE && set->n * 4 <= set->room) {
            Py_ssize_t room = set->room;
            while (room > MIN_ROOM && set->n * 4 <= room) {
                room /= 2;
            }
            if (resize_set(set, room) < 0) {
                PyErr_Clear(); /* keeping the larger array is fine */
            }
        }
    }
    PyBuffer_Release(&ids.buf);
    return PyLong_FromSsize_t(bad);
}

PyDoc_STRVAR(check_doc,
"check(owner, ids) -> int\n--\n\n"
"What give(owner, ids, held) would return (-1: it would free them; else the first bad\n"
"position), changing nothing.");

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
    if (refuse_overlap(self, &ids.buf, "ids") < 0) {
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

PyDoc_STRVAR(new_set_doc,
"new_set(owner) -> HeldSet\n--\n\n"
"An empty held set for owner, bound to this ledger.");

static PyObject *
Ledger_new_set(Ledger *self, PyObject *arg)
{
    int32_t owner;
    if (check_ready(self) < 0 || owner_arg(arg, &owner) < 0) {
        return NULL;
    }
    HeldSet *set = PyObject_New(HeldSet, &HeldSetType);
    if (set == NULL) {
        return NULL;
    }
    set->ids = PyMem_Malloc(MIN_ROOM * sizeof(int32_t));
    if (set->ids == NULL) {
        set->ledger = NULL;
        Py_DECREF(set);
        return PyErr_NoMemory();
    }
    set->ledger = Py_NewRef((PyObject *)self);
    set->owner = owner;
    set->n = 0;
    set->room = MIN_ROOM;
    return (PyObject *)set;
}

static int
bufs_overlap(const Py_buffer *a, const Py_buffer *b)
{
    const char *a0 = a->buf, *b0 = b->buf;
    return a->len > 0 && b->len > 0 && a0 < b0 + b->len && b0 < a0 + a->len;
}

/* NULL when stack is a permutation of 1..N, owners are 0 with -1 at 0 and N + 1, and no two
 * arrays share memory; else what is wrong ("memory" when the check could not allocate). O(N),
 * once. */
static const char *
all_free_problem(const int32_t *stack, const int32_t *owners, Py_ssize_t cap,
                 const Py_buffer *s, const Py_buffer *o, const Py_buffer *l)
{
    if (bufs_overlap(s, o) || bufs_overlap(s, l) || bufs_overlap(o, l)) {
        return "stack, owners and slots share memory";
    }
    if (owners[0] != -1 || owners[cap + 1] != -1) {
        return "owners[0] and owners[N + 1] must be the sentinel -1";
    }
    for (Py_ssize_t i = 1; i <= cap; i++) {
        if (owners[i] != 0) {
            return "owners[1..N] must be 0 (free)";
        }
    }
    unsigned char *seen = PyMem_Calloc((size_t)cap + 1, 1);
    if (seen == NULL) {
        return "memory";
    }
    const char *problem = NULL;
    for (Py_ssize_t i = 0; i < cap; i++) {
        uint32_t id = (uint32_t)stack[i];
        if (id - 1u >= (uint32_t)cap || seen[id]) {
            problem = "stack must hold each id 1..N once";
            break;
        }
        seen[id] = 1;
    }
    PyMem_Free(seen);
    return problem;
}

static int
Ledger_init(Ledger *self, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"stack", "owners", "slots", NULL};
    PyObject *stack_obj, *owners_obj, *slots_obj;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "OOO:Ledger", kwlist, &stack_obj, &owners_obj,
                                     &slots_obj)) {
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
    if (int32_buffer(slots_obj, &self->slots_buf, "slots") < 0) {
        PyBuffer_Release(&self->stack_buf);
        PyBuffer_Release(&self->owners_buf);
        return -1;
    }
    Py_ssize_t cap = self->stack_buf.len / 4;
    Py_ssize_t owners_len = self->owners_buf.len / 4, slots_len = self->slots_buf.len / 4;
    if (cap < 1 || cap > INT32_MAX - 1 || owners_len != cap + 2 || slots_len != cap + 2) {
        PyBuffer_Release(&self->stack_buf);
        PyBuffer_Release(&self->owners_buf);
        PyBuffer_Release(&self->slots_buf);
        PyErr_Format(PyExc_ValueError,
                     "Ledger needs stack of N in 1..%d ids, owners of N + 2 and slots of N + 2; "
                     "got N=%zd, owners %zd, slots %zd",
                     INT32_MAX - 1, cap, owners_len, slots_len);
        return -1;
    }
    self->stack = (int32_t *)self->stack_buf.buf;
    self->owners = (int32_t *)self->owners_buf.buf;
    self->slots = (int32_t *)self->slots_buf.buf;
    const char *problem = all_free_problem(self->stack, self->owners, cap,
                                           &self->stack_buf, &self->owners_buf, &self->slots_buf);
    if (problem != NULL) {
        PyBuffer_Release(&self->stack_buf);
        PyBuffer_Release(&self->owners_buf);
        PyBuffer_Release(&self->slots_buf);
        if (strcmp(problem, "memory") == 0) {
            PyErr_NoMemory();
        } else {
            PyErr_Format(PyExc_ValueError, "Ledger needs an all-free id space: %s", problem);
        }
        return -1;
    }
    self->capacity = cap;
    self->head = 0; /* all free: stack holds the ids in the order they will be handed out */
    self->ready = 1;
    return 0;
}

static void
Ledger_dealloc(Ledger *self)
{
    if (self->ready) {
        PyBuffer_Release(&self->stack_buf);
        PyBuffer_Release(&self->owners_buf);
        PyBuffer_Release(&self->slots_buf);
        self->ready = 0;
    }
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyMethodDef Ledger_methods[] = {
    {"take", (PyCFunction)(void (*)(void))Ledger_take, METH_FASTCALL, take_doc},
    {"give", (PyCFunction)(void (*)(void))Ledger_give, METH_FASTCALL, give_doc},
    {"check", (PyCFunction)(void (*)(void))Ledger_check, METH_FASTCALL, check_doc},
    {"new_set", (PyCFunction)Ledger_new_set, METH_O, new_set_doc},
    {NULL, NULL, 0, NULL},
};

static PyMemberDef Ledger_members[] = {
    {"head", T_PYSSIZET, offsetof(Ledger, head), READONLY, "Ids in use: stack[head:] are free."},
    {"capacity", T_PYSSIZET, offsetof(Ledger, capacity), READONLY, "N: ids are 1..N."},
    {NULL, 0, 0, 0, NULL},
};

PyDoc_STRVAR(Ledger_doc,
"Ledger(stack, owners, slots)\n--\n\n"
"The free stack, owner array and held-set positions of one id space 1..N, all free\n"
"(see kvpoold/alloc/ledger.py). stack: int32[N], owners and slots: int32[N + 2]; used in\n"
"place and kept alive.");

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
    .tp_members = Ledger_members,
};

/* -- HeldSet ---------------------------------------------------------------------------- */

static void
HeldSet_dealloc(HeldSet *self)
{
    PyMem_Free(self->ids);
    Py_XDECREF(self->ledger);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static Py_ssize_t
HeldSet_len(HeldSet *self)
{
    return self->n;
}

static PyObject *
HeldSet_tobytes(HeldSet *self, PyObject *Py_UNUSED(ignored))
{
    return PyBytes_FromStringAndSize((const char *)self->ids,
                                     self->n * (Py_ssize_t)sizeof(int32_t));
}

static PyMethodDef HeldSet_methods[] = {
    {"tobytes", (PyCFunction)HeldSet_tobytes, METH_NOARGS,
     "The ids held, as native int32 bytes (np.frombuffer(..., np.int32))."},
    {NULL, NULL, 0, NULL},
};

static PyMemberDef HeldSet_members[] = {
    {"owner", T_INT, offsetof(HeldSet, owner), READONLY, "The lease whose ids these are."},
    {"ledger", T_OBJECT, offsetof(HeldSet, ledger), READONLY, "The Ledger the ids belong to."},
    {"room", T_PYSSIZET, offsetof(HeldSet, room), READONLY, "Ids the set's array has room for."},
    {NULL, 0, 0, 0, NULL},
};

static PySequenceMethods HeldSet_as_sequence = {
    .sq_length = (lenfunc)HeldSet_len,
};

static PyTypeObject HeldSetType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "kvpoold.alloc._ledger.HeldSet",
    .tp_basicsize = sizeof(HeldSet),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_DISALLOW_INSTANTIATION,
    .tp_doc = "The ids one owner holds in one Ledger (len() is how many); see Ledger.new_set.",
    .tp_dealloc = (destructor)HeldSet_dealloc,
    .tp_as_sequence = &HeldSet_as_sequence,
    .tp_methods = HeldSet_methods,
    .tp_members = HeldSet_members,
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
    if (PyType_Ready(&LedgerType) < 0 || PyType_Ready(&HeldSetType) < 0) {
        return NULL;
    }
    PyObject *module = PyModule_Create(&ledger_module);
    if (module == NULL) {
        return NULL;
    }
    if (PyModule_AddObjectRef(module, "Ledger", (PyObject *)&LedgerType) < 0 ||
        PyModule_AddObjectRef(module, "HeldSet", (PyObject *)&HeldSetType) < 0 ||
        PyModule_AddIntConstant(module, "MIN_ROOM", MIN_ROOM) < 0 ||
        PyModule_AddIntConstant(module, "SHRINK_ABOVE", SHRINK_ABOVE) < 0) {
        Py_DECREF(module);
        return NULL;
    }
    return module;
}
