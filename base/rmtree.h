/*
 * rmtree.h - removing a directory tree: the one walk that every part deleting what it made
 * uses (VM and snapshot directories, template versions, image scratch, a build's work dir).
 *
 * It never follows a symbolic link (the link itself goes) and never crosses into another
 * filesystem (a mount point below path stays, with what is mounted there). Blocking: a tree
 * holding a RAM file of a GiB takes 55-135 ms to unlink on ext4 here, so the event loop
 * discards instead (loop/discard.h), and this runs on its worker.
 */
#ifndef SP_BASE_RMTREE_H
#define SP_BASE_RMTREE_H

/* Removes path and everything under it; a path that is not there is fine. Each entry that
 * cannot go is logged (warn) and skipped: the rest still goes. 0 when path is gone after,
 * -1 otherwise. */
int sp_rm_rf(const char *path);

#endif
