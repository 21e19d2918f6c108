/*
 * ociref.c - an image reference read (ociimg.h: sp_ociimg_parse_ref), apart from the pulls in
 * ociimg.c: pure, so the body fuzzer (tests/fuzz_bodies.c) links it alone.
 */
#include "core/control/ociimg.h"

#include <ctype.h>
#include <stdio.h>
#include <string.h>

/* ---- the reference ---- */

static bool all_of(const char *s, size_t n, const char *extra)
{
    for (size_t i = 0; i < n; i++) {
        unsigned char c = (unsigned char)s[i];
        if (!(isalnum(c) || (c != '\0' && strchr(extra, c) != NULL)))
            return false;
    }
    return true;
}

int sp_ociimg_parse_ref(const char *ref, const char *mirror, sp_ociimg_ref_t *out, sp_err_t *err)
{
    memset(out, 0, sizeof(*out));
    if (ref == NULL)
        return sp_err_set(err, SP_EINVAL, "image: a reference is required");
    if (strncmp(ref, "docker://", 9) == 0)
        ref += 9;
    size_t n = strlen(ref);
    if (n == 0 || n > 500 || ref[0] == '-' || ref[0] == '/')
        return sp_err_set(err, SP_EINVAL, "image: '%.100s' is not an image reference", ref);
    char s[512];
    memcpy(s, ref, n + 1);
    char *at = strchr(s, '@');
    if (at != NULL) {
        *at = '\0';
        const char *d = at + 1;
        if (strncmp(d, "sha256:", 7) != 0 || strlen(d) != 71 || !all_of(d + 7, 64, ""))
            return sp_err_set(err, SP_EINVAL, "image: the digest must be sha256:<64 hex>");
        for (const char *p = d + 7; *p; p++)
            if (isupper((unsigned char)*p))
                return sp_err_set(err, SP_EINVAL, "image: the digest must be lowercase hex");
        snprintf(out->digest, sizeof out->digest, "%s", d);
    }
    char *name = s;
    char *slash = strchr(s, '/');
    if (slash != NULL && (memchr(s, '.', (size_t)(slash - s)) != NULL ||
                          memchr(s, ':', (size_t)(slash - s)) != NULL ||
                          (slash - s == 9 && strncmp(s, "localhost", 9) == 0))) {
        *slash = '\0';
        if (strlen(s) >= sizeof out->registry || !all_of(s, strlen(s), ".-:[]"))
            return sp_err_set(err, SP_EINVAL, "image: bad registry '%.100s'", s);
        snprintf(out->registry, sizeof out->registry, "%.255s", s);
        name = slash + 1;
    } else {
        snprintf(out->registry, sizeof out->registry, "docker.io");
    }
    if (strcmp(out->registry, "index.docker.io") == 0 ||
        strcmp(out->registry, "registry-1.docker.io") == 0)
        snprintf(out->registry, sizeof out->registry, "docker.io");
    char *colon = strrchr(name, ':');
    if (colon != NULL && strchr(colon, '/') == NULL) {
        *colon = '\0';
        const char *tag = colon + 1;
        if (tag[0] == '\0' || strlen(tag) > 128 || !all_of(tag, strlen(tag), "_.-") ||
            tag[0] == '.' || tag[0] == '-')
            return sp_err_set(err, SP_EINVAL, "image: bad tag '%.130s'", tag);
        if (out->digest[0] == '\0')
            snprintf(out->tag, sizeof out->tag, "%s", tag);
    } else if (out->digest[0] == '\0') {
        snprintf(out->tag, sizeof out->tag, "latest");
    }
    size_t nl = strlen(name);
    bool lib = strcmp(out->registry, "docker.io") == 0 && strchr(name, '/') == NULL;
    if (nl == 0 || nl + (lib ? 8 : 0) >= sizeof out->repo || !all_of(name, nl, "._/-") ||
        name[0] == '/' || name[nl - 1] == '/' || strstr(name, "//") != NULL ||
        strstr(name, "..") != NULL)
        return sp_err_set(err, SP_EINVAL, "image: bad repository name '%.100s'", name);
    for (const char *p = name; *p; p++)
        if (isupper((unsigned char)*p))
            return sp_err_set(err, SP_EINVAL, "image: repository names are lowercase ('%.100s')",
                              name);
    snprintf(out->repo, sizeof out->repo, "%s%.240s", lib ? "library/" : "", name);
    if (strcmp(out->registry, "docker.io") == 0 && mirror != NULL && mirror[0] != '\0') {
        snprintf(out->registry, sizeof out->registry, "%.255s", mirror);
        out->mirrored = true;
    }
    return 0;
}
