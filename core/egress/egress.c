/*
 * egress.c - the host side of guests' outbound traffic (core/egress/egress.h):
 * the egress object, and one `struct sb` per attached agent channel (policy,
 * team, credential handle, EGRESS_CONFIG), which takes the streams the agent
 * opens and gives them to proxy.c (EGRESS_OPEN) and dns.c (DNS_QUERY). Lookups
 * are resolve.c's, audit rows audit.c's (egress_int.h lists the files).
 *
 * Does not own the agent channels (the runtime driver does: we hear
 * SP_AGENTCONN_GONE), the store, or a mitm handle's connections once handed
 * over (core/egress/mitm.h).
 *
 * Lifetimes: a sb lives from the agentconn hook to GONE, and after GONE until
 * its store query, mitm open or lookups have come back. The egress object
 * outlives sp_egress_destroy while store queries or lookups are in flight;
 * their completions free it.
 */
#include "core/egress/egress.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <unistd.h>

#include "base/log.h"
#include "base/metrics.h"
#include "core/egress/egress_int.h"
#include "core/egress/mitm.h"

#define POLICY_RETRY_MS 1000

/* ---- test hooks ---- */

sp_egress_test_hooks_t sp_egress__hooks;

void sp_egress_set_test_hooks(const sp_egress_test_hooks_t *h)
{
    if (h != NULL)
        sp_egress__hooks = *h;
    else
        memset(&sp_egress__hooks, 0, sizeof(sp_egress__hooks));
}

/* ---- attaching to a sandbox's channel ---- */

static int on_accept(void *arg, sp_agentstream_t *s, uint16_t type, const uint8_t *payload,
                     size_t len, sp_agentstream_cbs_t *cbs, void **sarg)
{
    struct sb *sb = arg;
    if (sb->dead)
        return -1;
    if (type == SP_AP_T_DNS_QUERY)
        return sp_egress__dns_accept(sb, s, payload, len, cbs, sarg);
    if (type != SP_AP_T_EGRESS_OPEN)
        return -1;
    uint32_t kind = 0;
    if (sp_ap_get_u32(payload, len, SP_AP_K_KIND, &kind) < 0 || kind != SP_AP_EGRESS_PROXY)
        return -1;
    return sp_egress__proxy_accept(sb, s, cbs, sarg);
}

static void cfg_frame(sp_agentstream_t *s, uint16_t type, uint16_t flags, const uint8_t *p,
                      size_t len, void *arg)
{
    struct sb *sb = arg;
    if (!(flags & SP_AP_F_END))
        return;
    sb->cfg = NULL;
    if (type == SP_AP_T_OK) {
        /* Connections the agent opens after this OK start with SP_EGRESS_OPEN_WINDOW of credit
         * (the channel keeps order); those before it may have had the whole default. */
        sb->small_window =
            sb->conn != NULL && (sp_agentconn_caps(sb->conn) & SP_AP_CAP_EGRESS_WINDOW);
        sp_log(SP_LOG_DEBUG, "egress", "guest proxy configured sandbox=%s", sb->id);
        return;
    }
    sp_ap_error_t e;
    sp_err_t err;
    char msg[128] = "";
    if (type == SP_AP_T_ERROR && sp_ap_dec_error(p, len, &e, &err) == 0 && e.msg.p != NULL)
        snprintf(msg, sizeof(msg), "%.*s", (int)(e.msg.n > 100 ? 100 : e.msg.n), e.msg.p);
    sp_log(SP_LOG_WARN, "egress", "guest refused the egress config sandbox=%s err=%s", sb->id, msg);
}

static void cfg_error(sp_agentstream_t *s, const sp_err_t *err, void *arg)
{
    struct sb *sb = arg;
    sb->cfg = NULL;
}

static const sp_agentstream_cbs_t cfg_cbs = {cfg_frame, cfg_error, NULL};

static void put_env(void *arg, const char *kv)
{
    sp_ap_put_str(arg, SP_AP_K_ENV, kv);
}

static void sb_send_config(struct sb *sb)
{
    if (sb->conn == NULL || !sp_agentconn_up(sb->conn))
        return;
    if (!(sp_agentconn_caps(sb->conn) & SP_AP_CAP_EGRESS)) {
        sp_log(SP_LOG_INFO, "egress",
               "agent has no egress support sandbox=%s (rebuild the "
               "template); the guest has no way out",
               sb->id);
        return;
    }
    if (sb->cfg != NULL) {
        sp_agentstream_t *old = sb->cfg;
        sb->cfg = NULL;
        sp_agentstream_reset(old);
    }
    sb->small_window = false; /* until the agent says OK to this config */
    uint16_t port =
        sp_egress__hooks.guest_port ? sp_egress__hooks.guest_port : SP_EGRESS_GUEST_PORT;
    char proxy[64];
    snprintf(proxy, sizeof(proxy), "http://127.0.0.1:%u", (unsigned)port);
    uint8_t buf[16384]; /* room for the placeholders of SP_SECRETS_RULES_MAX rules */
    sp_ap_writer_t w;
    sp_ap_writer_init(&w, buf, sizeof(buf));
    sp_ap_put_u32(&w, SP_AP_K_PROXY_PORT, port);
    sp_ap_put_u32(&w, SP_AP_K_DNS, sp_egress__hooks.no_dns ? 0 : 1);
    sp_ap_put_u32(&w, SP_AP_K_WINDOW, SP_EGRESS_OPEN_WINDOW); /* older agents ignore it */
    static const char *const names[] = {"HTTP_PROXY", "HTTPS_PROXY", "http_proxy", "https_proxy"};
    char kv[160];
    for (size_t i = 0; i < 4; i++) {
        snprintf(kv, sizeof(kv), "%s=%s", names[i], proxy);
        sp_ap_put_str(&w, SP_AP_K_ENV, kv);
    }
    sp_ap_put_str(&w, SP_AP_K_ENV, "NO_PROXY=localhost,127.0.0.1,::1");
    sp_ap_put_str(&w, SP_AP_K_ENV, "no_proxy=localhost,127.0.0.1,::1");
    if (sb->eg->mitm != NULL) {
        size_t n = 0;
        const char *const *env = sp_mitm_guest_env(&n);
        for (size_t i = 0; i < n; i++)
            sp_ap_put_str(&w, SP_AP_K_ENV, env[i]);
    }
    /* Credential placeholders (core/egress/mitm.h): names of secrets, never their values. */
    if (sb->mitm != NULL)
        sp_mitm_sb_placeholders(sb->mitm, put_env, &w);
    sp_err_t e;
    if (w.overflow) {
        sp_log(SP_LOG_ERROR, "egress", "egress config too large sandbox=%s", sb->id);
        return;
    }
    sb->cfg = sp_agentconn_open(sb->conn, SP_AP_T_EGRESS_CONFIG, buf, w.len, &cfg_cbs, sb, &e);
    if (sb->cfg == NULL)
        sp_log(SP_LOG_WARN, "egress", "egress config not sent sandbox=%s err=%s", sb->id, e.msg);
}

static void sb_close_all(struct sb *sb)
{
    sp_egress__proxy_close_all(sb);
    sp_egress__dns_close_all(sb);
}

/* The sandboxes the memory limit is shared among (egmem.h): attached, spare clones not
 * counted (their guests reach nothing). */
static void count_sandboxes(sp_egress_t *eg)
{
    unsigned n = 0;
    for (struct sb *x = eg->sbs; x != NULL; x = x->next)
        if (!x->dead && strchr(x->id, ':') == NULL)
            n++;
    bool grew = n < eg->mem.sandboxes; /* the shares grew: credit waiting may fit now */
    eg->mem.sandboxes = n;
    for (struct sb *x = eg->sbs; grew && x != NULL; x = x->next)
        if (x->wq != NULL)
            sp_egress__proxy_mem_kick(x);
}

static void sb_unlink(struct sb *sb)
{
    sp_egress_t *eg = sb->eg;
    if (sb->prev)
        sb->prev->next = sb->next;
    else if (eg->sbs == sb)
        eg->sbs = sb->next;
    if (sb->next)
        sb->next->prev = sb->prev;
    sb->prev = sb->next = NULL;
}

bool sp_egress__sb_ready(const struct sb *sb)
{
    return sb->policy != NULL && !sb->mitm_opening;
}

void sp_egress__sb_maybe_free(struct sb *sb)
{
    if (!sb->dead || sb->loading || sb->mitm_opening || sb->conns != NULL || sb->dnsqs != NULL ||
        sb->resolving > 0)
        return;
    sp_egress__resolve_dispatch(sb); /* only cancelled jobs are left waiting: this frees them */
    sp_timer_stop(&sb->retry);
    sp_egp_free(sb->policy);
    free(sb);
}

static void sb_policy_ready(struct sb *sb)
{
    if (!sp_egress__sb_ready(sb))
        return;
    sp_egress__proxy_policy_ready(sb);
    sp_egress__dns_policy_ready(sb);
}

static void sb_load(struct sb *sb);

static void on_policy(void *arg, PGresult *res, const sp_err_t *err)
{
    struct sb *sb = arg;
    sp_egress_t *eg = sb->eg;
    sb->loading = false;
    eg->inflight--;
    if (eg->dying) {
        sb->dead = true;
        sp_egress__sb_maybe_free(sb);
        sp_egress__maybe_free(eg);
        return;
    }
    if (sb->dead) {
        sp_egress__sb_maybe_free(sb);
        return;
    }
    if (err != NULL) {
        sp_log(SP_LOG_WARN, "egress", "policy load failed sandbox=%s err=%s (retrying)", sb->id,
               err->msg);
        sp_timer_start(&sb->retry, POLICY_RETRY_MS);
        return;
    }
    if (sb->reload) { /* changed while this was in flight: the answer may be the old one */
        sb->reload = false;
        if (PQntuples(res) == 1)
            snprintf(sb->team, sizeof(sb->team), "%s", PQgetvalue(res, 0, 0));
        sb_load(sb);
        return;
    }
    sp_egp_t *p = NULL;
    if (PQntuples(res) != 1) {
        sp_log(SP_LOG_WARN, "egress", "no sandbox row sandbox=%s: everything denied", sb->id);
        p = sp_egp_default();
        if (p != NULL)
            p->internet = false;
    } else {
        snprintf(sb->team, sizeof(sb->team), "%s", PQgetvalue(res, 0, 0));
        const char *js = PQgetvalue(res, 0, 1);
        int aia = atoi(PQgetvalue(res, 0, 2));
        if (js[0] != '\0') {
            json_t *o = json_loads(js, 0, NULL);
            sp_err_t e;
            p = o ? sp_egp_from_json(o, "egress", &e) : NULL;
            json_decref(o);
            if (p == NULL) {
                sp_log(SP_LOG_ERROR, "egress",
                       "stored policy unreadable sandbox=%s: everything "
                       "denied",
                       sb->id);
                p = sp_egp_default();
                if (p != NULL)
                    p->internet = false;
            }
        } else {
            p = sp_egp_default();
            if (p != NULL)
                p->internet = aia != 0; /* E2B allow_internet_access=false */
        }
    }
    if (p == NULL) {
        sp_timer_start(&sb->retry, POLICY_RETRY_MS);
        return;
    }
    sp_egp_free(sb->policy);
    sb->policy = p;
    sp_log(SP_LOG_DEBUG, "egress", "policy loaded sandbox=%s internet=%d allow=%zu deny=%zu",
           sb->id, (int)p->internet, p->nallow, p->ndeny);
    sb_policy_ready(sb);
}

static struct preset *preset_of(const sp_egress_t *eg, const char *id)
{
    for (struct preset *ps = eg->presets; ps != NULL; ps = ps->next)
        if (strcmp(ps->id, id) == 0)
            return ps;
    return NULL;
}

/* A policy that lets nothing out: for VMs without one of their own. */
static sp_egp_t *deny_all(void)
{
    sp_egp_t *p = sp_egp_default();
    if (p != NULL)
        p->internet = false;
    return p;
}

/* p (owned) is sb's policy from now on. */
static void sb_apply(struct sb *sb, sp_egp_t *p)
{
    sp_egp_free(sb->policy);
    sb->policy = p;
    if (sb->loading)
        sb->reload = true; /* a load in flight may hold the old one */
    sb_policy_ready(sb);
}

static void sb_load(struct sb *sb)
{
    sp_egress_t *eg = sb->eg;
    if (sb->loading) {
        sb->reload = true;
        return;
    }
    const struct preset *ps = preset_of(eg, sb->id);
    if (ps != NULL || strchr(sb->id, ':') != NULL) {
        /* its owner's policy (sp_egress_preset); or not a sandbox (a spare clone,
         * core/runtime/qemu/pool.c, until a sandbox takes it): no row to read, nothing goes
         * out */
        sp_err_t e;
        sp_egp_t *p = ps != NULL ? sp_egp_from_json(ps->policy, "egress", &e) : deny_all();
        if (p == NULL) {
            sp_timer_start(&sb->retry, POLICY_RETRY_MS);
            return;
        }
        if (ps != NULL)
            snprintf(sb->team, sizeof(sb->team), "%s", ps->team);
        sb_apply(sb, p);
        return;
    }
    const char *p[] = {sb->id};
    sp_err_t e;
    if (sp_store_query(eg->store,
                       "SELECT team_id, coalesce(egress::text, ''),"
                       " coalesce(allow_internet_access::int, -1) FROM sandboxes WHERE id = $1",
                       1, p, on_policy, sb, &e) < 0) {
        sp_timer_start(&sb->retry, POLICY_RETRY_MS);
        return;
    }
    sb->loading = true;
    eg->inflight++;
}

static void on_sb_retry(sp_timer_t *t, void *arg)
{
    struct sb *sb = arg;
    if (!sb->dead)
        sb_load(sb);
}

/* The sandbox's rule placeholders changed: later processes get the new set. */
static void on_mitm_env(void *arg, struct sp_mitm_sb *h)
{
    struct sb *sb = arg;
    if (!sb->dead && sb->mitm == h)
        sb_send_config(sb);
}

static void sb_open_mitm(struct sb *sb);

static void on_mitm_open(void *arg, struct sp_mitm_sb *h, const sp_err_t *err)
{
    struct sb *sb = arg;
    sp_egress_t *eg = sb->eg;
    sb->mitm_opening = false;
    eg->inflight--;
    if (sb->dead || eg->dying) {
        if (h != NULL)
            sp_mitm_sb_close(h);
        sb->dead = true;
        sp_egress__sb_maybe_free(sb);
        if (eg->dying)
            sp_egress__maybe_free(eg);
        return;
    }
    if (sb->mitm_stale) { /* opened for the old name */
        sb->mitm_stale = false;
        if (h != NULL)
            sp_mitm_sb_close(h);
        sb_open_mitm(sb);
        return;
    }
    if (err != NULL)
        sp_log(SP_LOG_WARN, "egress",
               "credentials unavailable sandbox=%s err=%s (passing "
               "through)",
               sb->id, err->msg);
    sb->mitm = h;
    if (h != NULL) {
        sp_mitm_sb_on_env(h, on_mitm_env, sb);
        /* The config may have gone out before the rules were loaded. */
        if (sp_mitm_sb_placeholders(h, NULL, NULL) > 0)
            sb_send_config(sb);
    }
    sb_policy_ready(sb);
}

/* Opens the sandbox's credential handle (core/egress/mitm.h) when credential injection is on. */
static void sb_open_mitm(struct sb *sb)
{
    sp_egress_t *eg = sb->eg;
    if (eg->mitm == NULL || sb->mitm != NULL || sb->mitm_opening || sb->conn == NULL ||
        strchr(sb->id, ':') != NULL) /* no sandbox (sb_load), no credentials */
        return;
    sp_err_t e;
    sb->mitm_opening = true;
    eg->inflight++;
    if (sp_mitm_sb_open(eg->mitm, sb->id, sb->conn, on_mitm_open, sb, &e) < 0) {
        sb->mitm_opening = false;
        eg->inflight--;
        sp_log(SP_LOG_WARN, "egress", "credentials unavailable sandbox=%s err=%s", sb->id, e.msg);
    }
}

static void on_conn_event(void *arg, sp_agentconn_t *c, sp_agentconn_event_t ev)
{
    struct sb *sb = arg;
    if (ev == SP_AGENTCONN_UP) {
        sb_send_config(sb);
        return;
    }
    if (ev == SP_AGENTCONN_DOWN) {
        sb->cfg = NULL; /* failed with the channel */
        sb->small_window = false;
        return;
    }
    /* GONE: the channel is being freed; every stream on it has already failed. */
    sb->conn = NULL;
    sb->lis = NULL;
    sb->cfg = NULL;
    sb_close_all(sb);
    if (sb->mitm != NULL) {
        sp_mitm_sb_close(sb->mitm);
        sb->mitm = NULL;
    }
    sb_unlink(sb);
    sb->eg->st.sandboxes--;
    count_sandboxes(sb->eg);
    sb->dead = true;
    sp_egress__sb_maybe_free(sb);
}

/* The channel's VM now belongs to sandbox id (a spare clone taken by a sandbox,
 * core/runtime/qemu/pool.c): what was decided under the old name goes, the new one's policy and
 * credentials load, and the config goes out again (the agent leaves files that did not change
 * alone). */
static void sb_rename(struct sb *sb, const char *id)
{
    if (strcmp(sb->id, id) == 0)
        return;
    sp_log(SP_LOG_DEBUG, "egress", "channel renamed sandbox=%s was=%s", id, sb->id);
    snprintf(sb->id, sizeof(sb->id), "%s", id);
    sb->team[0] = '\0';
    sb_close_all(sb);
    count_sandboxes(sb->eg);
    sp_egp_free(sb->policy);
    sb->policy = NULL; /* connections wait for the new one */
    if (sb->mitm != NULL) {
        sp_mitm_sb_close(sb->mitm);
        sb->mitm = NULL;
    }
    if (sb->mitm_opening)
        sb->mitm_stale = true;
    sb_load(sb);
    sb_open_mitm(sb);
    if (sp_agentconn_up(sb->conn))
        sb_send_config(sb);
}

static void on_named(void *arg, sp_agentconn_t *c, const char *sandbox_id)
{
    sp_egress_t *eg = arg;
    for (struct sb *x = eg->sbs; x != NULL; x = x->next) {
        if (x->conn == c && !x->dead) {
            sb_rename(x, sandbox_id);
            return;
        }
    }
    struct sb *sb = calloc(1, sizeof(*sb));
    if (sb == NULL) {
        sp_log(SP_LOG_ERROR, "egress", "out of memory attaching sandbox=%s", sandbox_id);
        return;
    }
    sb->eg = eg;
    sb->conn = c;
    snprintf(sb->id, sizeof(sb->id), "%s", sandbox_id);
    sp_timer_init(&sb->retry, eg->loop, on_sb_retry, sb);
    sb->lis = sp_agentconn_listen(c, on_conn_event, sb);
    if (sb->lis == NULL) {
        free(sb);
        sp_log(SP_LOG_ERROR, "egress", "cannot listen on the channel sandbox=%s", sandbox_id);
        return;
    }
    sp_agentconn_set_acceptor(c, on_accept, sb);
    sb->next = eg->sbs;
    if (sb->next)
        sb->next->prev = sb;
    eg->sbs = sb;
    eg->st.sandboxes++;
    count_sandboxes(eg);
    sb_load(sb);
    sb_open_mitm(sb);
    if (sp_agentconn_up(c))
        sb_send_config(sb);
}

/* ---- notifications ---- */

void sp_egress_policy_changed(sp_egress_t *eg, const char *sandbox_id)
{
    if (eg == NULL || eg->dying)
        return;
    for (struct sb *sb = eg->sbs; sb != NULL; sb = sb->next)
        if (sandbox_id == NULL || strcmp(sb->id, sandbox_id) == 0)
            sb_load(sb);
}

void sp_egress_policy_set(sp_egress_t *eg, const char *sandbox_id, const json_t *policy)
{
    if (eg == NULL || eg->dying || sandbox_id == NULL)
        return;
    for (struct sb *sb = eg->sbs; sb != NULL; sb = sb->next) {
        if (strcmp(sb->id, sandbox_id) != 0)
            continue;
        sp_err_t e;
        sp_egp_t *p = sp_egp_from_json(policy, "egress", &e);
        if (p == NULL) { /* cannot happen for a stored policy; reload it instead */
            sb_load(sb);
            continue;
        }
        sb_apply(sb, p);
    }
}

int sp_egress_preset(sp_egress_t *eg, const char *vm_id, const char *team, const json_t *policy,
                     sp_err_t *err)
{
    if (eg == NULL || eg->dying)
        return 0;
    if (strlen(vm_id) >= sizeof(((struct preset *)0)->id) || strlen(team) > SP_ID_LEN)
        return sp_err_set(err, SP_EINVAL, "VM id or team too long");
    sp_egp_t *check = sp_egp_from_json(policy, "egress", err);
    if (check == NULL)
        return -1;
    sp_egp_free(check);
    struct preset *ps = preset_of(eg, vm_id);
    json_t *copy = policy != NULL && !json_is_null(policy) ? json_deep_copy(policy) : NULL;
    if ((policy != NULL && !json_is_null(policy) && copy == NULL) ||
        (ps == NULL && (ps = calloc(1, sizeof(*ps))) == NULL)) {
        json_decref(copy);
        return sp_err_set(err, SP_EINTERNAL, "out of memory");
    }
    if (ps->id[0] == '\0') {
        snprintf(ps->id, sizeof(ps->id), "%s", vm_id);
        ps->next = eg->presets;
        eg->presets = ps;
    }
    json_decref(ps->policy);
    ps->policy = copy;
    snprintf(ps->team, sizeof(ps->team), "%s", team);
    for (struct sb *sb = eg->sbs; sb != NULL; sb = sb->next)
        if (strcmp(sb->id, vm_id) == 0)
            sb_load(sb);
    return 0;
}

void sp_egress_preset_clear(sp_egress_t *eg, const char *vm_id)
{
    if (eg == NULL)
        return;
    for (struct preset **pp = &eg->presets; *pp != NULL; pp = &(*pp)->next) {
        if (strcmp((*pp)->id, vm_id) != 0)
            continue;
        struct preset *ps = *pp;
        *pp = ps->next;
        json_decref(ps->policy);
        free(ps);
        break;
    }
    if (eg->dying)
        return;
    for (struct sb *sb = eg->sbs; sb != NULL; sb = sb->next) {
        sp_egp_t *p;
        if (strcmp(sb->id, vm_id) == 0 && (p = deny_all()) != NULL)
            sb_apply(sb, p);
    }
}

static void on_notify(void *arg, const char *channel, const char *payload)
{
    sp_egress_policy_changed(arg, payload); /* NULL (listener reconnected): reload all */
}

/* ---- lifetime ---- */

static void raise_nofile(void)
{
    /* Every proxied connection holds a socket (and the loop a dup of it): lift the soft limit
     * to the hard one, up to 65536. */
    struct rlimit rl;
    if (getrlimit(RLIMIT_NOFILE, &rl) == 0 && rl.rlim_cur < rl.rlim_max && rl.rlim_cur < 65536) {
        rlim_t want = rl.rlim_max < 65536 ? rl.rlim_max : 65536;
        rl.rlim_cur = want;
        if (setrlimit(RLIMIT_NOFILE, &rl) < 0)
            sp_log(SP_LOG_WARN, "egress", "cannot raise the open files limit err=%s",
                   strerror(errno));
    }
}

/* The host's addresses change (DHCP, a new interface): read them again every minute. */
static void on_host_addrs(sp_timer_t *t, void *arg)
{
    if (sp_egp_host_addrs_refresh() < 0)
        sp_log(SP_LOG_WARN, "egress", "cannot list the host's addresses: %s", strerror(errno));
    sp_timer_start(t, 60000);
}

static sp_metric_t m_open =
    SP_METRIC_GAUGE("space_egress_connections_open", "Proxied guest connections open now.", "");
static sp_metric_t m_bytes = SP_METRIC_COUNTER(
    "space_egress_bytes_total",
    "Bytes relayed between guests and destinations, by direction (up: from the guest).",
    "direction");
static sp_metric_t m_decisions = SP_METRIC_COUNTER(
    "space_egress_decisions_total",
    "Egress policy decisions on connections and DNS queries, by decision (allowed, denied).",
    "decision");
static sp_metric_t m_mem = SP_METRIC_GAUGE(
    "space_egress_memory_bytes",
    "Egress memory budget (--egress-memory-mb): bytes charged now (used), the limit (limit).",
    "kind");
static sp_metric_t m_mem_refused = SP_METRIC_COUNTER(
    "space_egress_memory_refused_total",
    "Egress memory charges refused: a connection answered 503, or credit held back.", "");
static sp_metric_t m_mem_waiting = SP_METRIC_GAUGE(
    "space_egress_memory_waiting", "Proxied connections waiting for egress memory now.", "");

/* Runs in sp_metrics_render, on the loop (base/metrics.h): mirrors the proxy's own counts. */
static void collect(void *arg)
{
    const sp_egress_t *eg = arg;
    sp_metrics_set(&m_open, eg->st.conns);
    sp_metrics_set(&m_bytes, (double)eg->st.bytes_up, "up");
    sp_metrics_set(&m_bytes, (double)eg->st.bytes_down, "down");
    sp_metrics_set(&m_decisions, (double)eg->st.allowed, "allowed");
    sp_metrics_set(&m_decisions, (double)eg->st.denied, "denied");
    sp_metrics_set(&m_mem, (double)eg->mem.used, "used");
    sp_metrics_set(&m_mem, (double)eg->mem.limit, "limit");
    sp_metrics_set(&m_mem_refused, (double)eg->mem.refused);
    sp_metrics_set(&m_mem_waiting, eg->st.mem_waiting);
}

sp_egress_t *sp_egress_create(sp_loop_t *loop, sp_store_t *store, const sp_egress_opts_t *o,
                              sp_err_t *err)
{
    sp_egress_t *eg = calloc(1, sizeof(*eg));
    if (eg == NULL) {
        sp_err_set(err, SP_EINTERNAL, "out of memory");
        return NULL;
    }
    eg->loop = loop;
    eg->store = store;
    if (o != NULL)
        eg->o = *o;
    if (eg->o.resolver_threads <= 0)
        eg->o.resolver_threads = 8;
    if (eg->o.connect_timeout_ms == 0)
        eg->o.connect_timeout_ms = 10000;
    if (eg->o.memory_limit == 0) {
        long pages = sysconf(_SC_PHYS_PAGES), psz = sysconf(_SC_PAGESIZE);
        uint64_t phys = pages > 0 && psz > 0 ? (uint64_t)pages * (uint64_t)psz : 4ull << 30;
        eg->o.memory_limit = sp_egmem_default_limit(phys);
    }
    sp_egmem_init(&eg->mem, eg->o.memory_limit, SP_EGRESS_MAX_BUFFERED);
    sp_log(SP_LOG_INFO, "egress", "egress memory limit_mb=%llu per_sandbox_mb=%u",
           (unsigned long long)(eg->o.memory_limit >> 20), SP_EGRESS_MAX_BUFFERED >> 20);
    if (sp_egress__audit_init(eg) < 0) {
        free(eg);
        sp_err_set(err, SP_EINTERNAL, "out of memory");
        return NULL;
    }
    if (store != NULL && sp_store_listen(store, SP_EGRESS_NOTIFY, on_notify, eg, err) < 0) {
        sp_egress__audit_free(eg);
        free(eg);
        return NULL;
    }
    raise_nofile();
    sp_agentconn_set_hook(on_named, eg);
    sp_timer_init(&eg->host_addrs, loop, on_host_addrs, eg);
    on_host_addrs(&eg->host_addrs, eg);
    if (sp_metrics_collector_add(collect, eg) < 0)
        sp_log(SP_LOG_WARN, "egress", "egress metrics off: out of memory");
    return eg;
}

void sp_egress_set_mitm(sp_egress_t *eg, struct sp_mitm *m)
{
    eg->mitm = m;
    /* Channels attached before (VMs re-adopted at start): their handles, and the guest env
     * that points programs at the sandbox CA. */
    for (struct sb *sb = eg->sbs; sb != NULL && m != NULL; sb = sb->next) {
        sb_open_mitm(sb);
        if (sb->conn != NULL && sp_agentconn_up(sb->conn))
            sb_send_config(sb);
    }
}

void sp_egress_stats(const sp_egress_t *eg, sp_egress_stats_t *out)
{
    *out = eg->st;
    out->mem_used = eg->mem.used;
    out->mem_limit = eg->mem.limit;
    out->mem_peak = eg->mem.peak;
    out->mem_refused = eg->mem.refused;
}

void sp_egress__maybe_free(sp_egress_t *eg)
{
    if (eg->inflight > 0 || eg->nrunning > 0)
        return;
    sp_egress__audit_free(eg);
    while (eg->presets != NULL) {
        struct preset *ps = eg->presets;
        eg->presets = ps->next;
        json_decref(ps->policy);
        free(ps);
    }
    free(eg);
}

void sp_egress_destroy(sp_egress_t *eg)
{
    if (eg == NULL)
        return;
    sp_agentconn_set_hook(NULL, NULL);
    sp_timer_stop(&eg->host_addrs);
    sp_metrics_collector_remove(collect, eg);
    eg->dying = true;
    sp_egress__audit_stop(eg);
    while (eg->sbs != NULL) {
        struct sb *sb = eg->sbs;
        sb_unlink(sb);
        sb_close_all(sb);
        if (sb->conn != NULL) {
            sp_agentconn_set_acceptor(sb->conn, NULL, NULL);
            sp_agentconn_unlisten(sb->lis);
            if (sb->cfg != NULL)
                sp_agentstream_reset(sb->cfg);
        }
        sb->cfg = NULL;
        sb->conn = NULL;
        if (sb->mitm != NULL)
            sp_mitm_sb_close(sb->mitm);
        sb->mitm = NULL;
        sb->dead = true;
        sp_egress__sb_maybe_free(sb);
    }
    /* Lookups still on the lane: cancelled; each frees itself (and its dead
     * sandbox) when it comes back, the last of them the egress. */
    sp_egress__resolve_stop(eg);
    sp_egress__maybe_free(eg);
}
