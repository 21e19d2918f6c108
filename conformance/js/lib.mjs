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
//
// The settings above, the environment check, waitFor and sleep are ../common.mjs's (shared
// with the CLI suite), re-exported here for the scenario modules.
import assert from 'node:assert/strict'
import { createHash } from 'node:crypto'
import { Sandbox } from 'e2b'
import { MULT, REQUEST_TIMEOUT_MS, RUN_ID, TEMPLATE } from '../common.mjs'

export {
  MULT,
  REQUEST_TIMEOUT_MS,
  RUN_ID,
  TEMPLATE,
  configProblem,
  sleep,
  waitFor,
} from '../common.mjs'
export const SANDBOX_TIMEOUT_MS = 900_000

const scenarios = []
const created = new Set()

/** Thrown by a scenario that does not apply to this configuration: reported, not failed. */
export class Skip extends Error {}

export const SINGLE_ADDRESS = Boolean(process.env.E2B_SANDBOX_URL)

/** Skips in the host-routing run what would repeat the single-address run request for request
 * (why says so); the scenario still runs once, in the single-address mode. */
export function singleAddressOnly(why) {
  if (!SINGLE_ADDRESS) throw new Skip(`runs in the single-address mode only: ${why}`)
}

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
