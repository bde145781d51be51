/* faultfs.stream._flatjson: the columns of a block of flat JSON objects, parsed in one C pass
   for the common shape (faultfs/stream/columns.py, "flat"): or None, and pyarrow's JSON
   reader parses the block as before. It declines wherever its table could differ from
   pyarrow's, so it either makes the table pyarrow would make or nothing.

   flat(data, starts, stops) -> None | (keys, columns): record i is data[starts[i]:stops[i]]
   (int64 buffers, as for _cut.cut), n >= 1 records. Accepted only when every record is
   exactly "{" ... "}" (JSON whitespace between tokens) with the same keys in the same order
   as the first record (at least one key, no key twice; a key of printable ASCII, without
   an escape), and every value of a column is of the column's kind, set by the first record:
     - kind 0, an integer: -?(0|[1-9][0-9]*) of at most 18 digits -> int64 (pyarrow: int64;
       "-0" is 0 there too);
     - kind 1, a boolean: true / false -> a bitmap (pyarrow: bool);
     - kind 2, a string whose decoded text is valid UTF-8, has no NUL and does not start with
       a digit (pyarrow infers a timestamp from a string like "2020-01-01"): the escapes
       \" \\ \/ \b \f \n \r \t \uXXXX (a surrogate pair joined; a lone one declined) decoded
       -> int32 offsets and the bytes (pyarrow: string).
   Anything else (null, a number with a fraction or an exponent or 19 digits or more, an
   object, an array, a raw control character in a string, invalid UTF-8, a key of another
   record's order) declines. columns: per key, (kind, values, data): values the int64s, the
   bitmap or the n + 1 int32 offsets; data the string bytes (None otherwise). Runs without
   the GIL. */

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define MAX_KEYS 256

typedef struct {
    int kind;
    char *values;   /* int64s, bitmap bytes or int32 offsets */
    char *data;     /* string bytes */
    size_t data_len, data_cap;
} column;

typedef struct {
    const char *name;  /* into the first record */
    size_t len;
} key;

/* plain[c]: a byte a string holds as it is (printable ASCII but the quote and backslash) */
static unsigned char plain[256];

static void init_plain(void) {
    for (int c = 0x20; c < 0x80; c++)
        plain[c] = c != '"' && c != '\\';
}

static int is_ws(char c) { return c == ' ' || c == '\t' || c == '\r' || c == '\n'; }

static const char *skip_ws(const char *p, const char *end) {
    while (p < end && is_ws(*p))
        p++;
    return p;
}

static int hex4(const char *p, unsigned *out) {
    unsigned v = 0;
    for (int k = 0; k < 4; k++) {
        char c = p[k];
        v <<= 4;
        if (c >= '0' && c <= '9') v |= (unsigned)(c - '0');
        else if (c >= 'a' && c <= 'f') v |= (unsigned)(c - 'a' + 10);
        else if (c >= 'A' && c <= 'F') v |= (unsigned)(c - 'A' + 10);
        else return 0;
    }
    *out = v;
    return 1;
}

/* One UTF-8 sequence at p (p < end, *p >= 0x80): its length, or 0 where it is not valid
   (overlong, a surrogate, past U+10FFFF, cut short). */
static int utf8_len(const unsigned char *p, const unsigned char *end) {
    unsigned c = p[0];
    if (c >= 0xC2 && c <= 0xDF)
        return (end - p >= 2 && (p[1] & 0xC0) == 0x80) ? 2 : 0;
    if (c >= 0xE0 && c <= 0xEF) {
        if (end - p < 3 || (p[1] & 0xC0) != 0x80 || (p[2] & 0xC0) != 0x80) return 0;
        if (c == 0xE0 && p[1] < 0xA0) return 0;  /* overlong */
        if (c == 0xED && p[1] > 0x9F) return 0;  /* a surrogate */
        return 3;
    }
    if (c >= 0xF0 && c <= 0xF4) {
        if (end - p < 4 || (p[1] & 0xC0) != 0x80 || (p[2] & 0xC0) != 0x80 ||
            (p[3] & 0xC0) != 0x80) return 0;
        if (c == 0xF0 && p[1] < 0x90) return 0;  /* overlong */
        if (c == 0xF4 && p[1] > 0x8F) return 0;  /* past U+10FFFF */
        return 4;
    }
    return 0;
}

static int reserve(column *col, size_t more) {
    if (col->data_len + more <= col->data_cap)
        return 1;
    size_t cap = col->data_cap ? col->data_cap : 4096;
    while (cap < col->data_len + more)
        cap *= 2;
    char *grown = realloc(col->data, cap);
    if (grown == NULL)
        return 0;
    col->data = grown;
    col->data_cap = cap;
    return 1;
}

static void put_utf8(char *dst, size_t *at, unsigned cp) {
    if (cp < 0x80) {
        dst[(*at)++] = (char)cp;
    } else if (cp < 0x800) {
        dst[(*at)++] = (char)(0xC0 | (cp >> 6));
        dst[(*at)++] = (char)(0x80 | (cp & 0x3F));
    } else if (cp < 0x10000) {
        dst[(*at)++] = (char)(0xE0 | (cp >> 12));
        dst[(*at)++] = (char)(0x80 | ((cp >> 6) & 0x3F));
        dst[(*at)++] = (char)(0x80 | (cp & 0x3F));
    } else {
        dst[(*at)++] = (char)(0xF0 | (cp >> 18));
        dst[(*at)++] = (char)(0x80 | ((cp >> 12) & 0x3F));
        dst[(*at)++] = (char)(0x80 | ((cp >> 6) & 0x3F));
        dst[(*at)++] = (char)(0x80 | (cp & 0x3F));
    }
}

/* A string value from p (just past its opening quote), decoded and appended to col's data:
   the position past its closing quote, or NULL (declined, or out of memory: *oom). */
static const char *string_value(const char *p, const char *end, column *col, int *oom) {
    /* the decoded text is never longer than the rest of the record */
    if (!reserve(col, (size_t)(end - p))) {
        *oom = 1;
        return NULL;
    }
    size_t at = col->data_len, first = at;
    char *dst = col->data;
    while (p < end) {
        const char *run = p;  /* plain ASCII, copied as it is */
        while (p < end && plain[(unsigned char)*p])
            p++;
        if (p > run) {
            memcpy(dst + at, run, (size_t)(p - run));
            at += (size_t)(p - run);
            if (p >= end)
                break;
        }
        unsigned char c = (unsigned char)*p;
        if (c == '"')
            break;
        if (c < 0x20)
            return NULL;  /* a raw control character: not JSON */
        if (c == '\\') {
            if (end - p < 2) return NULL;
            char e = p[1];
            unsigned cp;
            p += 2;
            switch (e) {
            case '"': dst[at++] = '"'; break;
            case '\\': dst[at++] = '\\'; break;
            case '/': dst[at++] = '/'; break;
            case 'b': dst[at++] = '\b'; break;
            case 'f': dst[at++] = '\f'; break;
            case 'n': dst[at++] = '\n'; break;
            case 'r': dst[at++] = '\r'; break;
            case 't': dst[at++] = '\t'; break;
            case 'u':
                if (end - p < 4 || !hex4(p, &cp)) return NULL;
                p += 4;
                if (cp >= 0xDC00 && cp <= 0xDFFF) return NULL;  /* a lone low surrogate */
                if (cp >= 0xD800 && cp <= 0xDBFF) {
                    unsigned lo;
                    if (end - p < 6 || p[0] != '\\' || p[1] != 'u' || !hex4(p + 2, &lo) ||
                        lo < 0xDC00 || lo > 0xDFFF)
                        return NULL;  /* a lone high surrogate */
                    p += 6;
                    cp = 0x10000 + ((cp - 0xD800) << 10) + (lo - 0xDC00);
                }
                if (cp == 0) return NULL;
                put_utf8(dst, &at, cp);
                break;
            default:
                return NULL;
            }
            continue;
        }
        if (c >= 0x80) {
            int len = utf8_len((const unsigned char *)p, (const unsigned char *)end);
            if (!len) return NULL;
            memcpy(dst + at, p, (size_t)len);
            at += (size_t)len;
            p += len;
            continue;
        }
        dst[at++] = (char)c;
        p++;
    }
    if (p >= end)
        return NULL;
    if (at > first && dst[first] >= '0' && dst[first] <= '9')
        return NULL;  /* pyarrow may read it as a timestamp */
    col->data_len = at;
    return p + 1;
}

/* The value at p of column col, row i: the position past it, or NULL (declined). */
static const char *value(const char *p, const char *end, column *col, Py_ssize_t i, int *oom) {
    if (p >= end)
        return NULL;
    char c = *p;
    if (col->kind == 2) {
        if (c != '"') return NULL;
        const char *q = string_value(p + 1, end, col, oom);
        if (q == NULL) return NULL;
        if (col->data_len > INT32_MAX) return NULL;
        int32_t off = (int32_t)col->data_len;
        memcpy(col->values + 4 * (i + 1), &off, 4);
        return q;
    }
    if (col->kind == 1) {
        if (end - p >= 4 && memcmp(p, "true", 4) == 0) {
            col->values[i >> 3] |= (char)(1 << (i & 7));
            return p + 4;
        }
        if (end - p >= 5 && memcmp(p, "false", 5) == 0)
            return p + 5;
        return NULL;
    }
    /* an integer */
    int neg = 0;
    if (c == '-') {
        neg = 1;
        p++;
    }
    const char *d = p;
    int64_t v = 0;
    while (p < end && *p >= '0' && *p <= '9') {
        v = v * 10 + (*p - '0');
        p++;
    }
    Py_ssize_t digits = p - d;
    if (digits == 0 || digits > 18 || (digits > 1 && *d == '0'))
        return NULL;
    if (p < end && (*p == '.' || *p == 'e' || *p == 'E'))
        return NULL;  /* a double in pyarrow */
    if (neg) v = -v;
    memcpy(col->values + 8 * i, &v, 8);
    return p;
}

/* The kind of the value at p, from the first record: 0, 1, 2, or -1 (declined). */
static int kind_of(const char *p, const char *end) {
    if (p >= end) return -1;
    if (*p == '"') return 2;
    if (*p == 't' || *p == 'f') return 1;
    if (*p == '-' || (*p >= '0' && *p <= '9')) return 0;
    return -1;
}

static void free_columns(column *cols, int n) {
    for (int k = 0; k < n; k++) {
        free(cols[k].values);
        free(cols[k].data);
    }
}

/* Parse every record; 1: done, 0: declined, -1: out of memory. */
static int parse(const char *base, Py_ssize_t len, const int64_t *lo, const int64_t *hi,
                 Py_ssize_t n, key *keys, column *cols, int *ncols) {
    int oom = 0;
    *ncols = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        int64_t a = lo[i], b = hi[i];
        if (a < 0 || a >= b || b > (int64_t)len) return 0;
        const char *p = base + a, *end = base + b;
        if (*p != '{' || end[-1] != '}') return 0;
        p = skip_ws(p + 1, end);
        int k = 0;
        for (;;) {
            if (*p != '"') return 0;
            const char *name = ++p;
            while (p < end && *p != '"') {
                if (!plain[(unsigned char)*p]) return 0;  /* an escape, a control, non-ASCII */
                p++;
            }
            if (p >= end) return 0;
            size_t name_len = (size_t)(p - name);
            p = skip_ws(p + 1, end);
            if (p >= end || *p != ':') return 0;
            p = skip_ws(p + 1, end);
            if (i == 0) {  /* the first record sets the keys and the kinds */
                if (k == MAX_KEYS) return 0;
                for (int j = 0; j < k; j++)
                    if (keys[j].len == name_len && memcmp(keys[j].name, name, name_len) == 0)
                        return 0;  /* a key twice */
                int kind = kind_of(p, end);
                if (kind < 0) return 0;
                keys[k].name = name;
                keys[k].len = name_len;
                column *col = &cols[k];
                memset(col, 0, sizeof(*col));
                col->kind = kind;
                size_t size = kind == 0 ? 8 * (size_t)n : kind == 1 ? ((size_t)n + 7) / 8
                                                                    : 4 * ((size_t)n + 1);
                col->values = calloc(size, 1);
                *ncols = k + 1;
                if (col->values == NULL) return -1;
            } else if (k >= *ncols || keys[k].len != name_len ||
                       memcmp(keys[k].name, name, name_len) != 0) {
                return 0;
            }
            p = value(p, end, &cols[k], i, &oom);
            if (p == NULL) return oom ? -1 : 0;
            k++;
            p = skip_ws(p, end);
            if (p >= end) return 0;
            if (*p == ',') {
                p = skip_ws(p + 1, end);
                continue;
            }
            if (*p == '}' && p + 1 == end) break;
            return 0;
        }
        if (k != *ncols) return 0;
    }
    return 1;
}

static PyObject *flat(PyObject *self, PyObject *args) {
    (void)self;
    Py_buffer data, starts, stops;
    if (!PyArg_ParseTuple(args, "y*y*y*", &data, &starts, &stops))
        return NULL;
    PyObject *out = NULL;
    Py_ssize_t n = starts.len / 8;
    key keys[MAX_KEYS];
    column *cols = calloc(MAX_KEYS, sizeof(column));
    int ncols = 0, done = 0;
    if (cols == NULL) {
        PyErr_NoMemory();
        goto release;
    }
    if (starts.len != stops.len || starts.len % 8 || n == 0) {
        PyErr_SetString(PyExc_ValueError, "starts and stops: int64s of one length, not none");
        goto release;
    }
    /* aligned copies of the bounds (a bytes object's buffer need not be) */
    int64_t *lo = malloc((size_t)starts.len), *hi = malloc((size_t)stops.len);
    if (lo == NULL || hi == NULL) {
        free(lo);
        free(hi);
        PyErr_NoMemory();
        goto release;
    }
    memcpy(lo, starts.buf, (size_t)starts.len);
    memcpy(hi, stops.buf, (size_t)stops.len);
    Py_BEGIN_ALLOW_THREADS
    done = parse((const char *)data.buf, data.len, lo, hi, n, keys, cols, &ncols);
    Py_END_ALLOW_THREADS
    free(lo);
    free(hi);
    if (done < 0) {
        PyErr_NoMemory();
        goto release;
    }
    if (!done) {
        out = Py_NewRef(Py_None);
        goto release;
    }
    PyObject *names = PyList_New(ncols), *columns = PyList_New(ncols);
    if (names == NULL || columns == NULL)
        goto fail;
    for (int k = 0; k < ncols; k++) {
        column *col = &cols[k];
        Py_ssize_t size = col->kind == 0 ? 8 * n : col->kind == 1 ? (n + 7) / 8 : 4 * (n + 1);
        PyObject *name = PyUnicode_DecodeUTF8(keys[k].name, (Py_ssize_t)keys[k].len, "strict");
        PyObject *item = name == NULL ? NULL : Py_BuildValue(
            "(iy#y#)", col->kind, col->values, size,
            col->kind == 2 ? (col->data ? col->data : "") : NULL,
            (Py_ssize_t)(col->kind == 2 ? col->data_len : 0));
        if (item == NULL) {
            Py_XDECREF(name);
            goto fail;
        }
        PyList_SET_ITEM(names, k, name);
        PyList_SET_ITEM(columns, k, item);
    }
    out = PyTuple_Pack(2, names, columns);
fail:
    Py_XDECREF(names);
    Py_XDECREF(columns);
release:
    if (cols != NULL) {
        free_columns(cols, ncols);
        free(cols);
    }
    PyBuffer_Release(&data);
    PyBuffer_Release(&starts);
    PyBuffer_Release(&stops);
    return out;
}

static PyMethodDef methods[] = {
    {"flat", flat, METH_VARARGS,
     "flat(data, starts, stops) -> (keys, columns) of flat JSON objects, or None (declined)"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_flatjson", NULL, -1, methods,
                                    NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__flatjson(void) {
    init_plain();
    return PyModule_Create(&module);
}
