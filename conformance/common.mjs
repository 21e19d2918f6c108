// common.mjs - what the two Node conformance clients (js/: the SDK suite, cli/: the E2B CLI)
// share: the run's settings from the environment, the check that a server under test is
// named, a poll loop, and the deadline each scenario runs under. It imports no package: js/
// and cli/ each install their own pinned node_modules, and a bare import here would resolve
// to neither.
//
//   SP_TEST_TIMEOUT_MULT  stretches every deadline (slow machines, TCG)
//   CONFORMANCE_TEMPLATE  template to create sandboxes from (default "base")
//   CONFORMANCE_VERBOSE   prints late rejections and failures' stacks
import { randomBytes } from 'node:crypto'

export const MULT = Number(process.env.SP_TEST_TIMEOUT_MULT || '1') || 1
export const TEMPLATE = process.env.CONFORMANCE_TEMPLATE || 'base'
// Lowercase alphanumerics: also usable inside metadata values, template and file names.
export const RUN_ID = 'c' + Date.now().toString(36) + randomBytes(3).toString('hex')
// Generous: a cold boot under TCG takes seconds, a 20 MiB upload or a template build more.
export const REQUEST_TIMEOUT_MS = 180_000 * MULT

export const sleep = (ms) => new Promise((r) => setTimeout(r, ms))

/** Polls fn until it returns a truthy value; returns it. Throws the last error on timeout
 * (timeoutMs stretched by MULT). */
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

/** Checks the environment before anything is sent anywhere; returns a problem or null. */
export function configProblem() {
  const e = process.env
  if (!e.E2B_API_KEY) return 'E2B_API_KEY is not set'
  if (!e.E2B_API_URL && !e.E2B_DOMAIN) {
    // The SDK and the CLI would default to E2B's cloud: never do that by accident.
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

/** Where the sandboxes are reached, for the run's first line. */
export function sandboxTarget() {
  return process.env.E2B_SANDBOX_URL
    ? `sandbox URL ${process.env.E2B_SANDBOX_URL}`
    : `domain ${process.env.E2B_DOMAIN}`
}

/** p, or a rejection once ms passed. A hung call must not hang the suite: each scenario races
 * a deadline, and what it left running is abandoned (the process exits at the end). */
export function withDeadline(p, ms) {
  let t
  const deadline = new Promise((_, reject) => {
    t = setTimeout(() => reject(new Error(`scenario deadline of ${ms} ms passed`)), ms)
  })
  return Promise.race([p, deadline]).finally(() => clearTimeout(t))
}

// Late rejections from abandoned work (a stream cut when its sandbox died) are not failures
// of whatever scenario runs at that moment; they are noted and the run goes on.
process.on('unhandledRejection', (e) => {
  if (process.env.CONFORMANCE_VERBOSE) console.error(`(late rejection: ${e?.message ?? e})`)
})
