/*
 * sums.c - snapshot checksums and a clone's RAM delta filter, run off the loop.
 *
 * Checksums (sum_files): SHA-256 through OpenSSL, which uses the CPU's SHA
 * extensions here and beats libsodium's BLAKE2b on one core. Only non-zero 4 KiB
 * pages are hashed (holes are skipped with SEEK_DATA, written zeros by a scan),
 * and 1 MiB chunks are spread over one thread per CPU (at most 4), so a RAM file
 * costs what it holds rather than its size. A struct sumjob runs either that over
 * a snapshot's parts or sp_migdelta_filter over a clone's suspend stream, as a
 * job on the loop's SP_WORK_LONG lane; its result goes back to snapshot.c on the
 * loop. Owns the jobs until their done callback; knows nothing of QMP or manifests.
 */
#include "core/runtime/qemu/qemu_int.h"

#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include <openssl/evp.h>

/* ---------- snapshot checksums ---------- */

static void put_le64(uint8_t *p, uint64_t v)
{
    for (int i = 0; i < 8; i++)
        p[i] = (uint8_t)(v >> (8 * i));
}

static bool all_zero(const uint8_t *p, size_t n)
{
    size_t i = 0;
    for (; i + 8 <= n; i += 8) {
        uint64_t w;
        memcpy(&w, p + i, sizeof w);
        if (w != 0)
            return false;
    }
    for (; i < n; i++)
        if (p[i] != 0)
            return false;
    return true;
}

/* One part being checksummed (sum_parts). */
struct sumpart {
    int fd;
    uint64_t size, nchunks, first_stripe; /* its stripes in the shared numbering */
    uint8_t *md;                          /* nchunks * 32: each chunk's SHA-256 */
    uint8_t *has;                         /* nchunks: 1 = the chunk is not all zero */
};

struct sumwork {
    struct sumpart *p;
    int n;
    uint64_t stripes;
    atomic_ulong next;
    atomic_int err; /* the first errno */
    int err_part;   /* and its file (written once, by the thread that set err) */
    const sp_work_t *work; /* NULL, or the job whose cancel ends this early */
};

static void sum_error(struct sumwork *w, int part, int e)
{
    int z = 0;
    if (atomic_compare_exchange_strong(&w->err, &z, e))
        w->err_part = part;
}

#define SUM_STRIPE 8    /* chunks a worker takes at a time */
#define SUM_PAGE   4096 /* zero pages inside a chunk are skipped */

/* Takes stripes until none is left: each chunk is a hole (SEEK_DATA says so), all zero, or
 * hashed. Any number of these run on one sumwork. */
static void *sum_worker(void *arg)
{
    struct sumwork *w = arg;
    uint8_t *buf = malloc(SP_QEMU_SUM_CHUNK);
    EVP_MD_CTX *ctx = EVP_MD_CTX_new();
    if (buf == NULL || ctx == NULL) {
        sum_error(w, -1, ENOMEM);
        free(buf);
        EVP_MD_CTX_free(ctx);
        return NULL;
    }
    for (;;) {
        uint64_t s = atomic_fetch_add(&w->next, 1);
        if (s >= w->stripes || atomic_load(&w->err) != 0)
            break;
        int i = 0;
        while (i + 1 < w->n && w->p[i + 1].first_stripe <= s)
            i++;
        struct sumpart *p = &w->p[i];
        uint64_t c0 = (s - p->first_stripe) * SUM_STRIPE;
        uint64_t c1 = c0 + SUM_STRIPE < p->nchunks ? c0 + SUM_STRIPE : p->nchunks;
        uint64_t data = 0, hole = 0; /* the data extent last found: [data, hole) */
        bool seek = true;            /* SEEK_DATA works on this file system */
        int e = 0;
        for (uint64_t c = c0; c < c1 && e == 0; c++) {
            if (w->work != NULL && sp_work_cancelled(w->work)) {
                e = ECANCELED;
                break;
            }
            uint64_t off = c * SP_QEMU_SUM_CHUNK;
            uint64_t end = p->size - off < SP_QEMU_SUM_CHUNK ? p->size : off + SP_QEMU_SUM_CHUNK;
            uint64_t pos = off; /* pages before pos are done */
            bool any = false;
            if (EVP_DigestInit_ex(ctx, EVP_sha256(), NULL) != 1)
                e = ENOMEM;
            while (pos < end && e == 0) {
                uint64_t rs = pos, re = end; /* the next range that may hold data */
                if (seek && hole <= pos) {
                    off_t d = lseek(p->fd, (off_t)pos, SEEK_DATA);
                    off_t h = d >= 0 ? lseek(p->fd, d, SEEK_HOLE) : -1;
                    if (d < 0 && errno == ENXIO) {
                        data = hole = p->size; /* nothing but holes from pos on */
                    } else if (d < 0 || h < 0) {
                        seek = false;
                    } else {
                        data = (uint64_t)d;
                        hole = (uint64_t)h;
                    }
                }
                if (seek) {
                    if (data >= end)
                        break; /* the rest of the chunk is a hole */
                    rs = data > pos ? data : pos;
                    re = hole < end ? hole : end;
                }
                /* whole pages, counted from the chunk's start */
                rs = off + (rs - off) / SUM_PAGE * SUM_PAGE;
                if (rs < pos)
                    rs = pos;
                re = off + (re - off + SUM_PAGE - 1) / SUM_PAGE * SUM_PAGE;
                if (re > end)
                    re = end;
                size_t got = 0, len = (size_t)(re - rs);
                while (got < len && e == 0) {
                    ssize_t r = pread(p->fd, buf + got, len - got, (off_t)(rs + got));
                    if (r > 0)
                        got += (size_t)r;
                    else if (r < 0 && errno != EINTR)
                        e = errno;
                    else if (r == 0)
                        e = EIO; /* the file shrank under us */
                }
                for (size_t k = 0; e == 0 && k < len; k += SUM_PAGE) {
                    size_t pl = len - k < SUM_PAGE ? len - k : SUM_PAGE;
                    if (all_zero(buf + k, pl))
                        continue;
                    uint8_t idx[4];
                    uint32_t pg = (uint32_t)((rs + k - off) / SUM_PAGE);
                    for (int b = 0; b < 4; b++)
                        idx[b] = (uint8_t)(pg >> (8 * b));
                    if (EVP_DigestUpdate(ctx, idx, sizeof idx) != 1 ||
                        EVP_DigestUpdate(ctx, buf + k, pl) != 1)
                        e = ENOMEM;
                    any = true;
                }
                pos = re;
            }
            unsigned mdlen = 0;
            if (e == 0 && any &&
                (EVP_DigestFinal_ex(ctx, p->md + 32 * c, &mdlen) != 1 || mdlen != 32))
                e = ENOMEM;
            if (e == 0)
                p->has[c] = any;
        }
        if (e != 0) {
            sum_error(w, e == ECANCELED ? -1 : i, e);
            break;
        }
    }
    free(buf);
    EVP_MD_CTX_free(ctx);
    return NULL;
}

/* The checksums (SP_QEMU_SUM_ALGO) of n files into hex[i] (65 bytes each), their sizes into
 * size[i]: per file, SHA-256 over "space-sum-1" and the file size, then, for each 1 MiB chunk
 * holding a byte that is not zero, the chunk's index (u64 LE) and the chunk's digest: SHA-256
 * over each of its 4 KiB pages that is not all zero, as its index in the chunk (u32 LE) and
 * its bytes. Zero pages cost a SEEK_DATA (holes: never read) or a scan (written zeros) instead
 * of a hash, so a sparse RAM file costs what it holds even when the guest scattered it, and
 * the value does not depend on how the file system stores zeros. Chunks are hashed in
 * parallel (up to SP_QEMU_SUM_THREADS threads, one per CPU, this one included).
 * SHA-256 because OpenSSL's uses the CPU's SHA extensions here: faster a core than
 * libsodium's BLAKE2b. pread, not mmap: a file that shrinks under a
 * mapping raises SIGBUS. A cancel of work (not NULL) ends it early (ECANCELED). Thread-safe.
 * 0, or -1 with errno and *bad set to the file that failed (-1 when none did in particular). */
static int sum_files(const char *const *paths, int n, int threads, const sp_work_t *work,
                     uint64_t *size, char (*hex)[65], int *bad)
{
    struct sumpart p[SUM_N];
    struct sumwork w = {.p = p, .n = n, .work = work, .err_part = -1};
    atomic_init(&w.next, 0);
    atomic_init(&w.err, 0);
    *bad = -1;
    if (n < 1 || n > SUM_N) {
        errno = EINVAL;
        return -1;
    }
    int rc = -1, e = 0;
    memset(p, 0, sizeof p);
    for (int i = 0; i < n; i++)
        p[i].fd = -1;
    for (int i = 0; i < n; i++) {
        struct stat st;
        p[i].fd = open(paths[i], O_RDONLY | O_CLOEXEC);
        if (p[i].fd < 0 || fstat(p[i].fd, &st) < 0) {
            e = errno;
            *bad = i;
            goto out;
        }
        p[i].size = (uint64_t)st.st_size;
        p[i].nchunks = (p[i].size + SP_QEMU_SUM_CHUNK - 1) / SP_QEMU_SUM_CHUNK;
        p[i].first_stripe = w.stripes;
        w.stripes += (p[i].nchunks + SUM_STRIPE - 1) / SUM_STRIPE;
        p[i].md = malloc(p[i].nchunks * 32 + 1);
        p[i].has = calloc(p[i].nchunks + 1, 1);
        if (p[i].md == NULL || p[i].has == NULL) {
            e = ENOMEM;
            goto out;
        }
    }
    int nt = threads < 1 ? 1 : threads > SP_QEMU_SUM_THREADS ? SP_QEMU_SUM_THREADS : threads;
    if ((uint64_t)nt > w.stripes)
        nt = w.stripes > 0 ? (int)w.stripes : 1;
    pthread_t th[SP_QEMU_SUM_THREADS];
    int started = 0;
    for (int i = 1; i < nt; i++)
        if (pthread_create(&th[started], NULL, sum_worker, &w) == 0)
            started++; /* fewer helpers only make it slower */
    sum_worker(&w);
    for (int i = 0; i < started; i++)
        pthread_join(th[i], NULL);
    if ((e = atomic_load(&w.err)) != 0) {
        *bad = w.err_part;
        goto out;
    }
    for (int i = 0; i < n; i++) {
        EVP_MD_CTX *c = EVP_MD_CTX_new();
        uint8_t rec[8 + 32], md[EVP_MAX_MD_SIZE];
        unsigned mdlen = 0;
        bool ok = c != NULL && EVP_DigestInit_ex(c, EVP_sha256(), NULL) == 1;
        memcpy(rec, "space-sum-1", 11);
        put_le64(rec + 11, p[i].size);
        ok = ok && EVP_DigestUpdate(c, rec, 19) == 1;
        for (uint64_t k = 0; ok && k < p[i].nchunks; k++) {
            if (!p[i].has[k])
                continue;
            put_le64(rec, k);
            memcpy(rec + 8, p[i].md + 32 * k, 32);
            ok = EVP_DigestUpdate(c, rec, sizeof rec) == 1;
        }
        ok = ok && EVP_DigestFinal_ex(c, md, &mdlen) == 1 && mdlen == 32;
        EVP_MD_CTX_free(c);
        if (!ok) {
            e = ENOMEM;
            goto out;
        }
        for (unsigned k = 0; k < mdlen; k++)
            sp_qemu__sfmt(hex[i] + 2 * k, 3, "%02x", md[k]);
        size[i] = p[i].size;
    }
    rc = 0;
out:
    for (int i = 0; i < n; i++) {
        if (p[i].fd >= 0)
            close(p[i].fd);
        free(p[i].md);
        free(p[i].has);
    }
    if (rc < 0)
        errno = e != 0 ? e : EIO;
    return rc;
}

int sp_qemu__sum_file(const char *path, uint64_t *size, char hex[65])
{
    int bad;
    char(*h)[65] = (char(*)[65])hex;
    return sum_files(&path, 1, 1, NULL, size, h, &bad);
}

void sp_qemu__sumjob_free(struct sumjob *j)
{
    if (j->in_fd >= 0)
        close(j->in_fd);
    if (j->out_fd >= 0)
        close(j->out_fd);
    sp_migdelta_live_close(&j->live);
    free(j);
}

/* The job itself, on a worker thread (sp_loop_work): touches nothing but j. */
static void sum_run(sp_work_t *w, void *arg)
{
    struct sumjob *j = arg;
    uint64_t t0 = sp_qemu__mono_ms();
    if (j->delta) {
        if (j->live.mem_fd >= 0)
            j->rc = sp_migdelta_filter_live(j->in_fd, j->out_fd, j->base, "mem", &j->live, &j->st,
                                            j->why, sizeof j->why);
        else
            j->rc = sp_migdelta_filter(j->in_fd, j->out_fd, j->base, "mem", &j->st, j->why,
                                       sizeof j->why);
        close(j->in_fd); /* a writer still at it gets EPIPE rather than blocking */
        j->in_fd = -1;
        goto done;
    }
    const char *paths[SUM_N];
    int idx[SUM_N], n = 0, bad = -1;
    for (int i = 0; i < SUM_N; i++) {
        if (j->path[i][0] != '\0') {
            paths[n] = j->path[i];
            idx[n++] = i;
        }
    }
    uint64_t size[SUM_N] = {0};
    char hex[SUM_N][65];
    /* One thread per CPU. On a wake QEMU loads the device state meanwhile: leaving it a CPU
     * (one thread fewer) did not help on 2 CPUs: the wait only moved to the checksums. */
    long cpus = sysconf(_SC_NPROCESSORS_ONLN);
    int threads = cpus < 1 ? 1 : (int)(cpus > SP_QEMU_SUM_THREADS ? SP_QEMU_SUM_THREADS : cpus);
    if (n > 0 && sum_files(paths, n, threads, w, size, hex, &bad) < 0) {
        j->bad = bad >= 0 ? idx[bad] : idx[0];
        j->err_no = errno != 0 ? errno : EIO;
    }
    for (int k = 0; k < n && j->bad < 0; k++) {
        memcpy(j->got[idx[k]], hex[k], 65);
        j->size[idx[k]] = size[k];
        if (j->verify && strcmp(hex[k], j->want[idx[k]]) != 0)
            j->bad = idx[k];
    }
done:
    j->ms = sp_qemu__mono_ms() - t0;
}

/* A job for vm, not started: fill path[] (and want[] with verify), then sp_qemu__sumjob_run. */
struct sumjob *sp_qemu__sumjob_new(struct vm *vm, bool verify)
{
    struct sumjob *j = calloc(1, sizeof(*j));
    if (j == NULL)
        return NULL;
    j->vm = vm;
    j->verify = verify;
    j->bad = -1;
    j->in_fd = -1;
    j->out_fd = -1;
    j->live.mem_fd = j->live.pagemap_fd = -1;
    return j;
}

static void on_sum_done(void *arg, bool cancelled);

/* Queues j on the loop's SP_WORK_LONG lane; on failure frees j. 0 when queued. */
int sp_qemu__sumjob_run(sp_qemu_t *d, struct sumjob *j)
{
    j->work = sp_loop_work(d->base.loop, SP_WORK_LONG, sum_run, on_sum_done, j);
    if (j->work == NULL) {
        sp_qemu__sumjob_free(j);
        return -1;
    }
    return 0;
}

/* The VM no longer wants the result: the job stops at its next chunk (a delta filter: once
 * QEMU closes the pipe) and on_sum_done frees it. NULL does nothing. */
void sp_qemu__sumjob_abandon(struct sumjob *j)
{
    if (j == NULL)
        return;
    j->vm = NULL;
    sp_work_cancel(j->work);
}

static void on_sum_done(void *arg, bool cancelled)
{
    struct sumjob *j = arg;
    struct vm *vm = j->vm;
    if (cancelled) {
        /* Abandoned (vm NULL), or cancelled by the loop going away first: the VM lets go too. */
        if (vm != NULL && vm->sum == j)
            vm->sum = NULL;
        if (vm != NULL && vm->delta == j)
            vm->delta = NULL;
        sp_qemu__sumjob_free(j);
        return;
    }
    if (j->delta) {
        vm->delta = NULL;
        sp_qemu__suspend_delta_done(vm, j);
    } else {
        vm->sum = NULL;
        if (j->verify)
            sp_qemu__restore_sums_done(vm, j);
        else
            sp_qemu__suspend_sums_done(vm, j);
    }
    sp_qemu__sumjob_free(j);
}
