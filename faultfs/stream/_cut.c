/* faultfs.stream._cut: the records of a line block as bytes objects, cut in one C pass.

   cut(data, starts, stops) -> list of bytes: data[starts[i]:stops[i]] for each i, where
   starts and stops are C-contiguous int64 buffers of equal length (numpy arrays). Dedup cuts
   only the records it keeps this way, instead of splitting the whole block into bytes and
   picking from the list: the split, the pick and the frees of the dropped records were most
   of the GIL-held work per record (docs/benchmarks-stream.md). Optional: without a compiler
   faultfs/stream/readers.py splits and picks in Python, to the same records. */

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>

static PyObject *cut(PyObject *self, PyObject *args) {
    (void)self;
    Py_buffer data, starts, stops;
    if (!PyArg_ParseTuple(args, "y*y*y*", &data, &starts, &stops))
        return NULL;
    PyObject *out = NULL;
    if (starts.len != stops.len || starts.len % (Py_ssize_t)sizeof(int64_t) != 0) {
        PyErr_SetString(PyExc_ValueError, "starts and stops must be int64 arrays of one length");
        goto done;
    }
    Py_ssize_t n = starts.len / (Py_ssize_t)sizeof(int64_t);
    const int64_t *lo = (const int64_t *)starts.buf, *hi = (const int64_t *)stops.buf;
    const char *base = (const char *)data.buf;
    for (Py_ssize_t i = 0; i < n; i++) {
        if (lo[i] < 0 || lo[i] > hi[i] || hi[i] > (int64_t)data.len) {
            PyErr_Format(PyExc_ValueError, "record %zd [%lld, %lld) is not inside %zd bytes",
                         i, (long long)lo[i], (long long)hi[i], data.len);
            goto done;
        }
    }
    out = PyList_New(n);
    if (out == NULL)
        goto done;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *rec = PyBytes_FromStringAndSize(base + lo[i], (Py_ssize_t)(hi[i] - lo[i]));
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

static PyMethodDef methods[] = {
    {"cut", cut, METH_VARARGS,
     "cut(data, starts, stops) -> [data[a:b] for a, b in zip(starts, stops)] (int64 arrays)"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_cut", NULL, -1, methods,
                                    NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__cut(void) { return PyModule_Create(&module); }
