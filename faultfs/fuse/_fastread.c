/* Staged reads answered in C, on threads of their own, before pyfuse3 and trio see them.
 *
 * faultfs/fuse/fastread.py says why and how it is used. In short: loaded (RTLD_GLOBAL) before
 * pyfuse3, this library stands in for four libfuse functions that only pyfuse3 calls.
 * - fuse_session_fd(): when prepare() was called, it starts a few reader threads on a copy of
 *   the session's /dev/fuse descriptor and hands pyfuse3 an eventfd instead, which counts the
 *   requests queued for it. The readers block in read() (the device wakes one per request);
 *   a real-time signal sent to them alone (SIGRTMIN+5; they block every other signal, which
 *   stay Python's) ends that read when they stop.
 * - fuse_session_receive_buf(): pyfuse3's receive takes the next queued request (its buffer as
 *   read from the device) instead of reading the device itself.
 * - fuse_session_unmount() and fuse_session_destroy(): the reader threads are stopped and
 *   joined first (libfuse's unmount closes the device descriptor they read).
 * A reader thread takes each request off the device. A READ of a chunk or view inode of a tag
 * the Python side has enabled, inside one staged blob it has published (a blob file the local
 * tier holds open, of a tag without writes), is answered right there: the blocks it covers read
 * from the blob file (a copy of the tier's descriptor, owned here), each verified against the
 * blob header's xxh3_64 table, and the reply written to the device. Every other request — and
 * a READ that is not that, or whose read fails or whose block fails its checksum — is queued,
 * untouched, for pyfuse3, which serves it as if it had read it itself (the engine then finds
 * what is wrong with a blob and re-faults it).
 *
 * Invariants:
 * - Every request read from the device is answered here or queued for pyfuse3, never both.
 * - Only bytes whose blocks verified in the same read are sent.
 * - A published blob's descriptor is closed only when no read of it is in flight.
 * - A tag is served only while the Python side says it has no writes (disable_tag is called
 *   before a write of it is answered).
 * - An INTERRUPT of a READ answered here is dropped (libfuse would keep it for a request it
 *   never sees); every other INTERRUPT is libfuse's.
 * - A WRITE that writes back cached pages reaches pyfuse3 with WRITEBACK_FH set in its fh.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#define FUSE_USE_VERSION 35
#include <fuse_lowlevel.h>
#include <linux/fuse.h>

#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <signal.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <sys/uio.h>
#include <time.h>
#include <unistd.h>

#define MAX_BLOCKS 255
#define MAX_READERS 64
/* libfuse's own receive buffer: FUSE_MAX_MAX_PAGES pages and a page for the headers */
#define REQ_BUF (256 * 4096 + 4096)
/* PREFAULTED: request buffers are touched whole when made. The kernel copies a request into
   the reader's buffer after taking it off its queue, pinning the buffer's pages; a page not
   present is pinned the slow way, which fails once the process is being killed, and the kernel
   then ends the request with EIO instead of leaving it for the next daemon (fs/fuse/dev.c,
   fuse_dev_do_read). Present pages are pinned without that check. */
#define ENDED_COUNT (1ULL << 62) /* the queue's count once the connection ended: always readable */
#define WAKE_SIGNAL (SIGRTMIN + 5) /* ends a reader's blocking read when the readers stop */
/* set in the fh of a WRITE the kernel sends to write back cached pages (FUSE_WRITE_CACHE):
   pyfuse3 does not pass write_flags on, and such a write is a whole page of which only some
   bytes were changed (namespace/coherence.py); the Python side clears it (fuse/ops.py) */
#define WRITEBACK_FH (1ULL << 63)

typedef uint64_t (*xxh3_fn)(const void *, size_t);

typedef struct slot {
    uint64_t key; /* tag id << 32 | blob index */
    int refs;     /* the table's (while published) + reads in flight */
    int fd;
    uint64_t header_len, payload_len, stored_len;
    uint32_t block_size, nblocks, all_zero;
    uint64_t hits; /* reads served since the last harvest */
    uint64_t sums[MAX_BLOCKS];
} slot_t;

typedef struct {
    uint64_t chunk_size, view_size, num_blobs;
    uint64_t blobs_of; /* the tag its staged blobs are published as (a clone's: its ancestor) */
    int enabled;
} tag_t;

/* -- a small open-addressing map, uint64 key -> pointer ---------------------------------- */

typedef struct {
    uint64_t *keys;
    void **vals; /* NULL: empty; TOMB: removed */
    size_t cap, used, live;
} map_t;

static char tomb_;
#define TOMB ((void *)&tomb_)

static uint64_t mix(uint64_t k) {
    k ^= k >> 33;
    k *= 0xff51afd7ed558ccdULL;
    k ^= k >> 33;
    return k;
}

/* The position of key in m, or -1. */
static ssize_t map_find(map_t *m, uint64_t key) {
    if (!m->cap)
        return -1;
    size_t i = mix(key) & (m->cap - 1);
    for (;;) {
        void *v = m->vals[i];
        if (v == NULL)
            return -1;
        if (v != TOMB && m->keys[i] == key)
            return (ssize_t)i;
        i = (i + 1) & (m->cap - 1);
    }
}

static void *map_get(map_t *m, uint64_t key) {
    ssize_t i = map_find(m, key);
    return i < 0 ? NULL : m->vals[i];
}

static int map_put(map_t *m, uint64_t key, void *val);

static int map_grow(map_t *m) {
    size_t cap = m->cap ? m->cap * 2 : 64;
    while (cap < 4 * (m->live + 1))
        cap *= 2;
    map_t n = {calloc(cap, sizeof(uint64_t)), calloc(cap, sizeof(void *)), cap, 0, 0};
    if (!n.keys || !n.vals) {
        free(n.keys);
        free(n.vals);
        return -1;
    }
    for (size_t i = 0; i < m->cap; i++)
        if (m->vals[i] && m->vals[i] != TOMB)
            map_put(&n, m->keys[i], m->vals[i]);
    free(m->keys);
    free(m->vals);
    *m = n;
    return 0;
}

/* Insert or replace; returns 0, or -1 when out of memory. */
static int map_put(map_t *m, uint64_t key, void *val) {
    if (2 * (m->used + 1) > m->cap && map_grow(m))
        return -1;
    size_t i = mix(key) & (m->cap - 1);
    size_t free_at = (size_t)-1;
    for (;;) {
        void *v = m->vals[i];
        if (v == NULL)
            break;
        if (v == TOMB) {
            if (free_at == (size_t)-1)
                free_at = i;
        } else if (m->keys[i] == key) {
            m->vals[i] = val;
            return 0;
        }
        i = (i + 1) & (m->cap - 1);
    }
    if (free_at != (size_t)-1)
        i = free_at;
    else
        m->used++;
    m->keys[i] = key;
    m->vals[i] = val;
    m->live++;
    return 0;
}

static void *map_pop(map_t *m, uint64_t key) {
    ssize_t i = map_find(m, key);
    if (i < 0)
        return NULL;
    void *v = m->vals[i];
    m->vals[i] = TOMB;
    m->live--;
    return v;
}

/* -- state ------------------------------------------------------------------------------- */

typedef struct queued {
    struct queued *next;
    char *mem;
    size_t len;
} queued_t;

static pthread_mutex_t lock_ = PTHREAD_MUTEX_INITIALIZER;
static map_t slots_, tags_;
/* an inode is tag id << (index_bits + kind_bits) | kind << index_bits | index (core/inodes.py) */
static unsigned index_bits_, kind_bits_;
static uint64_t kind_chunk_, kind_view_;
static xxh3_fn xxh3_;
static int active_; /* start() was called: READs may be answered here */

static struct fuse_session *session_; /* the session the readers serve */
static int want_readers_;             /* prepare(n): start n readers with the next session */
static int nreaders_;
static pthread_t readers_[MAX_READERS];
static uint64_t serving_[MAX_READERS][2]; /* the READ each reader answers, and the one before */
static int fuse_fd_ = -1;                 /* the readers' copy of the session's /dev/fuse */
static int queue_fd_ = -1;                /* eventfd, a semaphore: one count per queued request */
static int stopping_;                     /* the readers stop (woken by WAKE_SIGNAL) */
static queued_t *q_head_, *q_tail_;
static char **spare_; /* request buffers not in use */
static size_t nspare_, spare_cap_;
static int ended_; /* the connection ended (or the readers stopped): receive answers 0 */

static struct {
    uint64_t reads, bytes, forwarded, queued;
} counts_;

/* -- a mount that outlives its daemon (fuse/handover.py) ----------------------------------
 * The kernel sends FUSE_INIT once per connection. A daemon that takes over a connection
 * another one served gets none, and libfuse answers EIO to every request until it has seen
 * one: takeover(init) queues the INIT the first daemon was sent (recorded below, kept by the
 * holder) ahead of everything else, with a unique the kernel never gave out, so libfuse
 * negotiates exactly what the connection has and its reply (to a request the kernel does not
 * know) is refused with ENOENT, which libfuse ignores. */
#define INIT_MAX 256
#define SYNTHETIC_UNIQUE (1ULL << 62) /* the kernel counts uniques up from 0 in steps of 2 */
static char init_copy_[INIT_MAX];     /* the first INIT read from the device */
static size_t init_len_;
static char takeover_init_[INIT_MAX]; /* takeover(): the INIT to queue at the next session */
static size_t takeover_len_;
static uint64_t current_unique_; /* the unique of the request receive_buf handed out last */
static int resend_errno_ = -1;   /* how the takeover's resend went: -1 not sent, 0, errno */

static void slot_release(slot_t *s) { /* lock_ held */
    if (--s->refs == 0) {
        close(s->fd);
        free(s);
    }
}

static char *take_buffer(void) {
    char *b = NULL;
    pthread_mutex_lock(&lock_);
    if (nspare_)
        b = spare_[--nspare_];
    pthread_mutex_unlock(&lock_);
    if (!b && (b = malloc(REQ_BUF)))
        memset(b, 0, REQ_BUF); /* every page present: see PREFAULTED */
    return b;
}

static void give_buffer(char *b) {
    pthread_mutex_lock(&lock_);
    if (nspare_ == spare_cap_) {
        size_t cap = spare_cap_ ? 2 * spare_cap_ : 16;
        char **n = realloc(spare_, cap * sizeof *n);
        if (!n) {
            pthread_mutex_unlock(&lock_);
            free(b);
            return;
        }
        spare_ = n;
        spare_cap_ = cap;
    }
    spare_[nspare_++] = b;
    pthread_mutex_unlock(&lock_);
}

/* -- answering a READ ----------------------------------------------------------------------- */

/* Read the blocks covering payload [inner, inner+len) of s into *data (grown as needed) and
 * verify them; the payload bytes asked for start at *data + return value, or -1. */
static ssize_t read_verified(slot_t *s, uint64_t inner, uint64_t len, char **data,
                             size_t *cap) {
    uint64_t bs = s->block_size;
    uint64_t first = inner / bs, start = first * bs;
    uint64_t end = ((inner + len + bs - 1) / bs) * bs;
    if (end > s->stored_len)
        end = s->stored_len;
    uint64_t want = end - start;
    if (want > *cap) {
        char *n = realloc(*data, want);
        if (!n)
            return -1;
        *data = n;
        *cap = want;
    }
    uint64_t got = 0;
    while (got < want) {
        ssize_t n = pread(s->fd, *data + got, want - got, (off_t)(s->header_len + start + got));
        if (n < 0 && errno == EINTR)
            continue;
        if (n <= 0)
            return -1; /* a failed or short read: the engine's to report */
        got += (uint64_t)n;
    }
    for (uint64_t i = 0; i * bs < want; i++) {
        uint64_t n = want - i * bs < bs ? want - i * bs : bs;
        if (first + i >= s->nblocks || xxh3_(*data + i * bs, n) != s->sums[first + i])
            return -1;
    }
    return (ssize_t)(inner - start);
}

static void reply(uint64_t unique, const char *data, uint64_t len) {
    struct fuse_out_header out = {(uint32_t)(sizeof out + len), 0, unique};
    struct iovec iov[2] = {{&out, sizeof out}, {(void *)data, len}};
    while (writev(fuse_fd_, iov, len ? 2 : 1) < 0 && errno == EINTR) {
    }
    /* ENOENT: the request was interrupted and is gone; ENODEV: the mount is */
}

/* Answer a READ here if it is ours; 1 when answered. */
static int serve_read(int me, struct fuse_in_header *in, struct fuse_read_in *rd, char **data,
                      size_t *cap) {
    slot_t *s = NULL;
    uint64_t inner, len;
    pthread_mutex_lock(&lock_);
    if (!active_ || rd->size == 0)
        goto forward;
    uint64_t ino = in->nodeid, o = rd->offset;
    uint64_t tag_id = ino >> (index_bits_ + kind_bits_);
    uint64_t kind = (ino >> index_bits_) & ((1ULL << kind_bits_) - 1);
    if (kind != kind_chunk_ && kind != kind_view_)
        goto forward;
    tag_t *t = map_get(&tags_, tag_id);
    if (!t || !t->enabled || !t->chunk_size)
        goto forward;
    uint64_t index;
    if (kind == kind_chunk_) {
        index = ino & ((1ULL << index_bits_) - 1);
        if (index >= t->num_blobs || o >= t->chunk_size)
            goto forward;
        inner = o;
        len = rd->size < t->chunk_size - o ? rd->size : t->chunk_size - o;
    } else {
        if (o >= t->view_size)
            goto forward;
        uint64_t end = o + rd->size < t->view_size ? o + rd->size : t->view_size;
        index = o / t->chunk_size;
        if ((end - 1) / t->chunk_size != index)
            goto forward; /* across blobs: the engine's */
        inner = o % t->chunk_size;
        len = end - o;
    }
    uint64_t blobs_of = t->blobs_of;
    if (index >> 32 || blobs_of >> 31)
        goto forward; /* past what a slot's key holds (publish refuses those too) */
    s = map_get(&slots_, blobs_of << 32 | index);
    if (!s || inner >= s->payload_len)
        goto forward;
    if (len > s->payload_len - inner)
        len = s->payload_len - inner;
    s->refs++;
    serving_[me][0] = in->unique;
    pthread_mutex_unlock(&lock_);

    int ok = 1;
    if (s->all_zero) {
        if (len > *cap) {
            char *n = realloc(*data, len);
            ok = n != NULL;
            if (ok) {
                *data = n;
                *cap = len;
            }
        }
        if (ok) {
            memset(*data, 0, len);
            reply(in->unique, *data, len);
        }
    } else {
        ssize_t at = read_verified(s, inner, len, data, cap);
        ok = at >= 0;
        if (ok)
            reply(in->unique, *data + at, len);
    }
    pthread_mutex_lock(&lock_);
    serving_[me][1] = ok ? in->unique : 0; /* a READ passed on keeps its INTERRUPT */
    serving_[me][0] = 0;
    if (ok) {
        s->hits++;
        counts_.reads++;
        counts_.bytes += len;
    }
    slot_release(s);
    if (!ok)
        counts_.forwarded++;
    pthread_mutex_unlock(&lock_);
    return ok;
forward:
    counts_.forwarded += active_;
    pthread_mutex_unlock(&lock_);
    return 0;
}

static int interrupts_ours(struct fuse_interrupt_in *intr) {
    int ours = 0;
    pthread_mutex_lock(&lock_);
    for (int i = 0; i < nreaders_ && !ours; i++)
        ours = serving_[i][0] == intr->unique || serving_[i][1] == intr->unique;
    pthread_mutex_unlock(&lock_);
    return ours;
}

/* -- the readers ------------------------------------------------------------------------------ */

static void end_queue(void) {
    pthread_mutex_lock(&lock_);
    int was = ended_;
    ended_ = 1;
    pthread_mutex_unlock(&lock_);
    uint64_t many = ENDED_COUNT;
    if (!was && write(queue_fd_, &many, sizeof many) < 0) {
        /* the count is near its top already: readable either way */
    }
}

static void enqueue(char *mem, size_t len) {
    queued_t *q = malloc(sizeof *q);
    if (!q) {
        /* cannot queue it: answer it with an error rather than leave its caller waiting */
        struct fuse_in_header *in = (struct fuse_in_header *)mem;
        struct fuse_out_header out = {sizeof out, -ENOMEM, in->unique};
        if (write(fuse_fd_, &out, sizeof out) < 0) {
        }
        give_buffer(mem);
        return;
    }
    q->next = NULL;
    q->mem = mem;
    q->len = len;
    pthread_mutex_lock(&lock_);
    if (q_tail_)
        q_tail_->next = q;
    else
        q_head_ = q;
    q_tail_ = q;
    counts_.queued++;
    pthread_mutex_unlock(&lock_);
    uint64_t one = 1;
    if (write(queue_fd_, &one, sizeof one) < 0) {
    }
}

static void on_wake(int sig) { (void)sig; /* only to end a reader's blocking read (EINTR) */ }

static void *reader(void *arg) {
    int me = (int)(intptr_t)arg;
    sigset_t only_wake;
    sigfillset(&only_wake);
    sigdelset(&only_wake, WAKE_SIGNAL);
    pthread_sigmask(SIG_SETMASK, &only_wake, NULL); /* the process's signals are Python's */
    char *buf = take_buffer();
    char *data = NULL;
    size_t cap = 0;
    /* a blocking read: the device wakes one waiting reader per request (an exclusive wait),
       where a poll would wake every reader for each */
    while (buf && !__atomic_load_n(&stopping_, __ATOMIC_ACQUIRE)) {
        ssize_t n = read(fuse_fd_, buf, REQ_BUF);
        if (n < 0) {
            if (errno == EINTR || errno == EAGAIN || errno == ENOENT)
                continue; /* woken to stop, or the request was interrupted before it was read */
            end_queue();  /* ENODEV: unmounted; anything else: pyfuse3 sees the end too */
            break;
        }
        struct fuse_in_header *in = (struct fuse_in_header *)buf;
        if (in->opcode == FUSE_INIT && (size_t)n <= INIT_MAX) {
            pthread_mutex_lock(&lock_);
            memcpy(init_copy_, buf, (size_t)n);
            init_len_ = (size_t)n;
            pthread_mutex_unlock(&lock_);
        }
        if ((size_t)n >= sizeof *in + sizeof(struct fuse_read_in) && in->opcode == FUSE_READ &&
            serve_read(me, in, (struct fuse_read_in *)(in + 1), &data, &cap))
            continue;
        if ((size_t)n >= sizeof *in + sizeof(struct fuse_interrupt_in) &&
            in->opcode == FUSE_INTERRUPT && interrupts_ours((struct fuse_interrupt_in *)(in + 1)))
            continue;
        if ((size_t)n >= sizeof *in + sizeof(struct fuse_write_in) && in->opcode == FUSE_WRITE &&
            (((struct fuse_write_in *)(in + 1))->write_flags & FUSE_WRITE_CACHE))
            ((struct fuse_write_in *)(in + 1))->fh |= WRITEBACK_FH;
        enqueue(buf, (size_t)n);
        buf = take_buffer();
    }
    if (buf)
        give_buffer(buf);
    free(data);
    return NULL;
}

/* End the readers' reads of the device (what they queued stays queued). */
static void join_readers(void) {
    __atomic_store_n(&stopping_, 1, __ATOMIC_RELEASE);
    Py_BEGIN_ALLOW_THREADS
    for (int i = 0; i < nreaders_; i++) {
        for (;;) { /* a reader between its look at stopping_ and its read: wake it again */
            pthread_kill(readers_[i], WAKE_SIGNAL);
            struct timespec until;
            clock_gettime(CLOCK_REALTIME, &until);
            until.tv_nsec += 20 * 1000 * 1000;
            if (until.tv_nsec >= 1000000000L) {
                until.tv_sec++;
                until.tv_nsec -= 1000000000L;
            }
            if (pthread_timedjoin_np(readers_[i], NULL, &until) == 0)
                break;
        }
    }
    Py_END_ALLOW_THREADS
    nreaders_ = 0;
}

static void stop_readers(void) {
    join_readers();
    pthread_mutex_lock(&lock_);
    queued_t *q = q_head_;
    q_head_ = q_tail_ = NULL;
    for (size_t i = 0; i < nspare_; i++)
        free(spare_[i]);
    nspare_ = 0;
    pthread_mutex_unlock(&lock_);
    while (q) { /* never answered: the session is going away */
        queued_t *next = q->next;
        free(q->mem);
        free(q);
        q = next;
    }
    if (queue_fd_ >= 0)
        close(queue_fd_);
    if (fuse_fd_ >= 0)
        close(fuse_fd_);
    queue_fd_ = fuse_fd_ = -1;
    session_ = NULL;
    ended_ = 0;
}

/* FUSE_NOTIFY_RESEND (7, Linux >= 6.9): the requests read from this connection and not
   answered go back to its pending queue, their unique marked with bit 63. 0 or -errno. */
static int send_resend(void) {
    struct fuse_out_header out = {sizeof out, 7, 0};
    ssize_t n;
    while ((n = write(fuse_fd_, &out, sizeof out)) < 0 && errno == EINTR) {
    }
    resend_errno_ = n < 0 ? errno : 0;
    return -resend_errno_;
}

static int start_readers(struct fuse_session *se, int fd) {
    struct sigaction wake;
    memset(&wake, 0, sizeof wake);
    wake.sa_handler = on_wake; /* no SA_RESTART: the read returns EINTR */
    sigemptyset(&wake.sa_mask);
    queue_fd_ = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK | EFD_SEMAPHORE);
    /* the readers' own descriptor of the device: libfuse's unmount closes its own */
    fuse_fd_ = fcntl(fd, F_DUPFD_CLOEXEC, 0);
    if (queue_fd_ < 0 || fuse_fd_ < 0 || sigaction(WAKE_SIGNAL, &wake, NULL) < 0) {
        if (queue_fd_ >= 0)
            close(queue_fd_);
        if (fuse_fd_ >= 0)
            close(fuse_fd_);
        queue_fd_ = fuse_fd_ = -1;
        return -1;
    }
    session_ = se;
    ended_ = 0;
    stopping_ = 0;
    memset(serving_, 0, sizeof serving_);
    if (takeover_len_) { /* the connection was served before: its INIT first */
        char *mem = take_buffer();
        if (mem) {
            memcpy(mem, takeover_init_, takeover_len_);
            ((struct fuse_in_header *)mem)->unique = SYNTHETIC_UNIQUE;
            enqueue(mem, takeover_len_);
        }
        takeover_len_ = 0;
        /* before any reader reads: a request read here first and resent after would come
           twice, and the reply to the first copy would be refused */
        send_resend();
    }
    for (nreaders_ = 0; nreaders_ < want_readers_; nreaders_++)
        if (pthread_create(&readers_[nreaders_], NULL, reader, (void *)(intptr_t)nreaders_))
            break;
    if (!nreaders_) {
        stop_readers();
        return -1;
    }
    return 0;
}

/* -- the stand-ins for libfuse's functions -------------------------------------------------- */

static void *libfuse(const char *name) {
    static void *lib;
    if (!lib)
        lib = dlopen("libfuse3.so.3", RTLD_NOW | RTLD_NOLOAD);
    void *fn = lib ? dlsym(lib, name) : NULL;
    return fn ? fn : dlsym(RTLD_NEXT, name);
}

int fuse_session_fd(struct fuse_session *se) {
    static int (*real)(struct fuse_session *);
    if (!real && !(real = (int (*)(struct fuse_session *))libfuse("fuse_session_fd")))
        return -1;
    if (se && se == session_)
        return queue_fd_;
    int fd = real(se);
    if (fd >= 0 && se && !session_ && want_readers_ && start_readers(se, fd) == 0) {
        want_readers_ = 0; /* one session per prepare() */
        return queue_fd_;
    }
    return fd;
}

int fuse_session_receive_buf(struct fuse_session *se, struct fuse_buf *buf) {
    static int (*real)(struct fuse_session *, struct fuse_buf *);
    if (!real &&
        !(real = (int (*)(struct fuse_session *, struct fuse_buf *))libfuse("fuse_session_receive_buf")))
        return -ENOSYS;
    if (!se || se != session_)
        return real(se, buf);
    uint64_t one;
    if (read(queue_fd_, &one, sizeof one) < 0 && !ended_)
        return -EINTR; /* another of pyfuse3's workers took it: it waits again */
    pthread_mutex_lock(&lock_);
    queued_t *q = q_head_;
    if (q) {
        q_head_ = q->next;
        if (!q_head_)
            q_tail_ = NULL;
    }
    int ended = ended_;
    pthread_mutex_unlock(&lock_);
    if (!q) {
        if (!ended)
            return -EINTR;
        fuse_session_exit(se); /* as libfuse's receive does at ENODEV: no worker starts again */
        return 0;
    }
    if (buf->mem && !(buf->flags & FUSE_BUF_IS_FD))
        give_buffer(buf->mem);
    current_unique_ = ((struct fuse_in_header *)q->mem)->unique;
    buf->mem = q->mem;
    buf->size = q->len;
    buf->flags = 0;
    buf->pos = 0;
    int len = (int)q->len;
    free(q);
    return len;
}

void fuse_session_unmount(struct fuse_session *se) {
    static void (*real)(struct fuse_session *);
    if (!real && !(real = (void (*)(struct fuse_session *))libfuse("fuse_session_unmount")))
        return;
    if (se && se == session_)
        stop_readers(); /* before libfuse's unmount closes the device and the connection ends */
    real(se);
}

void fuse_session_destroy(struct fuse_session *se) {
    static void (*real)(struct fuse_session *);
    if (!real && !(real = (void (*)(struct fuse_session *))libfuse("fuse_session_destroy")))
        return;
    if (se && se == session_)
        stop_readers();
    real(se);
}

/* -- the Python side ---------------------------------------------------------------------- */

static PyObject *py_prepare(PyObject *self, PyObject *args) {
    (void)self;
    int threads;
    if (!PyArg_ParseTuple(args, "i", &threads))
        return NULL;
    if (threads < 0 || threads > MAX_READERS) {
        PyErr_Format(PyExc_ValueError, "reader threads must be 0 to %d", MAX_READERS);
        return NULL;
    }
    want_readers_ = threads;
    Py_RETURN_NONE;
}

static PyObject *py_queue_fd(PyObject *self, PyObject *args) {
    (void)self;
    (void)args;
    return PyLong_FromLong(session_ ? queue_fd_ : -1);
}

static PyObject *py_start(PyObject *self, PyObject *args) {
    (void)self;
    unsigned long long xxh3_addr, kind_chunk, kind_view;
    unsigned int index_bits, kind_bits;
    if (!PyArg_ParseTuple(args, "KIIKK", &xxh3_addr, &index_bits, &kind_bits, &kind_chunk,
                          &kind_view))
        return NULL;
    if (!session_) {
        PyErr_SetString(PyExc_RuntimeError, "no FUSE session is read by this library");
        return NULL;
    }
    if (!xxh3_addr || index_bits > 48 || !kind_bits || kind_bits > 8 ||
        index_bits + kind_bits >= 64 || kind_chunk >> kind_bits || kind_view >> kind_bits ||
        kind_chunk == kind_view) {
        PyErr_SetString(PyExc_ValueError, "bad start arguments");
        return NULL;
    }
    pthread_mutex_lock(&lock_);
    xxh3_ = (xxh3_fn)(uintptr_t)xxh3_addr;
    index_bits_ = index_bits;
    kind_bits_ = kind_bits;
    kind_chunk_ = kind_chunk;
    kind_view_ = kind_view;
    active_ = 1;
    pthread_mutex_unlock(&lock_);
    Py_RETURN_NONE;
}

static PyObject *py_stop(PyObject *self, PyObject *args) {
    (void)self;
    (void)args;
    pthread_mutex_lock(&lock_);
    active_ = 0; /* from here every READ is pyfuse3's; reads in flight hold their slots */
    for (size_t i = 0; i < slots_.cap; i++) {
        slot_t *s = slots_.vals[i];
        if (s && s != (void *)TOMB)
            slot_release(s);
    }
    for (size_t i = 0; i < tags_.cap; i++)
        if (tags_.vals[i] && tags_.vals[i] != TOMB)
            free(tags_.vals[i]);
    free(slots_.keys), free(slots_.vals), free(tags_.keys), free(tags_.vals);
    memset(&slots_, 0, sizeof slots_);
    memset(&tags_, 0, sizeof tags_);
    pthread_mutex_unlock(&lock_);
    Py_RETURN_NONE;
}

static PyObject *py_set_tag(PyObject *self, PyObject *args) {
    (void)self;
    unsigned long long id, cs, vs, nb, blobs_of = (unsigned long long)-1;
    int enabled;
    if (!PyArg_ParseTuple(args, "KKKKp|K", &id, &cs, &vs, &nb, &enabled, &blobs_of))
        return NULL;
    if (blobs_of == (unsigned long long)-1)
        blobs_of = id;
    pthread_mutex_lock(&lock_);
    tag_t *t = map_get(&tags_, id);
    if (!t) {
        t = calloc(1, sizeof *t);
        if (!t || map_put(&tags_, id, t)) {
            free(t);
            pthread_mutex_unlock(&lock_);
            return PyErr_NoMemory();
        }
    }
    t->chunk_size = cs;
    t->view_size = vs;
    t->num_blobs = nb;
    t->blobs_of = blobs_of;
    t->enabled = enabled;
    pthread_mutex_unlock(&lock_);
    Py_RETURN_NONE;
}

static PyObject *py_disable_tag(PyObject *self, PyObject *args) {
    (void)self;
    unsigned long long id;
    if (!PyArg_ParseTuple(args, "K", &id))
        return NULL;
    pthread_mutex_lock(&lock_);
    tag_t *t = map_get(&tags_, id);
    if (t)
        t->enabled = 0;
    pthread_mutex_unlock(&lock_);
    Py_RETURN_NONE;
}

static PyObject *py_publish(PyObject *self, PyObject *args) {
    (void)self;
    unsigned long long tag, index, header_len, payload_len, stored_len;
    unsigned int block_size;
    int fd, all_zero;
    Py_buffer sums;
    if (!PyArg_ParseTuple(args, "KKiKKKIy*p", &tag, &index, &fd, &header_len, &payload_len,
                          &stored_len, &block_size, &sums, &all_zero))
        return NULL;
    uint64_t nblocks = (uint64_t)sums.len / 8;
    int bad = tag >= (1ULL << 31) || index >= (1ULL << 32) || sums.len % 8 ||
              nblocks > MAX_BLOCKS || (!all_zero && (block_size == 0 || block_size % 4096 ||
                                                      nblocks * block_size < stored_len ||
                                                      (nblocks && (nblocks - 1) * block_size >= stored_len)));
    if (bad) {
        PyBuffer_Release(&sums);
        PyErr_SetString(PyExc_ValueError, "blob does not fit the fast read path");
        return NULL;
    }
    slot_t *s = calloc(1, sizeof *s);
    if (!s) {
        PyBuffer_Release(&sums);
        return PyErr_NoMemory();
    }
    s->key = tag << 32 | index;
    s->refs = 1;
    s->fd = fcntl(fd, F_DUPFD_CLOEXEC, 0);
    s->header_len = header_len;
    s->payload_len = payload_len;
    s->stored_len = stored_len;
    s->block_size = block_size;
    s->nblocks = (uint32_t)nblocks;
    s->all_zero = (uint32_t)all_zero;
    memcpy(s->sums, sums.buf, (size_t)sums.len);
    PyBuffer_Release(&sums);
    if (s->fd < 0) {
        free(s);
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    pthread_mutex_lock(&lock_);
    slot_t *old = map_get(&slots_, s->key);
    if (map_put(&slots_, s->key, s)) {
        pthread_mutex_unlock(&lock_);
        close(s->fd);
        free(s);
        return PyErr_NoMemory();
    }
    if (old)
        slot_release(old);
    pthread_mutex_unlock(&lock_);
    Py_RETURN_NONE;
}

static PyObject *py_unpublish(PyObject *self, PyObject *args) {
    (void)self;
    unsigned long long tag, index;
    if (!PyArg_ParseTuple(args, "KK", &tag, &index))
        return NULL;
    pthread_mutex_lock(&lock_);
    slot_t *s = map_pop(&slots_, tag << 32 | index);
    if (s)
        slot_release(s);
    pthread_mutex_unlock(&lock_);
    return PyBool_FromLong(s != NULL);
}

static PyObject *py_harvest(PyObject *self, PyObject *args) {
    (void)self;
    (void)args;
    PyObject *touched = PyList_New(0);
    if (!touched)
        return NULL;
    pthread_mutex_lock(&lock_);
    for (size_t i = 0; i < slots_.cap; i++) {
        slot_t *s = slots_.vals[i];
        if (!s || s == (void *)TOMB || !s->hits)
            continue;
        PyObject *item = Py_BuildValue("(KKK)", (unsigned long long)(s->key >> 32),
                                       (unsigned long long)(s->key & 0xffffffffULL),
                                       (unsigned long long)s->hits);
        if (!item || PyList_Append(touched, item)) {
            Py_XDECREF(item);
            pthread_mutex_unlock(&lock_);
            Py_DECREF(touched);
            return NULL;
        }
        Py_DECREF(item);
        s->hits = 0;
    }
    PyObject *counts = Py_BuildValue(
        "{sKsKsKsK}", "reads", (unsigned long long)counts_.reads, "bytes",
        (unsigned long long)counts_.bytes, "forwarded", (unsigned long long)counts_.forwarded,
        "queued", (unsigned long long)counts_.queued);
    memset(&counts_, 0, sizeof counts_);
    pthread_mutex_unlock(&lock_);
    if (!counts) {
        Py_DECREF(touched);
        return NULL;
    }
    return Py_BuildValue("(NN)", touched, counts);
}

static PyObject *py_takeover(PyObject *self, PyObject *args) {
    (void)self;
    Py_buffer init;
    if (!PyArg_ParseTuple(args, "y*", &init))
        return NULL;
    int bad = init.len < (Py_ssize_t)(sizeof(struct fuse_in_header) + sizeof(struct fuse_init_in) - 48) ||
              init.len > INIT_MAX ||
              ((struct fuse_in_header *)init.buf)->opcode != FUSE_INIT ||
              ((struct fuse_in_header *)init.buf)->len != (uint32_t)init.len;
    if (bad) {
        PyBuffer_Release(&init);
        PyErr_SetString(PyExc_ValueError, "not a recorded FUSE_INIT request");
        return NULL;
    }
    pthread_mutex_lock(&lock_);
    memcpy(takeover_init_, init.buf, (size_t)init.len);
    takeover_len_ = (size_t)init.len;
    memcpy(init_copy_, init.buf, (size_t)init.len); /* what a later takeover re-applies */
    init_len_ = (size_t)init.len;
    pthread_mutex_unlock(&lock_);
    PyBuffer_Release(&init);
    Py_RETURN_NONE;
}

static PyObject *py_init_request(PyObject *self, PyObject *args) {
    (void)self;
    (void)args;
    pthread_mutex_lock(&lock_);
    PyObject *out = init_len_ ? PyBytes_FromStringAndSize(init_copy_, (Py_ssize_t)init_len_)
                              : (Py_INCREF(Py_None), Py_None);
    pthread_mutex_unlock(&lock_);
    return out;
}

static PyObject *py_current_unique(PyObject *self, PyObject *args) {
    (void)self;
    (void)args;
    return PyLong_FromUnsignedLongLong(current_unique_);
}

static PyObject *py_resend(PyObject *self, PyObject *args) {
    (void)self;
    (void)args;
    /* sent when the session started (start_readers): how it went */
    if (resend_errno_ > 0) {
        errno = resend_errno_;
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    return PyBool_FromLong(resend_errno_ == 0);
}

static PyObject *py_pause(PyObject *self, PyObject *args) {
    (void)self;
    (void)args;
    if (session_)
        join_readers(); /* the device keeps what nobody read: the next daemon reads it */
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"pause", py_pause, METH_NOARGS,
     "Read no more requests from the device (a daemon handing its mount over)"},
    {"takeover", py_takeover, METH_VARARGS,
     "takeover(init): the next session serves a connection already set up by this INIT"},
    {"init_request", py_init_request, METH_NOARGS,
     "The FUSE_INIT request this connection was set up with (bytes), or None"},
    {"current_unique", py_current_unique, METH_NOARGS,
     "The unique of the request last handed to pyfuse3 (read first thing in a handler)"},
    {"resend", py_resend, METH_NOARGS,
     "Whether the kernel was asked to resend what the dead daemon read (at a takeover's "
     "start); OSError when it refused"},
    {"prepare", py_prepare, METH_VARARGS,
     "prepare(threads): the next FUSE session is read by that many threads of this library"},
    {"queue_fd", py_queue_fd, METH_NOARGS,
     "The eventfd pyfuse3 waits on (readable while requests are queued for it), or -1"},
    {"start", py_start, METH_VARARGS,
     "start(xxh3_addr, index_bits, kind_bits, kind_chunk, kind_view): answer staged READs"},
    {"stop", py_stop, METH_NOARGS, "Answer no READ here any more; drop every table."},
    {"set_tag", py_set_tag, METH_VARARGS,
     "set_tag(id, chunk_size, view_size, num_blobs, enabled[, blobs_of])"},
    {"disable_tag", py_disable_tag, METH_VARARGS, "disable_tag(id): its reads go to pyfuse3"},
    {"publish", py_publish, METH_VARARGS,
     "publish(tag, index, fd, header_len, payload_len, stored_len, block_size, sums, all_zero)"},
    {"unpublish", py_unpublish, METH_VARARGS, "unpublish(tag, index) -> was published"},
    {"harvest", py_harvest, METH_NOARGS, "([(tag, index, hits)], counts) since the last harvest"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_fastread", NULL, -1, methods,
                                    NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__fastread(void) { return PyModule_Create(&module); }
