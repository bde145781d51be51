/* faultfs.stream._cut: the records of a line block as bytes objects, cut in one C pass; and
   the seeded permutation a shuffled stream mixes a window's records by (below).

   cut(data, starts, stops) -> list of bytes: data[starts[i]:stops[i]] for each i, where
   starts and stops are C-contiguous int64 buffers of equal length (numpy arrays). Dedup cuts
   only the records it keeps this way, instead of splitting the whole block into bytes and
   picking from the list: the split, the pick and the frees of the dropped records were most
   of the GIL-held work per record (docs/benchmarks-stream.md). Optional: without a compiler
   faultfs/stream/readers.py splits and picks in Python, to the same records. */

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* A one-dimensional, C-contiguous buffer of native int64 (numpy's int64/intp here). */
static int int64_buffer(PyObject *obj, Py_buffer *view, const char *what) {
    if (PyObject_GetBuffer(obj, view, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0)
        return -1;
    const char *f = view->format ? view->format : "B";
    if (*f == '@' || *f == '=' || (*f == '<' && PY_LITTLE_ENDIAN) || (*f == '>' && !PY_LITTLE_ENDIAN))
        f++;
    if (view->ndim != 1 || view->itemsize != 8 || (strcmp(f, "q") != 0 && strcmp(f, "l") != 0)) {
        PyErr_Format(PyExc_TypeError, "%s must be a one-dimensional array of native int64", what);
        PyBuffer_Release(view);
        return -1;
    }
    return 0;
}

/* Records cut this many ahead of the one copied have their cache lines prefetched: a
   shuffled window's records are cut in the mixed order, each from anywhere in the window's
   megabyte, which by then is rarely in this core's cache; one miss after another was most of
   the cut (~100 against ~50 ns a record in file order, cold). Prefetched, the misses of
   several records overlap. */
#define CUT_AHEAD 8

static PyObject *cut(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *starts_obj, *stops_obj;
    Py_buffer data, starts, stops;
    if (!PyArg_ParseTuple(args, "y*OO", &data, &starts_obj, &stops_obj))
        return NULL;
    PyObject *out = NULL;
    if (int64_buffer(starts_obj, &starts, "starts") < 0) {
        PyBuffer_Release(&data);
        return NULL;
    }
    if (int64_buffer(stops_obj, &stops, "stops") < 0) {
        PyBuffer_Release(&starts);
        PyBuffer_Release(&data);
        return NULL;
    }
    if (starts.len != stops.len) {
        PyErr_SetString(PyExc_ValueError, "starts and stops must be of one length");
        goto done;
    }
    Py_ssize_t n = starts.len / 8;
    /* The list first: its allocation may run a collection (other Python code), so each
       bound is read once, into locals, after it and checked right where it is used. */
    out = PyList_New(n);
    if (out == NULL)
        goto done;
    const char *base = (const char *)data.buf;
    for (Py_ssize_t i = 0; i < n; i++) {
        int64_t lo, hi;
        if (i + CUT_AHEAD < n) {  /* a later record's bytes asked of memory now (below) */
            int64_t at, to;
            memcpy(&at, (const char *)starts.buf + 8 * (i + CUT_AHEAD), 8);
            memcpy(&to, (const char *)stops.buf + 8 * (i + CUT_AHEAD), 8);
            if (at >= 0 && at <= to && to <= (int64_t)data.len) {
                for (int64_t c = at & ~(int64_t)63; c < to; c += 64)
                    __builtin_prefetch(base + c);
            }
        }
        memcpy(&lo, (const char *)starts.buf + 8 * i, 8);  /* no alignment assumed */
        memcpy(&hi, (const char *)stops.buf + 8 * i, 8);
        if (lo < 0 || lo > hi || hi > (int64_t)data.len) {
            PyErr_Format(PyExc_ValueError, "record %zd [%lld, %lld) is not inside %zd bytes",
                         i, (long long)lo, (long long)hi, data.len);
            Py_CLEAR(out);
            goto done;
        }
        PyObject *rec = PyBytes_FromStringAndSize(base + lo, (Py_ssize_t)(hi - lo));
        if (rec == NULL) {
            Py_CLEAR(out);
            goto done;
        }
        PyList_SET_ITEM(out, i, rec);
    }
done:
    PyBuffer_Release(&data);
    PyBuffer_Release(&starts);
    PyBuffer_Release(&stops);
    return out;
}

/* lines(data, skip, end) -> (starts, stops, ends) or None: the lines of a read buffer that
   start before offset end, as three bytes objects of native int64 each (numpy views them):
   line i is data[starts[i]:stops[i]], its terminator excluded (a "\r" before the "\n" too),
   and ends[i] is just past its "\n". With skip, the buffer's first line is the tail of a
   line that starts before it: the lines begin after the first "\n". Blank lines are not
   lines. None where the buffer does not settle it: skip and no "\n", or a line that starts
   before end has no "\n" in the buffer (faultfs/stream/shuffle/window.py, line_piece, then
   reads the range with the shard reader). One memchr pass, without the GIL. */
static PyObject *lines(PyObject *self, PyObject *args) {
    (void)self;
    Py_buffer data;
    int skip;
    Py_ssize_t end;
    if (!PyArg_ParseTuple(args, "y*pn", &data, &skip, &end))
        return NULL;
    const char *buf = (const char *)data.buf;
    Py_ssize_t len = data.len, pos = 0, n = 0, cap = 0;
    int settled = 1;
    int64_t *out = NULL;
    if (end > len)
        end = len;
    Py_BEGIN_ALLOW_THREADS
    if (skip) {
        const char *p = memchr(buf, '\n', (size_t)len);
        if (p == NULL)
            settled = 0;
        else
            pos = p - buf + 1;
    }
    /* three arrays of cap entries in one allocation, grown (doubled) as lines are found */
    if (settled) {
        cap = len / 32 + 16;
        out = malloc(sizeof(int64_t) * 3 * (size_t)cap);
    }
    while (settled && out != NULL && pos < end) {
        const char *p = memchr(buf + pos, '\n', (size_t)(len - pos));
        if (p == NULL) {  /* a line that starts before end has no terminator here */
            settled = 0;
            break;
        }
        Py_ssize_t nl = p - buf, stop = nl;
        if (stop > pos && buf[stop - 1] == '\r')
            stop--;
        if (stop > pos) {
            if (n == cap) {
                int64_t *grown = malloc(sizeof(int64_t) * 6 * (size_t)cap);
                if (grown != NULL)
                    for (int k = 0; k < 3; k++)
                        memcpy(grown + 2 * cap * k, out + cap * k, sizeof(int64_t) * (size_t)n);
                free(out);
                out = grown;
                cap *= 2;
                if (out == NULL)
                    break;
            }
            out[n] = pos;
            out[cap + n] = stop;
            out[2 * cap + n] = nl + 1;
            n++;
        }
        pos = nl + 1;
    }
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&data);
    if (!settled) {
        free(out);
        Py_RETURN_NONE;
    }
    if (out == NULL)
        return PyErr_NoMemory();
    PyObject *res = Py_BuildValue("(y#y#y#)", (const char *)out, (Py_ssize_t)(8 * n),
                                  (const char *)(out + cap), (Py_ssize_t)(8 * n),
                                  (const char *)(out + 2 * cap), (Py_ssize_t)(8 * n));
    free(out);
    return res;
}

/* permutation(key, n) -> bytes: a seeded permutation of range(n) as n native int64, the
   Fisher-Yates shuffle driven by splitmix64 seeded with key: for i from n-1 down to 1, swap
   i with j = (r * (i + 1)) >> 64 for the next 64-bit output r. A shuffled stream mixes each
   window's records in this order (faultfs/stream/shuffle/plan.py keeps the same algorithm in
   Python, for machines without a compiler: the same permutation, ~100x slower). Runs without
   the GIL. */
static PyObject *permutation(PyObject *self, PyObject *args) {
    (void)self;
    unsigned long long key;
    Py_ssize_t n;
    if (!PyArg_ParseTuple(args, "Kn", &key, &n))
        return NULL;
    if (n < 0 || n > PY_SSIZE_T_MAX / 8) {
        PyErr_Format(PyExc_ValueError, "cannot permute %zd elements", n);
        return NULL;
    }
    PyObject *out = PyBytes_FromStringAndSize(NULL, n * 8);
    if (out == NULL)
        return NULL;
    int64_t *p = (int64_t *)PyBytes_AS_STRING(out);
    uint64_t state = (uint64_t)key;
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t i = 0; i < n; i++)
        p[i] = (int64_t)i;
    for (Py_ssize_t i = n - 1; i > 0; i--) {
        uint64_t z = (state += 0x9E3779B97F4A7C15ULL);
        z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
        z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
        z ^= z >> 31;
        uint64_t j = (uint64_t)(((unsigned __int128)z * (uint64_t)(i + 1)) >> 64);
        int64_t t = p[i];
        p[i] = p[j];
        p[j] = t;
    }
    Py_END_ALLOW_THREADS
    return out;
}

static PyMethodDef methods[] = {
    {"cut", cut, METH_VARARGS,
     "cut(data, starts, stops) -> [data[a:b] for a, b in zip(starts, stops)] (int64 arrays)"},
    {"lines", lines, METH_VARARGS,
     "lines(data, skip, end) -> (starts, stops, ends) as int64 bytes, or None (unsettled)"},
    {"permutation", permutation, METH_VARARGS,
     "permutation(key, n) -> bytes of n int64: a seeded Fisher-Yates permutation of range(n)"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_cut", NULL, -1, methods,
                                    NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__cut(void) { return PyModule_Create(&module); }
