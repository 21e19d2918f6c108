/*
 * bootargs.h - the one place that says how a space guest is booted: the
 * kernel command line and the QEMU microvm arguments that are known to work
 * (RUNTIME-NOTES.md), for the runtime driver and the boot test alike.
 *
 * Pure string building plus one host probe (the TSC rate); starts nothing.
 */
#ifndef SP_BOOTARGS_H
#define SP_BOOTARGS_H

#include <stddef.h>

/* Name of the virtio-serial port the agent listens on; the guest finds it in
 * /sys/class/virtio-ports/<port>/name. */
#define SP_BOOTARGS_AGENT_PORT "space.agent"

/* Kernel command line without tsc_early_khz. reboot=t + panic=-1 with QEMU's
 * -no-reboot make any guest panic (including the initramfs failing) end the
 * QEMU process instead of hanging. tsc=reliable: under TCG the guest TSC is
 * the host's (constant, synchronized) but the clocksource watchdog compares
 * it with jiffies counted from timer ticks that TCG delivers late on a busy
 * host; it then marked the TSC unstable ~2 s after boot and left the guest
 * on refined-jiffies (4 ms resolution). root= is read by the initramfs /init
 * (the kernel itself never mounts it: the initramfs has /init). */
#define SP_BOOTARGS_CMDLINE "console=ttyS0 reboot=t panic=-1 quiet tsc=reliable root=/dev/vda"

/* Added to the kernel command line under TCG: no address-space randomization for the
 * guest's processes. TCG finds the code it translated before by the guest's virtual
 * address, so with randomization every process maps its libraries somewhere new and has
 * them translated afresh: measured here, a command of `true` took 32 ms with it and 9 ms
 * without, ten execs in one shell 344 ms and 51 ms. Randomization hardens the guest's own
 * processes against attacks on them, not the host; a sandbox that wants it back sets
 * kernel.randomize_va_space=2 as root. Under KVM the guest keeps it. */
#define SP_BOOTARGS_TCG_CMDLINE "norandmaps"

/* The host TSC rate in kHz, which is also the guest's under TCG (QEMU's
 * rdtsc reads the host TSC). Passed as tsc_early_khz= because under TCG TSC
 * calibration hangs about 1 boot in 3 on a busy host. Source, in order:
 * /sys/devices/system/cpu/cpu0/tsc_freq_khz when the kernel exposes it; else
 * rdtsc measured against CLOCK_MONOTONIC_RAW over 50 ms (first call only,
 * then cached); else "cpu MHz" of /proc/cpuinfo. 0 if all fail. */
unsigned sp_bootargs_tsc_khz(void);

/* SP_BOOTARGS_CMDLINE + " tsc_early_khz=<tsc_khz>" (omitted when 0) + " " +
 * extra (may be NULL). -1 if it does not fit in n. */
int sp_bootargs_cmdline(char *buf, size_t n, unsigned tsc_khz, const char *extra);

typedef struct {
    const char *qemu;   /* binary; NULL: "qemu-system-x86_64" from PATH */
    const char *kernel; /* vmlinux (ELF with PVH note) */
    const char *initramfs;
    const char *disk;          /* the sandbox's qcow2 overlay over the template base */
    const char *agent_sock;    /* unix socket QEMU listens on for the agent port */
    const char *qmp_sock;      /* unix socket QEMU listens on for QMP; NULL: none */
    const char *console_log;   /* file for the serial console; NULL: stdio */
    int cpu_count;             /* 0: 1 */
    int memory_mb;             /* 0: 256 */
    int kvm;                   /* 1: hardware KVM flags; 0: TCG (these machines) */
    unsigned tsc_khz;          /* 0: sp_bootargs_tsc_khz() */
    const char *cmdline_extra; /* appended to the kernel command line (after
                                * SP_BOOTARGS_TCG_CMDLINE under TCG), or NULL */
} sp_bootargs_qemu_t;

/* The full QEMU argv (argv[0] is the binary), NULL-terminated, in one
 * malloc'd block: free(argv) frees all. NULL on a missing field or no memory.
 * Callers may copy it into a longer argv to add -incoming, memory backends. */
char **sp_bootargs_qemu_argv(const sp_bootargs_qemu_t *q);

#endif
