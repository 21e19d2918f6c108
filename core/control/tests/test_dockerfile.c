/*
 * test_dockerfile.c - the Dockerfile subset: every instruction taken, read into the steps and
 * start command a build runs; each refused one with its line number and why.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/control/dockerfile.h"
#include "tests/check.h"

#define CTX "0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef"

static void test_every_instruction(void)
{
    const char *text =
        "# syntax=docker/dockerfile:1\n"
        "ARG VERSION=3\n"
        "FROM base AS build\n"
        "ENV A=1 B=\"two words\" C='single $x'\n"
        "ENV LEGACY value with spaces\n"
        "ARG FLAG=on\n"
        "RUN apt-get update && \\\n"
        "    # a comment inside\n"
        "    echo done\n"
        "RUN [\"/bin/echo\", \"exec form\"]\n"
        "WORKDIR /app\n"
        "WORKDIR sub\n"
        "COPY --chown=user:user --chmod=0755 ./src/ lib/ ./\n"
        "ADD notes.txt /etc/notes\n"
        "USER user:group\n"
        "ENTRYPOINT [\"python3\", \"-m\"]\n"
        "CMD [\"http.server\", \"80 80\"]\n";
    sp_dockerfile_t d;
    sp_err_t e;
    int rc = sp_dockerfile_parse(text, strlen(text), CTX, &d, &e);
    if (rc < 0)
        fprintf(stderr, "%s\n", e.msg);
    CHECK(rc == 0);
    if (rc < 0)
        return;
    CHECK(strcmp(d.parent, "base") == 0);
    char *got = json_dumps(d.steps, JSON_COMPACT | JSON_SORT_KEYS);
    const char *want =
        "[{\"env\":{\"VERSION\":\"3\"}},"
        "{\"env\":{\"A\":\"1\",\"B\":\"two words\",\"C\":\"single $x\"}},"
        "{\"env\":{\"LEGACY\":\"value with spaces\"}},"
        "{\"env\":{\"FLAG\":\"on\"}},"
        "{\"run\":\"apt-get update &&  echo done\"},"
        "{\"run\":[\"/bin/echo\",\"exec form\"]},"
        "{\"workdir\":\"/app\"},{\"workdir\":\"/app/sub\"},"
        "{\"copy\":{\"dest\":\"./\",\"files\":\"" CTX "\",\"mode\":\"0755\",\"src\":\"src/\","
        "\"user\":\"user\"}},"
        "{\"copy\":{\"dest\":\"./\",\"files\":\"" CTX "\",\"mode\":\"0755\",\"src\":\"lib/\","
        "\"user\":\"user\"}},"
        "{\"copy\":{\"dest\":\"/etc/notes\",\"files\":\"" CTX "\",\"src\":\"notes.txt\","
        "\"user\":\"root\"}},"
        "{\"user\":\"user\"}]";
    if (strcmp(got, want) != 0)
        fprintf(stderr, "got  %s\nwant %s\n", got, want);
    CHECK(strcmp(got, want) == 0);
    free(got);
    CHECK(d.start_cmd != NULL && strcmp(d.start_cmd, "'python3' '-m' 'http.server' '80 80'") == 0);
    sp_dockerfile_free(&d);

    /* shell-form ENTRYPOINT wins over CMD; CMD alone in shell form is the line itself */
    const char *t2 = "FROM base\nCMD echo ignored\nENTRYPOINT exec nginx -g 'daemon off;'\n";
    CHECK(sp_dockerfile_parse(t2, strlen(t2), NULL, &d, &e) == 0);
    CHECK(strcmp(d.start_cmd, "exec nginx -g 'daemon off;'") == 0);
    sp_dockerfile_free(&d);
    const char *t3 = "from base\ncmd python3 app.py\n";
    CHECK(sp_dockerfile_parse(t3, strlen(t3), NULL, &d, &e) == 0);
    CHECK(strcmp(d.start_cmd, "python3 app.py") == 0 && json_array_size(d.steps) == 0);
    sp_dockerfile_free(&d);
}

/* FROM a container image: the reference, no parent template; a name alone is a template. */
static void test_from_image(void)
{
    static const char *const refs[] = {
        "python:3.12", "127.0.0.1:5000/img", "docker.io/library/debian",
        ("ghcr.io/org/app@sha256:"
         "0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef")};
    for (size_t i = 0; i < sizeof refs / sizeof refs[0]; i++) {
        char text[300];
        snprintf(text, sizeof text, "FROM %s AS b\nRUN true\n", refs[i]);
        sp_dockerfile_t d;
        sp_err_t e;
        CHECK(sp_dockerfile_parse(text, strlen(text), NULL, &d, &e) == 0);
        CHECK(strcmp(d.image, refs[i]) == 0 && d.parent[0] == '\0');
        CHECK(json_array_size(d.steps) == 1);
        sp_dockerfile_free(&d);
    }
    const char *t = "FROM ubuntu\n";
    sp_dockerfile_t d;
    sp_err_t e;
    CHECK(sp_dockerfile_parse(t, strlen(t), NULL, &d, &e) == 0);
    CHECK(strcmp(d.parent, "ubuntu") == 0 && d.image[0] == '\0');
    sp_dockerfile_free(&d);
}

static void refused(const char *text, const char *context, const char *want)
{
    sp_dockerfile_t d;
    sp_err_t e = {0};
    int rc = sp_dockerfile_parse(text, strlen(text), context, &d, &e);
    if (rc == 0 || strstr(e.msg, want) == NULL)
        fprintf(stderr, "%s -> rc %d '%s' (want '%s')\n", text, rc, e.msg, want);
    CHECK(rc < 0 && e.code == SP_EINVAL && strstr(e.msg, want) != NULL);
    if (rc == 0)
        sp_dockerfile_free(&d);
}

static void test_refused(void)
{
    refused("FROM base\nFROM base AS two\n", NULL, "line 2: a second FROM");
    refused("FROM Python\n", NULL, "line 1: FROM Python: neither a template name nor an image");
    refused("FROM scratch\n", NULL, "FROM scratch");
    refused("RUN true\nFROM base\n", NULL, "line 1: RUN comes before FROM");
    refused("FROM base\nRUN --mount=type=cache,target=/x true\n", NULL, "line 2: RUN options");
    refused("FROM base\n\nHEALTHCHECK CMD true\n", NULL, "line 3: HEALTHCHECK is not supported");
    refused("FROM base\nONBUILD RUN true\n", NULL, "ONBUILD is not supported");
    refused("FROM base\nEXPOSE 80\n", NULL, "EXPOSE is not supported");
    refused("FROM base\nCOPY a /a\n", NULL, "line 2: COPY needs the build context");
    refused("FROM base\nCOPY --from=build /x /x\n", CTX, "multi-stage");
    refused("FROM base\nADD https://example.org/x /x\n", CTX, "remote sources");
    refused("FROM base\nCOPY ../secret /x\n", CTX, "inside the context");
    refused("FROM base\nCOPY a b /dir\n", CTX, "must end with '/'");
    refused("FROM base\nCOPY a b \"\"\n", CTX, "line 2: COPY needs a destination");
    refused("FROM base\nCOPY [\"a\", \"b\", \"\"]\n", CTX, "COPY needs a destination");
    refused("FROM base\nADD [\"a\", \"\"]\n", CTX, "ADD needs a destination");
    refused("FROM base\nENV =bad\n", NULL, "NAME=VALUE");
    refused("FROM base\nRUN echo \\\n", NULL, "ends inside a continued line");
    refused("# only a comment\n", NULL, "no FROM");
    refused("FROM base\nUSER\n", NULL, "USER takes one name");
}

int main(void)
{
    test_every_instruction();
    test_refused();
    test_from_image();
    return check_report("core.dockerfile");
}
