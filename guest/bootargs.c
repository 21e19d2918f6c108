/*
 * bootargs.c - kernel command line and QEMU microvm argv for a space guest.
 *
 * The flags are the measured working set from RUNTIME-NOTES.md. Under TCG
 * microvm needs pit/pic/rtc on (pit=off hangs) and ACPI on (the default:
 * virtio-mmio devices are found through ACPI, the kernel has no
 * VIRTIO_MMIO_CMDLINE_DEVICES). With KVM the legacy devices go off.
 */
#include "guest/bootargs.h"

#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#if defined(__x86_64__) || defined(__i386__)
#include <x86intrin.h>
#endif

static unsigned tsc_from_sysfs(void)
{
    FILE *f = fopen("/sys/devices/system/cpu/cpu0/tsc_freq_khz", "r");
    unsigned khz = 0;
    if (f == NULL)
        return 0;
    if (fscanf(f, "%u", &khz) != 1)
        khz = 0;
    fclose(f);
    return khz;
}

static double mono_raw_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC_RAW, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec / 1e9;
}

static unsigned tsc_measured(void)
{
#if defined(__x86_64__) || defined(__i386__)
    /* Needs a constant-rate TSC (every x86 host QEMU microvm targets has
     * one). Bracket both clocks tightly; 50 ms gives ~0.01 % precision,
     * far better than the kernel needs. */
    struct timespec req = {0, 50 * 1000 * 1000};
    double t0 = mono_raw_s();
    uint64_t c0 = __rdtsc();
    nanosleep(&req, NULL);
    double t1 = mono_raw_s();
    uint64_t c1 = __rdtsc();
    if (t1 <= t0 || c1 <= c0)
        return 0;
    double khz = (double)(c1 - c0) / (t1 - t0) / 1000.0;
    if (khz < 100000.0 || khz > 10000000.0) /* 100 MHz .. 10 GHz, else nonsense */
        return 0;
    return (unsigned)(khz + 0.5);
#else
    return 0;
#endif
}

static unsigned tsc_from_cpuinfo(void)
{
    FILE *f = fopen("/proc/cpuinfo", "r");
    char line[256];
    unsigned khz = 0;
    if (f == NULL)
        return 0;
    while (fgets(line, sizeof line, f) != NULL) {
        double mhz;
        if (strncmp(line, "cpu MHz", 7) == 0 && sscanf(strchr(line, ':') + 1, "%lf", &mhz) == 1) {
            khz = (unsigned)(mhz * 1000.0 + 0.5);
            break;
        }
    }
    fclose(f);
    return khz;
}

unsigned sp_bootargs_tsc_khz(void)
{
    static unsigned cached; /* racy first fill is harmless: same answer */
    if (cached != 0)
        return cached;
    unsigned khz = tsc_from_sysfs();
    if (khz == 0)
        khz = tsc_measured();
    if (khz == 0)
        khz = tsc_from_cpuinfo();
    cached = khz;
    return khz;
}

int sp_bootargs_cmdline(char *buf, size_t n, unsigned tsc_khz, const char *extra)
{
    char tsc[40] = "";
    if (tsc_khz != 0)
        snprintf(tsc, sizeof tsc, " tsc_early_khz=%u", tsc_khz);
    int w = snprintf(buf, n, "%s%s%s%s", SP_BOOTARGS_CMDLINE, tsc,
                     extra != NULL && *extra != '\0' ? " " : "", extra != NULL ? extra : "");
    return w < 0 || (size_t)w >= n ? -1 : 0;
}

/* argv under construction: strings are collected, then packed in one block. */
struct av {
    char *s[64];
    int n;
    int oom;
};

static void add(struct av *a, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void add(struct av *a, const char *fmt, ...)
{
    va_list ap;
    char *s = NULL;
    if (a->oom)
        return;
    va_start(ap, fmt);
    if (a->n >= (int)(sizeof a->s / sizeof a->s[0]) - 1 || vasprintf(&s, fmt, ap) < 0) {
        a->oom = 1;
        s = NULL;
    }
    va_end(ap);
    if (s != NULL)
        a->s[a->n++] = s;
}

char **sp_bootargs_qemu_argv(const sp_bootargs_qemu_t *q)
{
    if (q == NULL || q->kernel == NULL || q->initramfs == NULL || q->disk == NULL ||
        q->agent_sock == NULL)
        return NULL;
    char cmdline[1024], extra[512];
    unsigned tsc = q->tsc_khz != 0 ? q->tsc_khz : sp_bootargs_tsc_khz();
    const char *x = q->cmdline_extra != NULL ? q->cmdline_extra : "";
    int w = snprintf(extra, sizeof extra, "%s%s%s", q->kvm ? "" : SP_BOOTARGS_TCG_CMDLINE,
                     !q->kvm && *x != '\0' ? " " : "", x);
    if (w < 0 || (size_t)w >= sizeof extra ||
        sp_bootargs_cmdline(cmdline, sizeof cmdline, tsc, extra) < 0)
        return NULL;

    struct av a = {.n = 0};
    add(&a, "%s", q->qemu != NULL ? q->qemu : "qemu-system-x86_64");
    if (q->kvm) {
        add(&a, "-M");
        add(&a, "microvm,x-option-roms=off,pit=off,pic=off,rtc=off,isa-serial=on");
        add(&a, "-enable-kvm");
        add(&a, "-cpu");
        add(&a, "host,-arch-capabilities"); /* -cpu host alone aborts on an MSR on some hosts */
    } else {
        add(&a, "-M");
        add(&a, "microvm,x-option-roms=off,pit=on,pic=on,rtc=on,isa-serial=on");
        add(&a, "-accel");
        /* TCG's translation cache defaults to 1 GiB, filled as code is translated: a busy
         * guest would grow QEMU past its cgroup's allowance (core/runtime/qemu/qemu_int.h, 512
         * MiB beyond guest RAM) and be OOM-killed. At the cap QEMU flushes the cache and goes on. */
        add(&a, "tcg,tb-size=256");
        add(&a, "-cpu");
        add(&a, "max");
    }
    add(&a, "-m");
    add(&a, "%d", q->memory_mb > 0 ? q->memory_mb : 256);
    add(&a, "-smp");
    add(&a, "%d", q->cpu_count > 0 ? q->cpu_count : 1);
    add(&a, "-kernel");
    add(&a, "%s", q->kernel);
    add(&a, "-initrd");
    add(&a, "%s", q->initramfs);
    add(&a, "-append");
    add(&a, "%s", cmdline);
    add(&a, "-nodefaults");
    add(&a, "-no-user-config");
    add(&a, "-nographic");
    add(&a, "-no-reboot");
    if (q->qmp_sock != NULL) {
        add(&a, "-qmp");
        add(&a, "unix:%s,server=on,wait=off", q->qmp_sock);
    }
    add(&a, "-serial");
    if (q->console_log != NULL)
        add(&a, "file:%s", q->console_log);
    else
        add(&a, "stdio");
    add(&a, "-device");
    add(&a, "virtio-serial-device,id=vser0");
    add(&a, "-chardev");
    add(&a, "socket,id=agent,path=%s,server=on,wait=off", q->agent_sock);
    add(&a, "-device");
    add(&a, "virtserialport,bus=vser0.0,chardev=agent,name=%s", SP_BOOTARGS_AGENT_PORT);
    add(&a, "-drive");
    add(&a, "id=root,file=%s,format=qcow2,if=none,cache=writeback,discard=unmap", q->disk);
    add(&a, "-device");
    add(&a, "virtio-blk-device,drive=root");

    char **argv = NULL;
    if (!a.oom) {
        size_t bytes = (size_t)(a.n + 1) * sizeof(char *);
        for (int i = 0; i < a.n; i++)
            bytes += strlen(a.s[i]) + 1;
        argv = malloc(bytes);
        if (argv != NULL) {
            char *p = (char *)(argv + a.n + 1);
            for (int i = 0; i < a.n; i++) {
                size_t l = strlen(a.s[i]) + 1;
                memcpy(p, a.s[i], l);
                argv[i] = p;
                p += l;
            }
            argv[a.n] = NULL;
        }
    }
    for (int i = 0; i < a.n; i++)
        free(a.s[i]);
    return argv;
}
