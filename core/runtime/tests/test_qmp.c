/*
 * test_qmp.c - the QMP client against a fake QEMU on a socketpair.
 *
 * The fake end is driven by hand from the test: it writes the greeting,
 * reads what the client sends (pumping the loop until a full line arrives)
 * and answers, out of order, with errors, with events, or dies.
 */
#include <assert.h>
#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include "loop/loop.h"
#include "core/runtime/qmp.h"
#include "tests/check.h"

static sp_loop_t *loop;

struct rec {
    int ready;
    int closed;
    int events;
    char last_event[64];
    sp_qmp_t *destroy_on_reply;
};

struct reply {
    int called;
    int ok;
    sp_code_t code;
    char msg[160];
    char ret[256];
    struct rec *rec;
};

static void on_ready(sp_qmp_t *q, void *arg)
{
    ((struct rec *)arg)->ready++;
}

static void on_event(sp_qmp_t *q, const char *ev, json_t *data, void *arg)
{
    struct rec *r = arg;
    r->events++;
    snprintf(r->last_event, sizeof r->last_event, "%s", ev);
}

static void on_closed(sp_qmp_t *q, const sp_err_t *err, void *arg)
{
    ((struct rec *)arg)->closed++;
}

static const sp_qmp_cbs_t cbs = {on_ready, on_event, on_closed};

static void on_reply(void *arg, json_t *ret, const sp_err_t *err)
{
    struct reply *r = arg;
    r->called++;
    r->ok = err == NULL;
    if (err != NULL) {
        r->code = err->code;
        snprintf(r->msg, sizeof r->msg, "%s", err->msg);
    } else {
        char *s = json_dumps(ret, JSON_COMPACT | JSON_ENCODE_ANY);
        snprintf(r->ret, sizeof r->ret, "%s", s ? s : "");
        free(s);
    }
    if (r->rec != NULL && r->rec->destroy_on_reply != NULL) {
        sp_qmp_destroy(r->rec->destroy_on_reply);
        r->rec->destroy_on_reply = NULL;
    }
}

static void pump(int n)
{
    for (int i = 0; i < n; i++)
        sp_loop_run_once(loop, 5);
}

/* The fake QEMU's side: reads one line (pumping the loop meanwhile). */
static char fbuf[65536];
static size_t flen;

static json_t *fake_read(int fd, int *passed_fd)
{
    for (int tries = 0; tries < 400; tries++) {
        char *nl = memchr(fbuf, '\n', flen);
        if (nl != NULL) {
            size_t l = (size_t)(nl - fbuf);
            json_t *j = json_loadb(fbuf, l, 0, NULL);
            memmove(fbuf, nl + 1, flen - l - 1);
            flen -= l + 1;
            return j;
        }
        pump(1);
        char ctl[CMSG_SPACE(sizeof(int))];
        struct iovec iov = {fbuf + flen, sizeof fbuf - flen};
        struct msghdr mh = {
            .msg_iov = &iov, .msg_iovlen = 1, .msg_control = ctl, .msg_controllen = sizeof ctl};
        ssize_t n = recvmsg(fd, &mh, MSG_DONTWAIT);
        if (n > 0) {
            flen += (size_t)n;
            struct cmsghdr *cm = CMSG_FIRSTHDR(&mh);
            if (cm != NULL && cm->cmsg_type == SCM_RIGHTS && passed_fd != NULL)
                memcpy(passed_fd, CMSG_DATA(cm), sizeof(int));
        }
    }
    return NULL;
}

static void fake_write(int fd, const char *s)
{
    size_t l = strlen(s);
    REQUIRE(write(fd, s, l) == (ssize_t)l);
}

static const char *greeting =
    "{\"QMP\": {\"version\": {\"qemu\": {\"micro\": 0, \"minor\": 2, \"major\": 7}}, "
    "\"capabilities\": [\"oob\"]}}\r\n";

static sp_qmp_t *setup(int sv[2], struct rec *rec)
{
    REQUIRE(socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv) == 0);
    sp_err_t e;
    sp_qmp_t *q = sp_qmp_create(loop, sv[0], &cbs, rec, &e);
    REQUIRE(q != NULL);
    flen = 0;
    return q;
}

/* Greeting, negotiation, a command queued before negotiation, replies matched by id. */
static void test_qmp_negotiate_and_match(void)
{
    int sv[2];
    struct rec rec = {0};
    sp_qmp_t *q = setup(sv, &rec);
    struct reply a = {0}, b = {0};
    sp_err_t e;
    REQUIRE(sp_qmp_command(q, "query-status", NULL, -1, on_reply, &a, &e) == 0);
    REQUIRE(sp_qmp_command(q, "query-name", json_pack("{s:i}", "x", 1), -1, on_reply, &b, &e) == 0);
    REQUIRE(a.called == 0); /* never inside the call */
    pump(3);
    /* nothing may be sent before the greeting */
    char tmp[16];
    REQUIRE(recv(sv[1], tmp, sizeof tmp, MSG_DONTWAIT) < 0 && errno == EAGAIN);
    fake_write(sv[1], greeting);
    json_t *m = fake_read(sv[1], NULL);
    REQUIRE(m != NULL);
    REQUIRE(strcmp(json_string_value(json_object_get(m, "execute")), "qmp_capabilities") == 0);
    json_int_t cid = json_integer_value(json_object_get(m, "id"));
    json_decref(m);
    pump(3);
    REQUIRE(recv(sv[1], tmp, sizeof tmp, MSG_DONTWAIT | MSG_PEEK) < 0); /* held until negotiated */
    char line[256];
    snprintf(line, sizeof line, "{\"return\": {}, \"id\": %lld}\r\n", (long long)cid);
    fake_write(sv[1], line);
    json_t *m1 = fake_read(sv[1], NULL);
    json_t *m2 = fake_read(sv[1], NULL);
    REQUIRE(rec.ready == 1);
    REQUIRE(m1 && m2);
    REQUIRE(strcmp(json_string_value(json_object_get(m1, "execute")), "query-status") == 0);
    REQUIRE(strcmp(json_string_value(json_object_get(m2, "execute")), "query-name") == 0);
    REQUIRE(json_integer_value(json_object_get(json_object_get(m2, "arguments"), "x")) == 1);
    json_int_t id1 = json_integer_value(json_object_get(m1, "id"));
    json_int_t id2 = json_integer_value(json_object_get(m2, "id"));
    json_decref(m1);
    json_decref(m2);
    /* answer the second first, with an event in between */
    snprintf(line, sizeof line,
             "{\"return\": {\"name\": \"vm\"}, \"id\": %lld}\r\n"
             "{\"timestamp\": {\"seconds\": 1, \"microseconds\": 2}, \"event\": \"STOP\"}\r\n"
             "{\"return\": {\"status\": \"running\", \"running\": true}, \"id\": %lld}\r\n",
             (long long)id2, (long long)id1);
    fake_write(sv[1], line);
    for (int i = 0; i < 50 && !(a.called && b.called); i++)
        pump(1);
    REQUIRE(a.called == 1 && a.ok && strstr(a.ret, "\"running\"") != NULL);
    REQUIRE(b.called == 1 && b.ok && strstr(b.ret, "\"vm\"") != NULL);
    REQUIRE(rec.events == 1 && strcmp(rec.last_event, "STOP") == 0);
    REQUIRE(rec.closed == 0);
    sp_qmp_destroy(q);
    close(sv[1]);
}

static sp_qmp_t *negotiated(int sv[2], struct rec *rec)
{
    sp_qmp_t *q = setup(sv, rec);
    fake_write(sv[1], greeting);
    json_t *m = fake_read(sv[1], NULL);
    REQUIRE(m != NULL);
    char line[128];
    snprintf(line, sizeof line, "{\"return\": {}, \"id\": %lld}\n",
             (long long)json_integer_value(json_object_get(m, "id")));
    json_decref(m);
    fake_write(sv[1], line);
    for (int i = 0; i < 50 && !rec->ready; i++)
        pump(1);
    REQUIRE(rec->ready == 1);
    return q;
}

static void test_qmp_error_reply(void)
{
    int sv[2];
    struct rec rec = {0};
    sp_qmp_t *q = negotiated(sv, &rec);
    struct reply a = {0};
    sp_err_t e;
    REQUIRE(sp_qmp_command(q, "bogus", NULL, -1, on_reply, &a, &e) == 0);
    json_t *m = fake_read(sv[1], NULL);
    REQUIRE(m != NULL);
    char line[256];
    snprintf(line, sizeof line,
             "{\"error\": {\"class\": \"CommandNotFound\", \"desc\": \"The command bogus has "
             "not been found\"}, \"id\": %lld}\r\n",
             (long long)json_integer_value(json_object_get(m, "id")));
    json_decref(m);
    fake_write(sv[1], line);
    for (int i = 0; i < 50 && !a.called; i++)
        pump(1);
    REQUIRE(a.called == 1 && !a.ok && a.code == SP_ERUNTIME);
    REQUIRE(strstr(a.msg, "bogus has not been found") != NULL);
    sp_qmp_destroy(q);
    close(sv[1]);
}

static void test_qmp_fd_passing(void)
{
    int sv[2];
    struct rec rec = {0};
    sp_qmp_t *q = negotiated(sv, &rec);
    int p[2];
    REQUIRE(pipe(p) == 0);
    struct reply a = {0};
    sp_err_t e;
    REQUIRE(sp_qmp_command(q, "getfd", json_pack("{s:s}", "fdname", "mig"), p[1], on_reply, &a, &e) ==
          0);
    close(p[1]); /* the client dup'd it */
    int got = -1;
    json_t *m = fake_read(sv[1], &got);
    REQUIRE(m != NULL);
    REQUIRE(got >= 0);
    REQUIRE(write(got, "x", 1) == 1);
    char c = 0;
    REQUIRE(read(p[0], &c, 1) == 1 && c == 'x');
    close(got);
    close(p[0]);
    json_decref(m);
    sp_qmp_destroy(q); /* with a command pending: its callback is dropped */
    pump(2);
    REQUIRE(a.called == 0);
    close(sv[1]);
}

/* QEMU dies with a command in flight: the callback gets an error, then on_closed. */
static void test_qmp_peer_dies_mid_command(void)
{
    int sv[2];
    struct rec rec = {0};
    sp_qmp_t *q = negotiated(sv, &rec);
    struct reply a = {0}, b = {0};
    sp_err_t e;
    REQUIRE(sp_qmp_command(q, "stop", NULL, -1, on_reply, &a, &e) == 0);
    REQUIRE(sp_qmp_command(q, "cont", NULL, -1, on_reply, &b, &e) == 0);
    json_t *m = fake_read(sv[1], NULL);
    json_decref(m);
    close(sv[1]);
    for (int i = 0; i < 50 && !rec.closed; i++)
        pump(1);
    REQUIRE(a.called == 1 && !a.ok && a.code == SP_EUNAVAIL);
    REQUIRE(b.called == 1 && !b.ok && b.code == SP_EUNAVAIL);
    REQUIRE(rec.closed == 1);
    REQUIRE(sp_qmp_closed(q));
    REQUIRE(sp_qmp_command(q, "cont", NULL, -1, on_reply, &b, &e) < 0 && e.code == SP_EUNAVAIL);
    sp_qmp_destroy(q);
}

static void test_qmp_garbage_closes(void)
{
    int sv[2];
    struct rec rec = {0};
    sp_qmp_t *q = negotiated(sv, &rec);
    struct reply a = {0};
    sp_err_t e;
    REQUIRE(sp_qmp_command(q, "stop", NULL, -1, on_reply, &a, &e) == 0);
    fake_write(sv[1], "{\"return\": {}, \"id\": \n\x01\x02 not json\n");
    for (int i = 0; i < 50 && !rec.closed; i++)
        pump(1);
    REQUIRE(rec.closed == 1 && a.called == 1 && !a.ok);
    sp_qmp_destroy(q);
    close(sv[1]);
}

/* The owner may destroy the client from inside a reply callback. */
static void test_qmp_destroy_inside_callback(void)
{
    int sv[2];
    struct rec rec = {0};
    sp_qmp_t *q = negotiated(sv, &rec);
    struct reply a = {.rec = &rec}, b = {0};
    sp_err_t e;
    REQUIRE(sp_qmp_command(q, "stop", NULL, -1, on_reply, &a, &e) == 0);
    REQUIRE(sp_qmp_command(q, "cont", NULL, -1, on_reply, &b, &e) == 0);
    json_t *m1 = fake_read(sv[1], NULL);
    json_t *m2 = fake_read(sv[1], NULL);
    REQUIRE(m1 && m2);
    char line[256];
    snprintf(line, sizeof line, "{\"return\": {}, \"id\": %lld}\n{\"return\": {}, \"id\": %lld}\n",
             (long long)json_integer_value(json_object_get(m1, "id")),
             (long long)json_integer_value(json_object_get(m2, "id")));
    json_decref(m1);
    json_decref(m2);
    rec.destroy_on_reply = q;
    fake_write(sv[1], line);
    for (int i = 0; i < 20 && !a.called; i++)
        pump(1);
    pump(3);
    REQUIRE(a.called == 1 && b.called == 0 && rec.closed == 0);
    close(sv[1]);
}

int main(void)
{
    loop = sp_loop_create();
    REQUIRE(loop != NULL);
    test_qmp_negotiate_and_match();
    test_qmp_error_reply();
    test_qmp_fd_passing();
    test_qmp_peer_dies_mid_command();
    test_qmp_garbage_closes();
    test_qmp_destroy_inside_callback();
    sp_loop_destroy(loop);
    printf("qmp: all tests passed\n");
    return 0;
}
