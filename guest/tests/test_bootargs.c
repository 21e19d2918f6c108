/*
 * test_bootargs.c - the kernel command line and QEMU argv builder.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "guest/bootargs.h"
#include "tests/check.h"

static int has(char **av, const char *a, const char *b)
{
    for (int i = 0; av[i] != NULL; i++)
        if (strcmp(av[i], a) == 0 &&
            (b == NULL || (av[i + 1] != NULL && strcmp(av[i + 1], b) == 0)))
            return 1;
    return 0;
}

static void test_bootargs_cmdline(void)
{
    char buf[256];
    CHECK(sp_bootargs_cmdline(buf, sizeof buf, 2600000, NULL) == 0);
    CHECK(strcmp(buf, SP_BOOTARGS_CMDLINE " tsc_early_khz=2600000") == 0);
    CHECK(sp_bootargs_cmdline(buf, sizeof buf, 0, "sp.x=1") == 0);
    CHECK(strcmp(buf, SP_BOOTARGS_CMDLINE " sp.x=1") == 0);
    CHECK(sp_bootargs_cmdline(buf, 10, 1, NULL) < 0);
}

static void test_bootargs_qemu_tcg(void)
{
    sp_bootargs_qemu_t q = {.kernel = "/k/vmlinux",
                            .initramfs = "/k/i.img",
                            .disk = "/v/d.qcow2",
                            .agent_sock = "/v/agent.sock",
                            .qmp_sock = "/v/qmp.sock",
                            .console_log = "/v/console.log",
                            .tsc_khz = 1234567};
    char **av = sp_bootargs_qemu_argv(&q);
    CHECK(av != NULL);
    if (av == NULL)
        return;
    CHECK(strcmp(av[0], "qemu-system-x86_64") == 0);
    CHECK(has(av, "-accel", "tcg,tb-size=256") && has(av, "-cpu", "max") && !has(av, "-enable-kvm", NULL));
    CHECK(has(av, "-M", "microvm,x-option-roms=off,pit=on,pic=on,rtc=on,isa-serial=on"));
    CHECK(has(av, "-m", "256") && has(av, "-smp", "1") && has(av, "-no-reboot", NULL));
    CHECK(has(av, "-kernel", "/k/vmlinux") && has(av, "-initrd", "/k/i.img"));
    CHECK(has(av, "-append", SP_BOOTARGS_CMDLINE " tsc_early_khz=1234567 norandmaps"));
    CHECK(has(av, "-chardev", "socket,id=agent,path=/v/agent.sock,server=on,wait=off"));
    CHECK(has(av, "-device", "virtserialport,bus=vser0.0,chardev=agent,name=space.agent"));
    CHECK(has(av, "-qmp", "unix:/v/qmp.sock,server=on,wait=off"));
    CHECK(has(av, "-serial", "file:/v/console.log"));
    CHECK(has(av, "-drive",
              "id=root,file=/v/d.qcow2,format=qcow2,if=none,cache=writeback,discard=unmap"));
    free(av);

    q.kvm = 1;
    q.memory_mb = 512;
    q.cpu_count = 2;
    av = sp_bootargs_qemu_argv(&q);
    CHECK(av != NULL && has(av, "-enable-kvm", NULL) && has(av, "-cpu", "host,-arch-capabilities"));
    CHECK(av != NULL && has(av, "-m", "512") && has(av, "-smp", "2"));
    /* randomization stays on under KVM; an extra follows the TCG words */
    CHECK(av != NULL && has(av, "-append", SP_BOOTARGS_CMDLINE " tsc_early_khz=1234567"));
    free(av);
    q.kvm = 0;
    q.cmdline_extra = "sp.x=1";
    av = sp_bootargs_qemu_argv(&q);
    CHECK(av != NULL &&
          has(av, "-append", SP_BOOTARGS_CMDLINE " tsc_early_khz=1234567 norandmaps sp.x=1"));
    free(av);
    q.cmdline_extra = NULL;

    q.disk = NULL;
    CHECK(sp_bootargs_qemu_argv(&q) == NULL);
}

static void test_bootargs_tsc_khz_plausible(void)
{
    unsigned khz = sp_bootargs_tsc_khz();
#if defined(__x86_64__)
    CHECK(khz >= 100000 && khz <= 10000000);
#endif
    CHECK(sp_bootargs_tsc_khz() == khz); /* cached */
}

int main(void)
{
    test_bootargs_cmdline();
    test_bootargs_qemu_tcg();
    test_bootargs_tsc_khz_plausible();
    return check_report("bootargs");
}
