/* Large blocks kept for reuse: a malloc front for blocks of LARGE bytes and more, preloaded (LD_PRELOAD) into
 * a training process; see angel_jax/memory/block_cache.py for why.
 *
 * glibc maps every block above its mmap threshold (at most 32 MiB) afresh and unmaps it on free, so each such
 * block costs the kernel a page fault and a zeroed page for every page of it, every time. Here a freed large
 * block is kept, by its rounded size, and handed out again for the next request of that size, up to
 * ANGEL_JAX_BLOCK_CACHE bytes of kept blocks (the oldest are unmapped first beyond that). Everything smaller
 * goes to glibc (__libc_malloc and friends, exported for exactly this).
 *
 * Blocks are mmap'ed (advised to use transparent huge pages) and recorded in a table of live blocks, which is
 * how free() knows a block is one of these. One mutex guards the table and the kept blocks: large requests are
 * a few thousand per training step.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

extern void *__libc_malloc(size_t);
extern void __libc_free(void *);
extern void *__libc_calloc(size_t, size_t);
extern void *__libc_realloc(void *, size_t);
extern void *__libc_memalign(size_t, size_t);

#define LARGE ((size_t)1 << 20)
#define HUGE ((size_t)2 << 20)
#define SLOTS (1u << 16) /* live large blocks at most: 64 Ki (64 GiB of 1 MiB blocks) */
#define KEPT_MAX 4096

static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
static uintptr_t slot_ptr[SLOTS];
static size_t slot_size[SLOTS];
static struct { void *ptr; size_t size; } kept[KEPT_MAX];
static size_t n_kept, kept_bytes, cap_bytes = (size_t)1 << 30; /* when preloaded by hand without the variable */
static int cap_read;
static size_t stat_hits, stat_maps;

static size_t rounded(size_t n) {
    size_t unit = n >= 16 * HUGE ? HUGE : ((size_t)64 << 10);
    return (n + unit - 1) / unit * unit;
}

static unsigned slot_of(uintptr_t p) { return (unsigned)((p >> 12) * 0x9E3779B97F4A7C15ull >> 48) & (SLOTS - 1); }

/* The table of live blocks (open addressing, linear probes, never more than 3/4 full), under `lock`. */
static unsigned n_live;

static int table_put(void *ptr, size_t size) {
    if (n_live >= SLOTS / 4 * 3) return 0;
    unsigned i = slot_of((uintptr_t)ptr);
    while (slot_ptr[i]) i = (i + 1) & (SLOTS - 1);
    slot_ptr[i] = (uintptr_t)ptr; slot_size[i] = size; n_live++;
    return 1;
}

static unsigned table_find(const void *ptr) { /* the slot of `ptr`, or SLOTS */
    unsigned i = slot_of((uintptr_t)ptr);
    for (; slot_ptr[i]; i = (i + 1) & (SLOTS - 1))
        if (slot_ptr[i] == (uintptr_t)ptr) return i;
    return SLOTS;
}

static size_t table_size(const void *ptr) {
    unsigned i = table_find(ptr);
    return i == SLOTS ? 0 : slot_size[i];
}

static size_t table_take(const void *ptr) { /* the block's size, removed from the table; 0 if not one of these */
    unsigned i = table_find(ptr);
    if (i == SLOTS) return 0;
    size_t size = slot_size[i];
    /* backward-shift deletion: an entry after the hole moves into it unless its home lies in (hole, entry] */
    for (unsigned j = i;;) {
        j = (j + 1) & (SLOTS - 1);
        if (!slot_ptr[j]) break;
        unsigned home = slot_of(slot_ptr[j]);
        if (i < j ? (i < home && home <= j) : (i < home || home <= j)) continue;
        slot_ptr[i] = slot_ptr[j]; slot_size[i] = slot_size[j]; i = j;
    }
    slot_ptr[i] = 0; n_live--;
    return size;
}

static void read_cap(void) {
    const char *s = getenv("ANGEL_JAX_BLOCK_CACHE");
    if (s && *s) cap_bytes = strtoull(s, NULL, 10);
    cap_read = 1;
}

static void *large_alloc(size_t n) {
    size_t size = rounded(n);
    void *p = NULL;
    pthread_mutex_lock(&lock);
    if (!cap_read) read_cap();
    for (size_t k = n_kept; k-- > 0;) /* the newest kept block of this size: its pages are the warmest */
        if (kept[k].size == size) {
            p = kept[k].ptr;
            memmove(&kept[k], &kept[k + 1], (n_kept - k - 1) * sizeof kept[0]);
            n_kept--; kept_bytes -= size; stat_hits++;
            break;
        }
    pthread_mutex_unlock(&lock);
    if (!p) {
        p = mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
        if (p == MAP_FAILED) { errno = ENOMEM; return NULL; }
        if (size >= HUGE) madvise(p, size, MADV_HUGEPAGE);
        __atomic_add_fetch(&stat_maps, 1, __ATOMIC_RELAXED);
    }
    pthread_mutex_lock(&lock);
    int ok = table_put(p, size);
    pthread_mutex_unlock(&lock);
    if (!ok) { munmap(p, size); errno = ENOMEM; return NULL; }
    return p;
}

static int large_free(void *p) { /* 1 if `p` was one of these blocks (kept, or unmapped now) */
    pthread_mutex_lock(&lock);
    size_t size = table_take(p);
    if (!size) { pthread_mutex_unlock(&lock); return 0; }
    if (size > cap_bytes) { pthread_mutex_unlock(&lock); munmap(p, size); return 1; }
    while (n_kept && (kept_bytes + size > cap_bytes || n_kept == KEPT_MAX)) { /* the oldest go first */
        void *old = kept[0].ptr;
        size_t old_size = kept[0].size;
        kept_bytes -= old_size;
        memmove(&kept[0], &kept[1], (n_kept - 1) * sizeof kept[0]);
        n_kept--;
        pthread_mutex_unlock(&lock);
        munmap(old, old_size);
        pthread_mutex_lock(&lock);
    }
    kept[n_kept].ptr = p; kept[n_kept].size = size; n_kept++; kept_bytes += size;
    pthread_mutex_unlock(&lock);
    return 1;
}

void *malloc(size_t n) { return n >= LARGE ? large_alloc(n) : __libc_malloc(n); }

void free(void *p) {
    if (p && !large_free(p)) __libc_free(p);
}

void *calloc(size_t count, size_t n) {
    size_t total;
    if (__builtin_mul_overflow(count, n, &total)) { errno = ENOMEM; return NULL; }
    if (total < LARGE) return __libc_calloc(count, n);
    void *p = large_alloc(total);
    if (p) memset(p, 0, total);
    return p;
}

void *realloc(void *p, size_t n) {
    if (!p) return malloc(n);
    pthread_mutex_lock(&lock);
    size_t size = table_size(p);
    pthread_mutex_unlock(&lock);
    if (!size) return __libc_realloc(p, n); /* glibc's block stays glibc's, whatever its new size */
    if (n == 0) { free(p); return NULL; }
    if (n <= size && n >= size / 2) return p;
    void *q = malloc(n);
    if (!q) return NULL;
    memcpy(q, p, n < size ? n : size);
    free(p);
    return q;
}

static void *aligned(size_t alignment, size_t n) {
    if (n >= LARGE && alignment <= 4096) return large_alloc(n); /* mmap'ed: page-aligned */
    return __libc_memalign(alignment, n);
}

int posix_memalign(void **out, size_t alignment, size_t n) {
    if (alignment < sizeof(void *) || (alignment & (alignment - 1))) return EINVAL;
    void *p = aligned(alignment, n);
    if (!p) return ENOMEM;
    *out = p;
    return 0;
}

void *aligned_alloc(size_t alignment, size_t n) { return aligned(alignment, n); }
void *memalign(size_t alignment, size_t n) { return aligned(alignment, n); }
void *valloc(size_t n) { return aligned(4096, n); }
void *pvalloc(size_t n) { return aligned(4096, (n + 4095) / 4096 * 4096); }

size_t malloc_usable_size(void *p) {
    static size_t (*next)(void *);
    if (!p) return 0;
    pthread_mutex_lock(&lock);
    size_t size = table_size(p);
    pthread_mutex_unlock(&lock);
    if (size) return size;
    if (!next) next = (size_t (*)(void *))dlsym(RTLD_NEXT, "malloc_usable_size");
    return next ? next(p) : 0;
}

static void before_fork(void) { pthread_mutex_lock(&lock); }
static void after_fork(void) { pthread_mutex_unlock(&lock); }

__attribute__((constructor)) static void init(void) {
    pthread_atfork(before_fork, after_fork, after_fork); /* a child never inherits the mutex held */
}

/* For the Python side's report (ctypes): blocks handed out again, blocks mapped, bytes kept now. */
void angel_block_cache_stats(size_t out[3]) {
    pthread_mutex_lock(&lock);
    out[0] = stat_hits; out[1] = stat_maps; out[2] = kept_bytes;
    pthread_mutex_unlock(&lock);
}
