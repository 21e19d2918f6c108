/*
 * growfs.c - the root filesystem grown to fill its disk (growfs.h).
 *
 * The device is the one the filesystem's st_dev names, its size read from sysfs
 * (/sys/dev/block/MAJ:MIN/size, in 512-byte sectors); the new size in filesystem blocks goes
 * to EXT4_IOC_RESIZE_FS on any file of the filesystem.
 */
#include "agent/growfs.h"

#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <stdbool.h>
#include <stdio.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/stat.h>
#include <sys/statfs.h>
#include <sys/sysmacros.h>
#include <unistd.h>

#define EXT4_MAGIC        0xEF53
#define SP_EXT4_RESIZE_FS _IOW('f', 16, uint64_t) /* EXT4_IOC_RESIZE_FS */

static int read_sectors(dev_t dev, uint64_t *out, sp_err_t *err)
{
    char p[64];
    snprintf(p, sizeof p, "/sys/dev/block/%u:%u/size", major(dev), minor(dev));
    int fd = open(p, O_RDONLY | O_CLOEXEC);
    char buf[32];
    ssize_t n = fd >= 0 ? read(fd, buf, sizeof buf - 1) : -1;
    int saved = errno;
    if (fd >= 0)
        close(fd);
    if (n <= 0)
        return sp_err_set(err, SP_EINTERNAL, "%s: %s", p, n < 0 ? strerror(saved) : "empty");
    buf[n] = '\0';
    if (sscanf(buf, "%" SCNu64, out) != 1)
        return sp_err_set(err, SP_EINTERNAL, "%s: not a number", p);
    return 0;
}

int sp_agent_grow_fs(const char *path, uint64_t *from, uint64_t *to, sp_err_t *err)
{
    int fd = open(path, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (fd < 0)
        return sp_err_set(err, SP_EINTERNAL, "%s: %s", path, strerror(errno));
    struct stat st;
    struct statfs sf;
    uint64_t sectors = 0;
    int rc = -1;
    if (fstat(fd, &st) < 0 || fstatfs(fd, &sf) < 0) {
        sp_err_set(err, SP_EINTERNAL, "%s: %s", path, strerror(errno));
    } else if (sf.f_type != EXT4_MAGIC) {
        sp_err_set(err, SP_EINVAL, "%s is not an ext4 filesystem (type 0x%lx)", path,
                   (unsigned long)sf.f_type);
    } else if (sf.f_bsize <= 0 || read_sectors(st.st_dev, &sectors, err) == 0) {
        uint64_t blocks = sf.f_bsize > 0 ? sectors * 512 / (uint64_t)sf.f_bsize : 0;
        *from = (uint64_t)sf.f_blocks;
        *to = blocks;
        if (blocks == 0)
            sp_err_set(err, SP_EINTERNAL, "%s: no block size", path);
        else if (ioctl(fd, SP_EXT4_RESIZE_FS, &blocks) < 0)
            sp_err_set(err, SP_EINTERNAL, "growing %s to %" PRIu64 " blocks: %s", path, blocks,
                       strerror(errno));
        else
            rc = 0;
        if (rc == 0 && fstatfs(fd, &sf) == 0) /* as statfs counts them, like *from */
            *to = (uint64_t)sf.f_blocks;
    }
    close(fd);
    return rc;
}
