/*
 * migrate.c - schema versions and their application.
 *
 * Append new versions at the end; never edit an applied one.
 */
#include "core/store/migrate.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "base/log.h"

/* Any constant works; it only has to be the same in every server. */
#define MIGRATE_LOCK_ID "7367302"

static const char *const migrations[] = {
    /* 1: the control plane's tables */
    "CREATE TABLE teams ("
    "  id text PRIMARY KEY,"
    "  name text NOT NULL UNIQUE,"
    "  created_at timestamptz NOT NULL DEFAULT now());"
    "CREATE TABLE api_keys ("
    "  id text PRIMARY KEY,"
    "  team_id text NOT NULL REFERENCES teams(id),"
    "  prefix text NOT NULL,"
    "  hash text NOT NULL UNIQUE,"
    "  name text NOT NULL DEFAULT '',"
    "  created_at timestamptz NOT NULL DEFAULT now(),"
    "  last_used_at timestamptz,"
    "  revoked_at timestamptz);"
    "CREATE TABLE settings ("
    "  name text PRIMARY KEY,"
    "  value text NOT NULL);"
    "CREATE TABLE templates ("
    "  name text PRIMARY KEY,"
    "  description text NOT NULL DEFAULT '',"
    "  cpu_count int NOT NULL DEFAULT 1,"
    "  memory_mb int NOT NULL DEFAULT 256,"
    "  status text NOT NULL DEFAULT 'unbuilt',"
    "  build_id text,"
    "  updated_at timestamptz NOT NULL DEFAULT now());"
    "CREATE TABLE sandboxes ("
    "  id text PRIMARY KEY,"
    "  team_id text NOT NULL REFERENCES teams(id),"
    "  template text NOT NULL REFERENCES templates(name),"
    "  desired_state text NOT NULL DEFAULT 'running',"
    "  observed_state text NOT NULL DEFAULT 'pending',"
    "  worker_id text,"
    "  claim_until timestamptz,"
    "  action text,"
    "  created_at timestamptz NOT NULL DEFAULT now(),"
    "  updated_at timestamptz NOT NULL DEFAULT now(),"
    "  last_activity_at timestamptz NOT NULL DEFAULT now(),"
    "  idle_timeout_s int NOT NULL DEFAULT 21600,"
    "  deadline_at timestamptz,"
    "  deadline_action text NOT NULL DEFAULT 'delete',"
    "  metadata jsonb NOT NULL DEFAULT '{}',"
    "  env jsonb NOT NULL DEFAULT '{}',"
    "  cpu_count int NOT NULL,"
    "  memory_mb int NOT NULL,"
    "  access_token text NOT NULL UNIQUE,"
    "  snapshot_bytes bigint NOT NULL DEFAULT 0,"
    "  error text);"
    "CREATE INDEX sandboxes_team_created ON sandboxes (team_id, created_at DESC, id DESC);"
    "CREATE INDEX sandboxes_unsettled ON sandboxes (id) WHERE observed_state <> 'deleted';"
    "CREATE INDEX sandboxes_metadata ON sandboxes USING gin (metadata jsonb_path_ops);"
    "CREATE TABLE operations ("
    "  id text PRIMARY KEY,"
    "  sandbox_id text NOT NULL REFERENCES sandboxes(id),"
    "  team_id text NOT NULL REFERENCES teams(id),"
    "  kind text NOT NULL,"
    "  target text NOT NULL,"
    "  status text NOT NULL DEFAULT 'pending',"
    "  error_code text,"
    "  error_message text,"
    "  created_at timestamptz NOT NULL DEFAULT now(),"
    "  finished_at timestamptz);"
    "CREATE INDEX operations_active ON operations (sandbox_id) WHERE status IN "
    "('pending','running');"
    "CREATE TABLE events ("
    "  id bigserial PRIMARY KEY,"
    "  sandbox_id text NOT NULL,"
    "  kind text NOT NULL,"
    "  detail text NOT NULL DEFAULT '',"
    "  at timestamptz NOT NULL DEFAULT now());"
    "CREATE INDEX events_sandbox ON events (sandbox_id, id);",
    /* 2: what the E2B surface keeps per sandbox. deadline_s is the last timeout length asked
     * for (an automatic wake starts a new deadline of that length); allow_internet_access and
     * network are stored for outbound rules and not yet enforced. */
    "ALTER TABLE sandboxes ADD COLUMN auto_resume boolean NOT NULL DEFAULT false;"
    "ALTER TABLE sandboxes ADD COLUMN deadline_s int;"
    "ALTER TABLE sandboxes ADD COLUMN allow_internet_access boolean;"
    "ALTER TABLE sandboxes ADD COLUMN network jsonb;"
    "ALTER TABLE sandboxes ADD COLUMN envd_version text;",
    /* 3: outbound traffic (core/egress/egress.h). egress is the sandbox's policy
     * {"internet","allow","deny"} (NULL: derived from allow_internet_access); egress_log
     * is the audit of its connections and DNS answers, newest kept per sandbox (the proxy
     * trims it). */
    "ALTER TABLE sandboxes ADD COLUMN egress jsonb;"
    "CREATE TABLE egress_log ("
    "  id bigserial PRIMARY KEY,"
    "  sandbox_id text NOT NULL,"
    "  team_id text NOT NULL,"
    "  at timestamptz NOT NULL DEFAULT now(),"
    "  kind text NOT NULL,"
    "  host text NOT NULL,"
    "  port int NOT NULL,"
    "  address text NOT NULL DEFAULT '',"
    "  allowed boolean NOT NULL,"
    "  reason text NOT NULL DEFAULT '',"
    "  bytes_up bigint NOT NULL DEFAULT 0,"
    "  bytes_down bigint NOT NULL DEFAULT 0,"
    "  duration_ms int NOT NULL DEFAULT 0);"
    "CREATE INDEX egress_log_sandbox ON egress_log (sandbox_id, id DESC);",
    /* 4: credentials added outside the VM (core/egress/secrets.h, core/egress/mitm.h). box is the
     * value sealed with the master key, which is never stored here; credentials are the sandbox's
     * rules; sandbox_cas holds each sandbox's egress CA, its key sealed the same way. */
    "CREATE TABLE secrets ("
    "  team_id text NOT NULL REFERENCES teams(id),"
    "  name text NOT NULL,"
    "  box text NOT NULL,"
    "  created_at timestamptz NOT NULL DEFAULT now(),"
    "  updated_at timestamptz NOT NULL DEFAULT now(),"
    "  PRIMARY KEY (team_id, name));"
    "ALTER TABLE sandboxes ADD COLUMN credentials jsonb NOT NULL DEFAULT '[]';"
    "CREATE TABLE sandbox_cas ("
    "  sandbox_id text PRIMARY KEY REFERENCES sandboxes(id),"
    "  cert_pem text NOT NULL,"
    "  key_box text NOT NULL,"
    "  created_at timestamptz NOT NULL DEFAULT now());",
    /* 5: templates built through the API (core/control/tmpl.h). A template with a team_id is
     * that team's (NULL: built in, everyone's); env is given to its sandboxes' processes;
     * deleted_at hides a deleted one (its row stays: sandboxes name it). template_builds is
     * one row per build, its log in <data-dir>/builds/<id>.ndjson. */
    "ALTER TABLE templates ADD COLUMN team_id text REFERENCES teams(id),"
    "  ADD COLUMN env jsonb NOT NULL DEFAULT '{}',"
    "  ADD COLUMN parent text,"
    "  ADD COLUMN deleted_at timestamptz;"
    "CREATE TABLE template_builds ("
    "  id text PRIMARY KEY,"
    "  team_id text NOT NULL REFERENCES teams(id),"
    "  template text NOT NULL REFERENCES templates(name),"
    "  status text NOT NULL,"
    "  request jsonb NOT NULL,"
    "  hash text,"
    "  cached boolean NOT NULL DEFAULT false,"
    "  failed_step int,"
    "  error text,"
    "  created_at timestamptz NOT NULL DEFAULT now(),"
    "  started_at timestamptz,"
    "  finished_at timestamptz);"
    "CREATE INDEX template_builds_template ON template_builds (template, created_at DESC);"
    "CREATE INDEX template_builds_open ON template_builds (status)"
    "  WHERE status IN ('queued', 'building');",
    /* 6: sandbox snapshots, "forks" (core/control/snap.h). A snapshot is taken from a team's
     * running or paused sandbox; template, cpu_count, memory_mb and env are the source's, for
     * the sandboxes created from it (sandboxes.snapshot_id). name is an optional alias (the E2B
     * surface's), unique in the team among snapshots not deleted. state: creating | ready |
     * failed. deleted_at hides a deleted one (its row stays: sandboxes name it). */
    "CREATE TABLE snapshots ("
    "  id text PRIMARY KEY,"
    "  team_id text NOT NULL REFERENCES teams(id),"
    "  sandbox_id text NOT NULL REFERENCES sandboxes(id),"
    "  template text NOT NULL,"
    "  cpu_count int NOT NULL,"
    "  memory_mb int NOT NULL,"
    "  env jsonb NOT NULL DEFAULT '{}',"
    "  name text,"
    "  state text NOT NULL DEFAULT 'creating',"
    "  error text,"
    "  created_at timestamptz NOT NULL DEFAULT now(),"
    "  deleted_at timestamptz);"
    "CREATE INDEX snapshots_team_created ON snapshots (team_id, created_at DESC, id DESC);"
    "CREATE UNIQUE INDEX snapshots_team_name ON snapshots (team_id, name)"
    "  WHERE name IS NOT NULL AND deleted_at IS NULL;"
    "CREATE INDEX snapshots_creating ON snapshots (id) WHERE state = 'creating';"
    "ALTER TABLE sandboxes ADD COLUMN snapshot_id text REFERENCES snapshots(id);",
    /* 7: template versions and tags (core/control/tmpl.h). A version is what one successful
     * build made (or found cached), with the sizes and env its sandboxes get; a tag names one
     * version of a team's template, set by a build or moved since (build_id: the build that
     * made the version). 'default' is what the bare name means and what templates.build_id
     * follows. sandboxes.template_version is the version a sandbox was created from (NULL: the
     * template's current one, as before: built-in templates and sandboxes older than this
     * column); a fork's is its snapshot's source's. Existing templates get their current
     * version as their default tag. */
    "CREATE TABLE template_versions ("
    "  template text NOT NULL REFERENCES templates(name),"
    "  hash text NOT NULL,"
    "  build_id text NOT NULL,"
    "  cpu_count int NOT NULL,"
    "  memory_mb int NOT NULL,"
    "  env jsonb NOT NULL DEFAULT '{}',"
    "  created_at timestamptz NOT NULL DEFAULT now(),"
    "  PRIMARY KEY (template, hash));"
    "CREATE TABLE template_tags ("
    "  template text NOT NULL REFERENCES templates(name),"
    "  tag text NOT NULL,"
    "  hash text NOT NULL,"
    "  created_at timestamptz NOT NULL DEFAULT now(),"
    "  PRIMARY KEY (template, tag),"
    "  FOREIGN KEY (template, hash) REFERENCES template_versions (template, hash));"
    "ALTER TABLE sandboxes ADD COLUMN template_version text;"
    "INSERT INTO template_versions (template, hash, build_id, cpu_count, memory_mb, env)"
    "  SELECT t.name, t.build_id, coalesce((SELECT b.id FROM template_builds b"
    "   WHERE b.template = t.name AND b.hash = t.build_id AND b.status = 'succeeded'"
    "   ORDER BY b.created_at DESC LIMIT 1), ''), t.cpu_count, t.memory_mb, t.env"
    "  FROM templates t WHERE t.team_id IS NOT NULL AND t.build_id IS NOT NULL"
    "  AND t.deleted_at IS NULL;"
    "INSERT INTO template_tags (template, tag, hash)"
    "  SELECT template, 'default', hash FROM template_versions;",
    /* 8: a team's live sandboxes newest first, for lists (core/control/svc.c). Deleted rows
     * stay in the table for good; in sandboxes_team_created a list read past every one of a
     * team's deleted sandboxes newer than its live ones (160 rows looked at for 10 shown after
     * 150 creates and deletes: 0.4 ms instead of 0.08). */
    ("CREATE INDEX sandboxes_team_live ON sandboxes (team_id, created_at DESC, id DESC)"
     "  WHERE observed_state <> 'deleted';"),
    /* 9: per-team quotas (core/control/svc.h). A NULL limit is the server's default, passed
     * by the statement that asks. What counts: the team's sandboxes desired running or paused
     * (a paused one keeps its memory) and not yet gone. space_team_quota locks the team's row
     * first, so two creates of one team take turns, and, being a volatile function, counts
     * with a snapshot taken after the lock (READ COMMITTED): the other create's row, committed
     * by then, is counted. It raises SQLSTATE SPQTA (core/store/store.h) with a message for
     * the client; else it is true. */
    "ALTER TABLE teams ADD COLUMN max_sandboxes int, ADD COLUMN max_vcpus int,"
    "  ADD COLUMN max_memory_mb int;"
    "CREATE FUNCTION space_team_quota(team text, cpus int, mem int, def_sandboxes int,"
    "  def_vcpus int, def_memory_mb int) RETURNS boolean LANGUAGE plpgsql VOLATILE AS $q$"
    " DECLARE ls int; lc int; lm int; n bigint; c bigint; m bigint;"
    " BEGIN"
    "  SELECT coalesce(max_sandboxes, def_sandboxes), coalesce(max_vcpus, def_vcpus),"
    "   coalesce(max_memory_mb, def_memory_mb) INTO ls, lc, lm"
    "   FROM teams WHERE id = team FOR NO KEY UPDATE;"
    "  SELECT count(*), coalesce(sum(cpu_count), 0), coalesce(sum(memory_mb), 0) INTO n, c, m"
    "   FROM sandboxes WHERE team_id = team AND desired_state IN ('running', 'paused')"
    "   AND observed_state <> 'deleted';"
    "  IF n + 1 > ls THEN RAISE EXCEPTION USING ERRCODE = 'SPQTA', MESSAGE = format("
    "   'team quota exceeded: sandboxes: %s running or paused, limit %s', n, ls); END IF;"
    "  IF c + cpus > lc THEN RAISE EXCEPTION USING ERRCODE = 'SPQTA', MESSAGE = format("
    "   'team quota exceeded: vCPUs: %s in use + %s asked, limit %s', c, cpus, lc); END IF;"
    "  IF m + mem > lm THEN RAISE EXCEPTION USING ERRCODE = 'SPQTA', MESSAGE = format("
    "   'team quota exceeded: memory: %s MiB in use + %s asked, limit %s MiB', m, mem, lm);"
    "  END IF;"
    "  RETURN true;"
    " END $q$;",
    /* 10: many hosts (issue "Many hosts, one platform"). A worker is a spaced that runs VMs
     * (role all or worker); it registers here and heartbeats. address is host:port other nodes
     * reach its HTTP listener at. state: active (placements go here) | draining (none; its
     * sandboxes move away) | lost (its heartbeat lapsed; declared by whichever node holds the
     * 'fleet' lease). vcpus, memory_mb, disk_mb are what it offers (NULL: no limit); what is
     * taken is the sum over the sandboxes placed on it (sandboxes.worker_id) that are desired
     * running or paused. generation counts the times it was declared lost: a sandbox records
     * the generation of the worker it was placed on (worker_generation), so a worker that
     * comes back never acts on a sandbox placed again since (fencing). templates: the
     * template keys ("name" or "name@version") with a snapshot ready there, for locality (the
     * worker's heartbeat writes an object of them, each with its sizes: core/control/fleet.c).
     * sandboxes.placement holds the labels a create pinned (a jsonb object that the worker's
     * labels must contain). lost_at: when the sandbox's memory was lost with its worker.
     * leases: one row per singleton job (the fleet sweep), held by one node until 'until'. */
    "CREATE TABLE workers ("
    "  id text PRIMARY KEY,"
    "  address text NOT NULL,"
    "  role text NOT NULL DEFAULT 'all',"
    "  state text NOT NULL DEFAULT 'active',"
    "  vcpus int,"
    "  memory_mb int,"
    "  disk_mb bigint,"
    "  accelerator text NOT NULL DEFAULT '',"
    "  version text NOT NULL DEFAULT '',"
    "  labels jsonb NOT NULL DEFAULT '{}',"
    "  templates jsonb NOT NULL DEFAULT '[]',"
    "  generation bigint NOT NULL DEFAULT 1,"
    "  started_at timestamptz NOT NULL DEFAULT now(),"
    "  heartbeat_at timestamptz NOT NULL DEFAULT now(),"
    "  lost_at timestamptz);"
    "CREATE TABLE leases ("
    "  name text PRIMARY KEY,"
    "  holder text NOT NULL,"
    "  until timestamptz NOT NULL);"
    "ALTER TABLE sandboxes ADD COLUMN placement jsonb,"
    "  ADD COLUMN worker_generation bigint,"
    "  ADD COLUMN lost_at timestamptz;"
    "CREATE INDEX sandboxes_worker_live ON sandboxes (worker_id)"
    "  WHERE observed_state <> 'deleted';",
    /* 11: placement (core/control/fleet.h). space_place picks the worker a create or a wake
     * puts a sandbox on: active, heartbeat younger than fresh_s (the worker named me, the
     * caller itself, counts as fresh), labels containing want, and room for cpus and mem
     * beside what the sandboxes placed on it desired running or paused hold; preferring the
     * worker named prefer (a suspended sandbox's own, whose snapshot is local), then one with
     * the template's snapshot, then the most free room. It first locks every candidate with
     * limits, in id order (two placements never deadlock), and counts after the locks, being
     * volatile (READ COMMITTED: a new snapshot per statement), so the other placement's row,
     * committed by then, is counted: concurrent creates never overcommit a worker. Workers
     * without limits are neither locked nor counted, so a single node with none pays one
     * indexed read. It raises SQLSTATE SPCAP (core/store/store.h) with a message for the
     * client when no worker fits. sandboxes.moving: the desired state (running or paused) a
     * sandbox a drain suspended returns to once placed elsewhere; moved_from: the worker it
     * was on before its last move, which must never run it again (fencing). */
    "ALTER TABLE sandboxes ADD COLUMN moving text, ADD COLUMN moved_from text;"
    "CREATE FUNCTION space_place(cpus int, mem int, want jsonb, tmpl text, fresh_s int,"
    "  me text, prefer text, OUT wid text, OUT wgen bigint) LANGUAGE plpgsql VOLATILE AS $p$"
    " BEGIN"
    "  PERFORM 1 FROM workers w WHERE w.state = 'active'"
    "   AND (w.heartbeat_at > now() - make_interval(secs => fresh_s) OR w.id = me)"
    "   AND w.labels @> coalesce(want, '{}') AND (w.vcpus IS NOT NULL OR w.memory_mb IS NOT NULL)"
    "   ORDER BY w.id FOR UPDATE;"
    "  SELECT w.id, w.generation INTO wid, wgen FROM workers w"
    "   CROSS JOIN LATERAL (SELECT coalesce(sum(s.cpu_count), 0) AS c,"
    "    coalesce(sum(s.memory_mb), 0) AS m FROM sandboxes s"
    "    WHERE (w.vcpus IS NOT NULL OR w.memory_mb IS NOT NULL) AND s.worker_id = w.id"
    "    AND s.desired_state IN ('running', 'paused') AND s.observed_state <> 'deleted') u"
    "   WHERE w.state = 'active'"
    "   AND (w.heartbeat_at > now() - make_interval(secs => fresh_s) OR w.id = me)"
    "   AND w.labels @> coalesce(want, '{}')"
    "   AND (w.vcpus IS NULL OR w.vcpus - u.c >= cpus)"
    "   AND (w.memory_mb IS NULL OR w.memory_mb - u.m >= mem)"
    "   ORDER BY w.id IS NOT DISTINCT FROM prefer DESC, w.templates ? coalesce(tmpl, '') DESC,"
    "    least(coalesce(w.vcpus - u.c, 1000000) * 4096, coalesce(w.memory_mb - u.m, 1000000000))"
    "    DESC, w.id LIMIT 1;"
    "  IF wid IS NULL THEN RAISE EXCEPTION USING ERRCODE = 'SPCAP', MESSAGE = format("
    "   'no worker has room for %s vCPUs and %s MiB%s', cpus, mem, CASE WHEN want IS NULL"
    "   OR want = '{}' THEN '' ELSE ' with labels ' || want::text END); END IF;"
    " END $p$;",
    /* 12: envd access tokens no longer kept in clear (core/control/tokens.h). token_salt: what
     * the sandbox's tokens are derived from (or, for a row from before, its token sealed);
     * token_hash: the envd token's keyed hash, the lookup by token alone. access_token stays
     * for rows written before, until spaced converts them at start (sp_tokens_convert). */
    "ALTER TABLE sandboxes ALTER COLUMN access_token DROP NOT NULL,"
    "  ADD COLUMN token_salt text, ADD COLUMN token_hash text UNIQUE;",
    /* 13: template snapshots made ahead (core/control/sizes.h). operations.progress: what a
     * lifecycle action waits for when that takes long (a template snapshot being built for
     * the sandbox's size, a cold boot), kept once it finished. sandboxes_created: the sizes
     * created in the last day are read from the sandboxes themselves (deleted rows stay),
     * by creation time. */
    "ALTER TABLE operations ADD COLUMN progress text;"
    "CREATE INDEX sandboxes_created ON sandboxes (created_at);",
    /* 14: a drain outlives the worker's loss (core/control/fleet.c). workers.drain: the
     * operator drained this worker and has not undrained it since, whatever its state now: a
     * worker that comes back after it was declared lost returns to draining, not active. */
    "ALTER TABLE workers ADD COLUMN drain boolean NOT NULL DEFAULT false;"
    "UPDATE workers SET drain = true WHERE state = 'draining';",
    /* 15: the snapshot-disk quota (core/control/svc.h). teams.max_snapshot_mb: the team's
     * limit (NULL: the server's default, passed by the statement that asks); snapshots.bytes:
     * what a ready snapshot's files take on disk, measured by the driver once it is written
     * (NULL before, or when the driver cannot say). What a team holds: its sandboxes' suspend
     * snapshots (sandboxes.snapshot_bytes, measured when the suspend is recorded, 0 once
     * running again) and its sandbox snapshots not deleted. The size of a snapshot is known
     * only once it is written, so space_team_disk_quota refuses a new one when what is held
     * already reaches the limit: a team ends at most one snapshot past it. It raises SPQTA
     * like space_team_quota, else is true; it takes no lock (the overshoot is bounded the
     * same way whether or not two snapshots race). */
    "ALTER TABLE teams ADD COLUMN max_snapshot_mb bigint;"
    "ALTER TABLE snapshots ADD COLUMN bytes bigint;"
    "CREATE FUNCTION space_team_disk_quota(team text, def_mb bigint) RETURNS boolean"
    "  LANGUAGE plpgsql VOLATILE AS $q$"
    " DECLARE l bigint; h numeric;"
    " BEGIN"
    "  SELECT coalesce(max_snapshot_mb, def_mb) INTO l FROM teams WHERE id = team;"
    "  IF l IS NULL THEN RETURN true; END IF;"
    "  SELECT coalesce((SELECT sum(snapshot_bytes) FROM sandboxes WHERE team_id = team"
    "   AND observed_state <> 'deleted'), 0) + coalesce((SELECT sum(bytes) FROM snapshots"
    "   WHERE team_id = team AND deleted_at IS NULL AND state = 'ready'), 0) INTO h;"
    "  IF h >= l * 1048576 THEN RAISE EXCEPTION USING ERRCODE = 'SPQTA', MESSAGE = format("
    "   'team quota exceeded: snapshot disk: %s MiB held, limit %s MiB', ceil(h / 1048576),"
    "   l); END IF;"
    "  RETURN true;"
    " END $q$;",
    /* 16: a sandbox's VM disk size (core/control/recon.c). disk_mb: the size in MiB of the disk
     * of the sandbox's VM (its capacity, fixed once the VM exists), written by the worker that
     * runs it each time it records the VM up (observed running or paused), so that whichever
     * node answers a list or a detail shows it without asking that worker. NULL until then:
     * sandboxes whose VM never came up, and rows from before this column until their worker
     * starts (it fills in those of the VMs it runs); readers of a NULL fall back to their own
     * driver, which knows only its own VMs. It stays while the sandbox is suspended and when
     * it moves to another worker: the disk goes with it. */
    "ALTER TABLE sandboxes ADD COLUMN disk_mb bigint;",
    /* 17: placement's locality by size (core/control/fleet.h). A worker's templates column
     * lists, per template, the sizes it holds snapshots of; a template snapshot serves only
     * its own size, so among workers with room space_place now prefers, after the sandbox's
     * own worker, one holding the template's snapshot at the size asked for, then one holding
     * it at another size (its disk image and page cache are warm), then the most free room.
     * Otherwise as in 11. */
    "CREATE OR REPLACE FUNCTION space_place(cpus int, mem int, want jsonb, tmpl text,"
    "  fresh_s int, me text, prefer text, OUT wid text, OUT wgen bigint) LANGUAGE plpgsql"
    "  VOLATILE AS $p$"
    " BEGIN"
    "  PERFORM 1 FROM workers w WHERE w.state = 'active'"
    "   AND (w.heartbeat_at > now() - make_interval(secs => fresh_s) OR w.id = me)"
    "   AND w.labels @> coalesce(want, '{}') AND (w.vcpus IS NOT NULL OR w.memory_mb IS NOT NULL)"
    "   ORDER BY w.id FOR UPDATE;"
    "  SELECT w.id, w.generation INTO wid, wgen FROM workers w"
    "   CROSS JOIN LATERAL (SELECT coalesce(sum(s.cpu_count), 0) AS c,"
    "    coalesce(sum(s.memory_mb), 0) AS m FROM sandboxes s"
    "    WHERE (w.vcpus IS NOT NULL OR w.memory_mb IS NOT NULL) AND s.worker_id = w.id"
    "    AND s.desired_state IN ('running', 'paused') AND s.observed_state <> 'deleted') u"
    "   WHERE w.state = 'active'"
    "   AND (w.heartbeat_at > now() - make_interval(secs => fresh_s) OR w.id = me)"
    "   AND w.labels @> coalesce(want, '{}')"
    "   AND (w.vcpus IS NULL OR w.vcpus - u.c >= cpus)"
    "   AND (w.memory_mb IS NULL OR w.memory_mb - u.m >= mem)"
    "   ORDER BY w.id IS NOT DISTINCT FROM prefer DESC,"
    "    coalesce(w.templates -> coalesce(tmpl, '') @> jsonb_build_array(jsonb_build_object("
    "     'cpu_count', cpus, 'memory_mb', mem)), false) DESC,"
    "    w.templates ? coalesce(tmpl, '') DESC,"
    "    least(coalesce(w.vcpus - u.c, 1000000) * 4096, coalesce(w.memory_mb - u.m, 1000000000))"
    "    DESC, w.id LIMIT 1;"
    "  IF wid IS NULL THEN RAISE EXCEPTION USING ERRCODE = 'SPCAP', MESSAGE = format("
    "   'no worker has room for %s vCPUs and %s MiB%s', cpus, mem, CASE WHEN want IS NULL"
    "   OR want = '{}' THEN '' ELSE ' with labels ' || want::text END); END IF;"
    " END $p$;",
    /* 18: placement locks one worker, not every candidate (core/control/fleet.h). Locking all
     * candidates (11) made every create and wake in the fleet wait for every other, though
     * only two placed on the same worker can overcommit it. space_place_best ranks the
     * workers as 17 did, by what is committed now, without a lock, and says what the first
     * one holds and how many have room. space_place locks that worker's row, if it is still
     * eligible, and counts what it holds again (volatile, READ COMMITTED: a new snapshot,
     * which sees what a placement that held the lock before committed). It takes it when the
     * lock was free and the count unchanged (the ranking still holds: placements elsewhere
     * only leave the others less room), or when it was the only one with room and still has
     * it. Otherwise it ranks again: the same worker first is taken, else the lock is given
     * back (the block's subtransaction rolls back, error SPRTY) and it starts over. So a
     * placement waits holding no worker lock and holds at most one (two never deadlock), and
     * a worker gets what a placement made after the others' would give it (creates racing
     * still spread). Each retry follows another's commit; after 8 it falls back to 17's way
     * (every candidate locked in id order), which cannot retry. With one eligible worker
     * with limits or none, it does as 17 did (nobody else to wait for; no count twice). A
     * worker without limits is taken unlocked, as before. space_place_best is plpgsql, not
     * sql: its plan is then kept per session (a sql function called so is planned at every
     * call, which cost a fifth of the creates a worker placed per second). */
    "CREATE FUNCTION space_place_best(cpus int, mem int, want jsonb, tmpl text, fresh_s int,"
    "  me text, prefer text, OUT wid text, OUT wgen bigint, OUT limited boolean,"
    "  OUT used_c bigint, OUT used_m bigint, OUT n bigint) LANGUAGE plpgsql VOLATILE AS $b$"
    " BEGIN"
    "  SELECT w.id, w.generation, w.vcpus IS NOT NULL OR w.memory_mb IS NOT NULL, u.c, u.m,"
    "   count(*) OVER () INTO wid, wgen, limited, used_c, used_m, n FROM workers w"
    "   CROSS JOIN LATERAL (SELECT coalesce(sum(s.cpu_count), 0) AS c,"
    "    coalesce(sum(s.memory_mb), 0) AS m FROM sandboxes s"
    "    WHERE (w.vcpus IS NOT NULL OR w.memory_mb IS NOT NULL) AND s.worker_id = w.id"
    "    AND s.desired_state IN ('running', 'paused') AND s.observed_state <> 'deleted') u"
    "   WHERE w.state = 'active'"
    "   AND (w.heartbeat_at > now() - make_interval(secs => fresh_s) OR w.id = me)"
    "   AND w.labels @> coalesce(want, '{}')"
    "   AND (w.vcpus IS NULL OR w.vcpus - u.c >= cpus)"
    "   AND (w.memory_mb IS NULL OR w.memory_mb - u.m >= mem)"
    "   ORDER BY w.id IS NOT DISTINCT FROM prefer DESC,"
    "    coalesce(w.templates -> coalesce(tmpl, '') @> jsonb_build_array(jsonb_build_object("
    "     'cpu_count', cpus, 'memory_mb', mem)), false) DESC,"
    "    w.templates ? coalesce(tmpl, '') DESC,"
    "    least(coalesce(w.vcpus - u.c, 1000000) * 4096, coalesce(w.memory_mb - u.m, 1000000000))"
    "    DESC, w.id LIMIT 1;"
    " END $b$;"
    "CREATE OR REPLACE FUNCTION space_place(cpus int, mem int, want jsonb, tmpl text,"
    "  fresh_s int, me text, prefer text, OUT wid text, OUT wgen bigint) LANGUAGE plpgsql"
    "  VOLATILE AS $p$"
    " DECLARE b record; tries int := 0; waited boolean; vc int; vm int; c bigint; m bigint;"
    "  k int;"
    " BEGIN"
    "  SELECT count(*) INTO k FROM workers w WHERE w.state = 'active'"
    "   AND (w.heartbeat_at > now() - make_interval(secs => fresh_s) OR w.id = me)"
    "   AND w.labels @> coalesce(want, '{}') AND (w.vcpus IS NOT NULL OR w.memory_mb IS NOT NULL);"
    "  IF k <= 1 THEN"
    "   PERFORM 1 FROM workers w WHERE w.state = 'active'"
    "    AND (w.heartbeat_at > now() - make_interval(secs => fresh_s) OR w.id = me)"
    "    AND w.labels @> coalesce(want, '{}')"
    "    AND (w.vcpus IS NOT NULL OR w.memory_mb IS NOT NULL) FOR UPDATE;"
    "   SELECT x.wid, x.wgen INTO wid, wgen"
    "    FROM space_place_best(cpus, mem, want, tmpl, fresh_s, me, prefer) x;"
    "  END IF;"
    "  WHILE k > 1 LOOP"
    "   SELECT * INTO b FROM space_place_best(cpus, mem, want, tmpl, fresh_s, me, prefer);"
    "   IF b.wid IS NOT NULL AND NOT b.limited THEN"
    "    wid := b.wid; wgen := b.wgen; RETURN;"
    "   END IF;"
    "   EXIT WHEN b.wid IS NULL;"
    "   IF tries >= 8 THEN"
    "    PERFORM 1 FROM workers w WHERE w.state = 'active'"
    "     AND (w.heartbeat_at > now() - make_interval(secs => fresh_s) OR w.id = me)"
    "     AND w.labels @> coalesce(want, '{}')"
    "     AND (w.vcpus IS NOT NULL OR w.memory_mb IS NOT NULL) ORDER BY w.id FOR UPDATE;"
    "    SELECT x.wid, x.wgen INTO wid, wgen"
    "     FROM space_place_best(cpus, mem, want, tmpl, fresh_s, me, prefer) x;"
    "    EXIT;"
    "   END IF;"
    "   tries := tries + 1;"
    "   IF b.n = 1 THEN"
    "    SELECT w.vcpus, w.memory_mb INTO vc, vm FROM workers w WHERE w.id = b.wid"
    "     AND w.state = 'active'"
    "     AND (w.heartbeat_at > now() - make_interval(secs => fresh_s) OR w.id = me)"
    "     AND w.labels @> coalesce(want, '{}') FOR UPDATE;"
    "    IF FOUND THEN"
    "     SELECT coalesce(sum(s.cpu_count), 0), coalesce(sum(s.memory_mb), 0) INTO c, m"
    "      FROM sandboxes s WHERE s.worker_id = b.wid"
    "      AND s.desired_state IN ('running', 'paused') AND s.observed_state <> 'deleted';"
    "     IF (vc IS NULL OR vc - c >= cpus) AND (vm IS NULL OR vm - m >= mem) THEN"
    "      wid := b.wid; wgen := b.wgen; RETURN;"
    "     END IF;"
    "    END IF;"
    "    EXIT;"
    "   END IF;"
    "   BEGIN"
    "    PERFORM 1 FROM workers w WHERE w.id = b.wid FOR UPDATE SKIP LOCKED;"
    "    waited := NOT FOUND;"
    "    SELECT w.vcpus, w.memory_mb INTO vc, vm FROM workers w WHERE w.id = b.wid"
    "     AND w.state = 'active'"
    "     AND (w.heartbeat_at > now() - make_interval(secs => fresh_s) OR w.id = me)"
    "     AND w.labels @> coalesce(want, '{}') FOR UPDATE;"
    "    IF FOUND THEN"
    "     SELECT coalesce(sum(s.cpu_count), 0), coalesce(sum(s.memory_mb), 0) INTO c, m"
    "      FROM sandboxes s WHERE s.worker_id = b.wid"
    "      AND s.desired_state IN ('running', 'paused') AND s.observed_state <> 'deleted';"
    "     IF NOT waited AND c = b.used_c AND m = b.used_m THEN"
    "      wid := b.wid; wgen := b.wgen; RETURN;"
    "     END IF;"
    "     SELECT x.wid, x.wgen INTO wid, wgen"
    "      FROM space_place_best(cpus, mem, want, tmpl, fresh_s, me, prefer) x;"
    "     IF wid IS NOT DISTINCT FROM b.wid THEN RETURN; END IF;"
    "    END IF;"
    "    RAISE EXCEPTION USING ERRCODE = 'SPRTY';"
    "   EXCEPTION WHEN SQLSTATE 'SPRTY' THEN wid := NULL;"
    "   END;"
    "  END LOOP;"
    "  IF wid IS NULL THEN RAISE EXCEPTION USING ERRCODE = 'SPCAP', MESSAGE = format("
    "   'no worker has room for %s vCPUs and %s MiB%s', cpus, mem, CASE WHEN want IS NULL"
    "   OR want = '{}' THEN '' ELSE ' with labels ' || want::text END); END IF;"
    " END $p$;",
    /* 19: the loss sweep judges heartbeats only after reaching the database without a break
     * for a while (core/control/fleet.c), by the database's clock: leases.renewed_at is the
     * holder's last renewal, leases.since the start of its unbroken run of renewals. */
    "ALTER TABLE leases ADD COLUMN renewed_at timestamptz, ADD COLUMN since timestamptz;",
    /* 20: sandbox snapshots on many hosts (core/control/snap.h). snapshots.worker_id: the
     * worker whose runtime holds the snapshot's files (its sandbox's when it was taken; NULL
     * for older rows). A create from a snapshot runs only there: space_place_best takes a
     * prefer of "=<worker id>" as a requirement (that worker when it has room, else none: the
     * capacity error); any other prefer ranks as in 18. */
    "ALTER TABLE snapshots ADD COLUMN worker_id text;"
    "CREATE OR REPLACE FUNCTION space_place_best(cpus int, mem int, want jsonb, tmpl text,"
    "  fresh_s int, me text, prefer text, OUT wid text, OUT wgen bigint, OUT limited boolean,"
    "  OUT used_c bigint, OUT used_m bigint, OUT n bigint) LANGUAGE plpgsql VOLATILE AS $b$"
    " BEGIN"
    "  SELECT w.id, w.generation, w.vcpus IS NOT NULL OR w.memory_mb IS NOT NULL, u.c, u.m,"
    "   count(*) OVER () INTO wid, wgen, limited, used_c, used_m, n FROM workers w"
    "   CROSS JOIN LATERAL (SELECT coalesce(sum(s.cpu_count), 0) AS c,"
    "    coalesce(sum(s.memory_mb), 0) AS m FROM sandboxes s"
    "    WHERE (w.vcpus IS NOT NULL OR w.memory_mb IS NOT NULL) AND s.worker_id = w.id"
    "    AND s.desired_state IN ('running', 'paused') AND s.observed_state <> 'deleted') u"
    "   WHERE w.state = 'active'"
    "   AND (w.heartbeat_at > now() - make_interval(secs => fresh_s) OR w.id = me)"
    "   AND w.labels @> coalesce(want, '{}')"
    "   AND (w.vcpus IS NULL OR w.vcpus - u.c >= cpus)"
    "   AND (w.memory_mb IS NULL OR w.memory_mb - u.m >= mem)"
    "   AND (prefer IS NULL OR left(prefer, 1) <> '=' OR w.id = substr(prefer, 2))"
    "   ORDER BY w.id IS NOT DISTINCT FROM prefer DESC,"
    "    coalesce(w.templates -> coalesce(tmpl, '') @> jsonb_build_array(jsonb_build_object("
    "     'cpu_count', cpus, 'memory_mb', mem)), false) DESC,"
    "    w.templates ? coalesce(tmpl, '') DESC,"
    "    least(coalesce(w.vcpus - u.c, 1000000) * 4096, coalesce(w.memory_mb - u.m, 1000000000))"
    "    DESC, w.id LIMIT 1;"
    " END $b$;",
    /* 21: template builds on many workers (core/control/tmpl.h). template_builds.worker_id:
     * the worker that accepted the build and runs it (NULL for older rows and reservations
     * not started yet). A worker that restarts fails only its own unfinished builds; those of
     * a worker declared lost are failed by the fleet's sweep (core/control/fleet.c). */
    "ALTER TABLE template_builds ADD COLUMN worker_id text;",
    /* 22: sandbox snapshots for the whole fleet (core/control/snap.h). snapshots.shared: its
     * files are in the shared snapshot dir too (driver.h: SP_CKPT_SHARED), so a create from
     * it may be placed on any worker (its worker_id preferred: it holds a copy already). */
    "ALTER TABLE snapshots ADD COLUMN shared boolean NOT NULL DEFAULT false;",
    /* 23: a template version's sizes, for listings (core/control/svc.h). disk_mb: the capacity
     * of its sandboxes' disk; size_bytes: what its own image takes on the disk of the worker
     * that built it. Both written when the build that made it ends; NULL for older rows. */
    "ALTER TABLE template_versions ADD COLUMN disk_mb int, ADD COLUMN size_bytes bigint;",
};

int sp_migrate_latest(void)
{
    return (int)(sizeof(migrations) / sizeof(migrations[0]));
}

static int exec_ok(PGconn *c, const char *sql, sp_err_t *err)
{
    PGresult *r = PQexec(c, sql);
    ExecStatusType st = PQresultStatus(r);
    int ok = st == PGRES_COMMAND_OK || st == PGRES_TUPLES_OK;
    if (!ok) {
        sp_log(SP_LOG_ERROR, "migrate", "statement failed err=%s", PQresultErrorMessage(r));
        sp_err_set(err, SP_EUNAVAIL, "database migration failed");
    }
    PQclear(r);
    return ok ? 0 : -1;
}

static int record_version(PGconn *c, int v, sp_err_t *err)
{
    char num[16];
    snprintf(num, sizeof(num), "%d", v);
    const char *p[] = {num};
    PGresult *r = PQexecParams(c, "INSERT INTO schema_migrations(version) VALUES ($1::int)", 1,
                               NULL, p, NULL, NULL, 0);
    int ok = PQresultStatus(r) == PGRES_COMMAND_OK;
    if (!ok)
        sp_log(SP_LOG_ERROR, "migrate", "recording version failed err=%s",
               PQresultErrorMessage(r));
    PQclear(r);
    return ok ? 0 : sp_err_set(err, SP_EUNAVAIL, "database migration failed");
}

static int current_version(PGconn *c, int *v, sp_err_t *err)
{
    PGresult *r = PQexec(c, "SELECT coalesce(max(version),0) FROM schema_migrations");
    if (PQresultStatus(r) != PGRES_TUPLES_OK) {
        sp_log(SP_LOG_ERROR, "migrate", "reading version failed err=%s",
               PQresultErrorMessage(r));
        PQclear(r);
        return sp_err_set(err, SP_EUNAVAIL, "cannot read schema version");
    }
    *v = atoi(PQgetvalue(r, 0, 0));
    PQclear(r);
    return 0;
}

int sp_migrate_apply(PGconn *c, int *applied, sp_err_t *err)
{
    *applied = 0;
    /* The bookkeeping table is created under the same lock as the migrations, so servers
     * starting together do not race on CREATE TABLE IF NOT EXISTS. */
    if (exec_ok(c, "SET client_min_messages = warning", err) < 0 || exec_ok(c, "BEGIN", err) < 0)
        return -1;
    if (exec_ok(c, "SELECT pg_advisory_xact_lock(" MIGRATE_LOCK_ID ")", err) < 0 ||
        exec_ok(c,
                "CREATE TABLE IF NOT EXISTS schema_migrations ("
                " version int PRIMARY KEY, applied_at timestamptz NOT NULL DEFAULT now())",
                err) < 0 ||
        exec_ok(c, "COMMIT", err) < 0) {
        PQclear(PQexec(c, "ROLLBACK"));
        return -1;
    }
    for (;;) {
        if (exec_ok(c, "BEGIN", err) < 0)
            return -1;
        int v = 0;
        if (exec_ok(c, "SELECT pg_advisory_xact_lock(" MIGRATE_LOCK_ID ")", err) < 0 ||
            current_version(c, &v, err) < 0) {
            PQclear(PQexec(c, "ROLLBACK"));
            return -1;
        }
        if (v > sp_migrate_latest()) {
            PQclear(PQexec(c, "ROLLBACK"));
            return sp_err_set(err, SP_EINTERNAL,
                              "database schema version %d is newer than this server (%d)", v,
                              sp_migrate_latest());
        }
        if (v == sp_migrate_latest()) {
            PQclear(PQexec(c, "COMMIT"));
            return 0;
        }
        if (exec_ok(c, migrations[v], err) < 0 || record_version(c, v + 1, err) < 0) {
            PQclear(PQexec(c, "ROLLBACK"));
            return -1;
        }
        if (exec_ok(c, "COMMIT", err) < 0)
            return -1;
        sp_log(SP_LOG_INFO, "migrate", "applied version=%d", v + 1);
        (*applied)++;
    }
}
