// lib.mjs - the conformance suite's tiny runner and shared helpers.
//
// Scenarios register with scenario(area, name, fn); run.mjs runs them in order, one at a
// time, each under a deadline, and prints `area | scenario | result | ms`. Sandboxes made
// through newSandbox() are tagged with this run's id and killed at the end.
//
// Configuration comes only from the environment, exactly as for a user of the SDK:
//   E2B_API_URL, E2B_API_KEY, and either E2B_SANDBOX_URL (one plain-HTTP address) or
//   E2B_DOMAIN (+ NODE_EXTRA_CA_CERTS for a private CA: host-routing mode).
//   CONFORMANCE_TEMPLATE  template to create sandboxes from (default "base")
//   SP_TEST_TIMEOUT_MULT  stretches every deadline (slow machines, TCG)
import assert from 'node:assert/strict'
import { createHash, randomBytes } from 'node:crypto'
import { Sandbox } from 'e2b'

export const MULT = Number(process.env.SP_TEST_TIMEOUT_MULT || '1') || 1
export const TEMPLATE = process.env.CONFORMANCE_TEMPLATE || 'base'
// Lowercase alphanumerics: also usable inside metadata values and file names.
export const RUN_ID = 'c' + Date.now().toString(36) + randomBytes(3).toString('hex')

// Generous: a cold boot under TCG takes seconds, a 20 MiB upload more.
export const REQUEST_TIMEOUT_MS = 180_000 * MULT
export const SANDBOX_TIMEOUT_MS = 900_000

const scenarios = []
const created = new Set()

/** Registers one scenario. fn gets nothing and throws to fail. */
export function scenario(area, name, fn, { timeoutMs = 180_000 } = {}) {
  scenarios.push({ area, name, fn, timeoutMs: timeoutMs * MULT })
}

export function registered() {
  return scenarios
}

/** Creates a sandbox tagged with this run (metadata conformance=RUN_ID) and remembers it. */
export async function newSandbox(opts = {}) {
  const sbx = await Sandbox.create(TEMPLATE, {
    timeoutMs: SANDBOX_TIMEOUT_MS,
    requestTimeoutMs: REQUEST_TIMEOUT_MS,
    ...opts,
    metadata: { conformance: RUN_ID, ...(opts.metadata || {}) },
  })
  created.add(sbx.sandboxId)
  return sbx
}

export function forget(id) {
  created.delete(id)
}

/** A lazily created sandbox shared by one area's scenarios (the promise, failure included, is kept). */
export function sharedSandbox(opts = {}) {
  let p
  return () => (p ??= newSandbox(opts))
}

/** Kills every sandbox this run created; errors are reported, not thrown. */
export async function cleanup() {
  const failures = []
  for (const id of created) {
    try {
      await Sandbox.kill(id, { requestTimeoutMs: 60_000 * MULT })
    } catch (e) {
      failures.push(`${id}: ${e.message}`)
    }
  }
  created.clear()
  return failures
}

export const sleep = (ms) => new Promise((r) => setTimeout(r, ms))

/** Polls fn until it returns a truthy value; returns it. Throws the last error on timeout. */
export async function waitFor(what, fn, { timeoutMs = 30_000, intervalMs = 200 } = {}) {
  const deadline = Date.now() + timeoutMs * MULT
  let last
  for (;;) {
    try {
      const v = await fn()
      if (v) return v
      last = undefined
    } catch (e) {
      last = e
    }
    if (Date.now() > deadline) {
      throw new Error(`timed out waiting for ${what}` + (last ? `: ${last.message}` : ''))
    }
    await sleep(intervalMs)
  }
}

/** Asserts that promise rejects with an instance of cls; returns the error. */
export async function rejectsWith(promise, cls, what = '') {
  let err
  try {
    await promise
  } catch (e) {
    err = e
  }
  assert.ok(err !== undefined, `${what || cls.name}: expected ${cls.name}, call succeeded`)
  assert.ok(
    err instanceof cls,
    `${what || cls.name}: expected ${cls.name}, got ${err?.constructor?.name}: ${err?.message}`
  )
  return err
}

export function sha256(buf) {
  return createHash('sha256').update(buf).digest('hex')
}

/** Checks the environment before anything is sent anywhere; returns a problem or null. */
export function configProblem() {
  const e = process.env
  if (!e.E2B_API_KEY) return 'E2B_API_KEY is not set'
  if (!e.E2B_API_URL && !e.E2B_DOMAIN) {
    // The SDK would default to E2B's cloud: never do that by accident.
    return 'set E2B_API_URL (and E2B_SANDBOX_URL or E2B_DOMAIN) to the server under test'
  }
  if (!e.E2B_SANDBOX_URL && !e.E2B_DOMAIN) {
    return 'set E2B_SANDBOX_URL (single address) or E2B_DOMAIN (host routing)'
  }
  if (e.E2B_SANDBOX_URL && e.E2B_SANDBOX_URL.endsWith('/')) {
    return 'E2B_SANDBOX_URL must not end with "/" (the SDK would request //process.Process/...)'
  }
  if ((e.E2B_DEBUG || '').toLowerCase() === 'true') {
    return 'E2B_DEBUG=true makes the SDK skip kill/setTimeout calls: unset it'
  }
  return null
}
