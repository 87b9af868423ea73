/* The jepsen bed's wall-clock step for the Redis hosts, an LD_PRELOAD library: CLOCK_REALTIME,
 * gettimeofday and time are shifted by the whole seconds written in the file CLOCKSHIFT_FILE
 * ("+0", "-60"), re-read at most once a second; monotonic clocks are untouched.
 * Why not libfaketime (used for the workers): Debian's redis-server and valkey-server never
 * start under it; their jemalloc asks clock_gettime for the time before libfaketime has set
 * itself up ("Unexpected recursive calls to clock_gettime() without proper initialization").
 * This library calls only raw system calls: no allocation, no dlsym, nothing to recurse into.
 * Built by run.sh with the machine's cc into the bed's temp dir. */
#define _GNU_SOURCE
#include <fcntl.h>
#include <stdlib.h>
#include <sys/syscall.h>
#include <sys/time.h>
#include <time.h>
#include <unistd.h>

static long long shift_s;
static long long read_at = -1000; /* monotonic second of the last read */

static int raw_clock(clockid_t c, struct timespec *ts) {
    return (int)syscall(SYS_clock_gettime, c, ts);
}

static long long shift(void) {
    struct timespec m;
    raw_clock(CLOCK_MONOTONIC, &m);
    if (m.tv_sec - __atomic_load_n(&read_at, __ATOMIC_RELAXED) >= 1) {
        __atomic_store_n(&read_at, m.tv_sec, __ATOMIC_RELAXED);
        const char *path = getenv("CLOCKSHIFT_FILE");
        int fd = path ? (int)syscall(SYS_openat, AT_FDCWD, path, O_RDONLY) : -1;
        if (fd >= 0) {
            char buf[32];
            long n = syscall(SYS_read, fd, buf, sizeof buf - 1);
            syscall(SYS_close, fd);
            if (n > 0) {
                buf[n] = 0;
                __atomic_store_n(&shift_s, strtoll(buf, 0, 10), __ATOMIC_RELAXED);
            }
        }
    }
    return __atomic_load_n(&shift_s, __ATOMIC_RELAXED);
}

int clock_gettime(clockid_t c, struct timespec *ts) {
    if (raw_clock(c, ts) != 0)
        return -1;
    if (c == CLOCK_REALTIME || c == CLOCK_REALTIME_COARSE)
        ts->tv_sec += shift();
    return 0;
}

int gettimeofday(struct timeval *restrict tv, void *restrict tz) {
    struct timespec ts;
    (void)tz;
    if (clock_gettime(CLOCK_REALTIME, &ts) != 0)
        return -1;
    tv->tv_sec = ts.tv_sec;
    tv->tv_usec = ts.tv_nsec / 1000;
    return 0;
}

time_t time(time_t *t) {
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    if (t)
        *t = ts.tv_sec;
    return ts.tv_sec;
}
