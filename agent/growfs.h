/*
 * growfs.h - the root filesystem grown to fill its disk, online (`space-agent --grow-root`).
 *
 * A template build asked for a larger disk grows the builder's disk from the host (the
 * runtime's grow_disk) and then runs this in the guest, as root: ext4's own online resize
 * (the EXT4_IOC_RESIZE_FS ioctl, what resize2fs uses on a mounted filesystem), so it works
 * in any image, with or without e2fsprogs. Only ext4 on a whole disk (the runtime's root
 * disks) is taken.
 */
#ifndef SP_AGENT_GROWFS_H
#define SP_AGENT_GROWFS_H

#include <stdint.h>

#include "base/err.h"

/* Grows the filesystem mounted at path to the size of the block device it is on: its
 * blocks before and after into *from and *to (equal when there was nothing to grow). -1
 * with err: not ext4, the device's size unreadable, or the kernel refused. */
int sp_agent_grow_fs(const char *path, uint64_t *from, uint64_t *to, sp_err_t *err);

#endif
